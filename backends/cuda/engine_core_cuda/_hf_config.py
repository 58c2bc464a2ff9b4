"""The architecture of an HF model directory, read from its ``config.json`` (no torch).

Both spellings of the RoPE settings are accepted: the published one (``rope_theta`` and
``rope_scaling``, ``torch_dtype``) and the one newer transformers write (``rope_parameters``,
``dtype``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "RopeConfig", "load_model_config"]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding: base ``theta`` and an optional frequency scaling."""

    theta: float
    scaling: str = "default"
    """``"default"`` (none), ``"linear"`` or ``"llama3"``."""
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly: full attention is exact below a sliding window."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

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


def _rope(hf: dict[str, Any], path: Path) -> RopeConfig:
    scaling: dict[str, Any] = dict(hf.get("rope_scaling") or {})
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        scaling.update(params)
    theta = scaling.get("rope_theta", hf.get("rope_theta", 10000.0))
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
    return RopeConfig(
        float(theta),
        "llama3",
        float(scaling["factor"]),
        float(scaling["low_freq_factor"]),
        float(scaling["high_freq_factor"]),
        int(scaling["original_max_position_embeddings"]),
    )


def _sliding_window(hf: dict[str, Any], architecture: str, path: Path) -> int | None:
    window = hf.get("sliding_window")
    if architecture.startswith("Qwen"):
        if not hf.get("use_sliding_window", False):
            return None
        raise ValueError(f"model: {path} sets use_sliding_window, which is not supported")
    if isinstance(window, int) and window > 0:
        return window
    return None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` of ``model_dir``. Raises ``FileNotFoundError`` when it is missing and
    ``ValueError`` naming the problem for an unsupported architecture or an invalid field."""
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
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"model: {path} uses hidden_act {act!r}; only 'silu' is supported")
    num_heads = _int(hf, "num_attention_heads", path)
    hidden_size = _int(hf, "hidden_size", path)
    num_kv_heads = _int(hf, "num_key_value_heads", path, num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"model: {path}: num_attention_heads ({num_heads}) is not a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    head_size = hf.get("head_dim") or hidden_size // num_heads
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = bool(hf.get("attention_bias", False))
    dtype = hf.get("torch_dtype") or hf.get("dtype")
    return ModelConfig(
        architecture=architecture,
        vocab_size=_int(hf, "vocab_size", path),
        hidden_size=hidden_size,
        intermediate_size=_int(hf, "intermediate_size", path),
        num_layers=_int(hf, "num_hidden_layers", path),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=int(head_size),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_int(hf, "max_position_embeddings", path, 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=architecture == "Qwen3ForCausalLM",
        rope=_rope(hf, path),
        checkpoint_dtype=dtype if isinstance(dtype, str) else None,
        sliding_window=_sliding_window(hf, architecture, path),
    )
