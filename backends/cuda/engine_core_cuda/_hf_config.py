"""The architecture of an HF model directory, read from its ``config.json`` (no torch).

Both spellings of the RoPE settings are accepted: the published one (``rope_theta`` and
``rope_scaling``, ``torch_dtype``; Gemma 3's ``rope_local_base_freq``) and the one newer
transformers write (``rope_parameters``, keyed by layer type for Gemma 3, and ``dtype``). Each
layer's kind of attention is read by :mod:`engine_core_cuda._layer_kinds`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_core_cuda._layer_kinds import (
    GEMMA_ARCHITECTURES,
    LayerAttention,
    layer_types_of,
    logit_fields,
)
from engine_core_cuda._moe_config import MOE_ARCHITECTURES, MoeConfig, moe_config_of
from engine_core_cuda._quant_config import QuantConfig, quant_config_of

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "RopeConfig", "load_model_config"]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *GEMMA_ARCHITECTURES,
    *MOE_ARCHITECTURES,
)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding: base ``theta`` and an optional frequency scaling."""

    theta: float
    scaling: str = "default"
    """``"default"`` (none), ``"linear"``, ``"llama3"`` or ``"yarn"`` (gpt-oss)."""
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    """YaRN: frequencies of more than ``beta_fast`` rotations over the original length are
    kept, those of fewer than ``beta_slow`` divided by ``factor``, the ones between ramped."""
    beta_slow: float = 1.0
    truncate: bool = True
    """YaRN: whether the ramp's ends are rounded to whole dimensions."""
    attention_factor: float = 1.0
    """YaRN: cos and sin are multiplied by it (``0.1 * ln(factor) + 1`` unless given)."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the model code needs to know about a decoder-only checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeConfig
    checkpoint_dtype: str | None
    sliding_window: int | None
    """The window of the ``"sliding_attention"`` layers (None: no layer slides)."""
    layer_types: tuple[str, ...] = ()
    """Each layer's attention kind (Hugging Face's names); empty: every layer full attention."""
    attention_chunk_size: int | None = None
    """The chunk of the ``"chunked_attention"`` layers."""
    hidden_act: str = "silu"
    """The MLP's gate activation: ``"silu"`` (SwiGLU) or ``"gelu_pytorch_tanh"`` (Gemma)."""
    local_rope: RopeConfig | None = None
    """Gemma 3: the RoPE of its sliding-window layers (``rope`` is the full layers')."""
    query_pre_attn_scalar: float | None = None
    """Gemma: scores are scaled by ``query_pre_attn_scalar ** -0.5`` instead of the head size's."""
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    moe: MoeConfig | None = None
    """Mixture-of-experts models: the experts of the layers ``moe.sparse_layers``."""
    quantization: QuantConfig | None = None
    """FP8 weights: an FP8 checkpoint's, or quantised at load (None: as the checkpoint is)."""
    attention_sinks: bool = False
    """gpt-oss: every attention layer has a learned logit per query head (``self_attn.sinks``)
    in its softmax's denominator."""
    mxfp4_experts: bool = False
    """The checkpoint's experts are MXFP4 (``quant_method: mxfp4``): dequantised at load."""

    def layer_is_moe(self, index: int) -> bool:
        """Whether layer ``index`` routes tokens to experts (else it has the dense MLP)."""
        return self.moe is not None and index in self.moe.sparse_layers

    @property
    def max_model_len(self) -> int:
        """Longest sequence served: window layers mask what is behind their window exactly."""
        return self.max_position_embeddings

    @property
    def is_gemma(self) -> bool:
        """Gemma's decoder: (1 + w) norms around both blocks, scaled embeddings."""
        return self.architecture in GEMMA_ARCHITECTURES

    def layer_type(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else "full_attention"

    def layer_attention(self, index: int) -> LayerAttention:
        """The attention parameters of layer ``index``."""
        kind = self.layer_type(index)
        scalar = self.query_pre_attn_scalar
        return LayerAttention(
            kind=kind,
            scale=(scalar if scalar is not None else self.head_size) ** -0.5,
            window=self.sliding_window if kind == "sliding_attention" else None,
            chunk=self.attention_chunk_size if kind == "chunked_attention" else None,
            softcap=self.attn_logit_softcapping,
        )

    def layer_rope(self, index: int) -> RopeConfig:
        """The RoPE of layer ``index``."""
        if self.local_rope is not None and self.layer_type(index) == "sliding_attention":
            return self.local_rope
        return self.rope

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"model: {path.parent} has no {path.name}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"model: {path} does not hold a JSON object")
    return data


def _int(hf: dict[str, Any], key: str, path: Path, default: int | None = None) -> int:
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"model: {path} has no valid {key!r} (got {value!r})")
    return value


def _rope(hf: dict[str, Any], path: Path, layer_type: str | None = None) -> RopeConfig:
    """The RoPE settings; with ``layer_type`` (Gemma 3) those of that kind of layer:
    ``rope_parameters[layer_type]``, or the published fields (window layers:
    ``rope_local_base_freq``, unscaled; full layers: ``rope_theta``, 1e6 when absent, and
    ``rope_scaling``)."""
    scaling: dict[str, Any] = dict(hf.get("rope_scaling") or {})
    params = hf.get("rope_parameters")
    default_theta = hf.get("rope_theta", 10000.0)
    if layer_type is not None:
        if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        if layer_type == "sliding_attention":
            scaling = {}
            default_theta = hf.get("rope_local_base_freq", 10000.0)
        else:
            default_theta = hf.get("rope_theta", 1_000_000.0)
    if isinstance(params, dict):
        scaling.update(params)
    theta = scaling.get("rope_theta", default_theta)
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"model: {path} has an invalid rope_theta {theta!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"model: {path} uses RoPE scaling {kind!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    if kind == "default":
        return RopeConfig(float(theta))
    if kind == "linear":
        return RopeConfig(float(theta), "linear", float(scaling["factor"]))
    if kind == "yarn":
        return _yarn(float(theta), scaling, hf, path)
    return RopeConfig(
        float(theta),
        "llama3",
        float(scaling["factor"]),
        float(scaling["low_freq_factor"]),
        float(scaling["high_freq_factor"]),
        int(scaling["original_max_position_embeddings"]),
    )


def _yarn(theta: float, scaling: dict[str, Any], hf: dict[str, Any], path: Path) -> RopeConfig:
    """YaRN as transformers computes it: ``factor`` (default: ``max_position_embeddings /
    original_max_position_embeddings``), the ramp ``beta_fast``/``beta_slow``, ``truncate`` and
    the cos/sin factor ``attention_factor`` (else from ``mscale``/``mscale_all_dim``, else
    ``0.1 * ln(factor) + 1``)."""
    original = scaling.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise ValueError(
            f"model: {path} has YaRN RoPE without a valid original_max_position_embeddings "
            f"(got {original!r})"
        )
    factor = scaling.get("factor") or hf.get("max_position_embeddings", original) / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeConfig(
        theta,
        "yarn",
        factor,
        original_max_position_embeddings=original,
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        truncate=bool(scaling.get("truncate", True)),
        attention_factor=float(attention),
    )


def _layer_types(
    hf: dict[str, Any], architecture: str, num_layers: int, path: Path
) -> tuple[tuple[str, ...], int | None, int | None]:
    """:func:`~engine_core_cuda._layer_kinds.layer_types_of`; Qwen's ``sliding_window`` means
    nothing unless ``use_sliding_window`` is set, which is refused."""
    if architecture.startswith("Qwen"):
        if hf.get("use_sliding_window", False):
            raise ValueError(f"model: {path} sets use_sliding_window, which is not supported")
        hf = {**hf, "sliding_window": None, "layer_types": None}
    return layer_types_of(hf, architecture, num_layers, path)


def _mxfp4_experts(hf: dict[str, Any], architecture: str, path: Path) -> bool:
    """Whether the checkpoint's experts are MXFP4 (``quantization_config.quant_method:
    mxfp4``, gpt-oss's published format; dequantised at load)."""
    q = hf.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "mxfp4":
        return False
    if architecture != "GptOssForCausalLM":
        raise ValueError(
            f"model: {path} has quantization_config.quant_method='mxfp4', which the cuda backend "
            f"serves only for GptOssForCausalLM's experts (not {architecture})"
        )
    return True


def load_model_config(model_dir: str | Path, quantization: str | None = None) -> ModelConfig:
    """Read ``config.json`` of ``model_dir``; ``quantization`` is ``EngineConfig.quantization``.
    Raises ``FileNotFoundError`` when it is missing and ``ValueError`` naming the problem for an
    unsupported architecture, quantisation or an invalid field."""
    path = Path(model_dir) / "config.json"
    hf = _read(path)
    architectures = hf.get("architectures") or []
    supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ValueError(
            f"model: architecture {', '.join(map(str, architectures)) or '(none)'} in {path} is "
            f"not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    architecture = supported[0]
    gemma = architecture in GEMMA_ARCHITECTURES
    act = hf.get("hidden_activation") if gemma else None
    act = act or hf.get("hidden_act", "gelu_pytorch_tanh" if gemma else "silu")
    if act not in ACTIVATIONS:
        raise ValueError(
            f"model: {path} uses hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}"
        )
    num_heads = _int(hf, "num_attention_heads", path)
    hidden_size = _int(hf, "hidden_size", path)
    num_kv_heads = _int(hf, "num_key_value_heads", path, num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"model: {path}: num_attention_heads ({num_heads}) is not a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    head_size = hf.get("head_dim") or hidden_size // num_heads
    is_qwen2 = architecture == "Qwen2ForCausalLM" or (
        architecture == "Qwen2MoeForCausalLM" and bool(hf.get("qkv_bias", True))
    )
    gpt_oss = architecture == "GptOssForCausalLM"
    attention_bias = bool(hf.get("attention_bias", gpt_oss))
    dtype = hf.get("torch_dtype") or hf.get("dtype")
    num_layers = _int(hf, "num_hidden_layers", path)
    gemma3 = architecture == "Gemma3ForCausalLM"
    layer_types, window, chunk = _layer_types(hf, architecture, num_layers, path)
    mxfp4 = _mxfp4_experts(hf, architecture, path)
    quant = quant_config_of(
        {k: v for k, v in hf.items() if k != "quantization_config"} if mxfp4 else hf,
        path,
        quantization,
    )
    if gpt_oss and quant is not None and quant.source != "dynamic":
        raise ValueError(
            f"model: {path} is an FP8 checkpoint of {architecture}, which the cuda backend does "
            "not serve (its bf16 and MXFP4 checkpoints load, and quantization='fp8' quantises "
            "them as they load)"
        )
    return ModelConfig(
        architecture=architecture,
        vocab_size=_int(hf, "vocab_size", path),
        hidden_size=hidden_size,
        intermediate_size=_int(hf, "intermediate_size", path),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=int(head_size),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_int(hf, "max_position_embeddings", path, 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        rope=_rope(hf, path, "full_attention" if gemma3 else None),
        checkpoint_dtype=dtype if isinstance(dtype, str) else None,
        sliding_window=window,
        layer_types=layer_types,
        attention_chunk_size=chunk,
        hidden_act=act,
        local_rope=_rope(hf, path, "sliding_attention") if gemma3 else None,
        **logit_fields(hf, architecture, path),
        moe=(
            moe_config_of(hf, architecture, num_layers, path)
            if architecture in MOE_ARCHITECTURES
            else None
        ),
        quantization=quant,
        attention_sinks=gpt_oss,
        mxfp4_experts=mxfp4,
    )
