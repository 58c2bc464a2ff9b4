"""The mock's ``backend_options`` and model geometry, validated once at construction."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engine_core.config import EngineConfig
from engine_core_mock._copy import CopyRule, parse_copy
from engine_core_mock._drafter import SpecOptions, parse_spec
from engine_core_mock._kv_link import KVLinkOptions, parse_kv_link
from engine_core_mock._layout import LAYER_TYPES
from engine_core_mock._replies import Reply, parse_replies

__all__ = ["Fault", "Latency", "MockOptions", "ModelGeometry", "parse_options"]

OPTION_NAMES = frozenset(
    {
        "vocab_size",
        "num_layers",
        "num_kv_heads",
        "head_size",
        "dtype_bytes",
        "device_memory_bytes",
        "weight_bytes",
        "max_model_len",
        "latency",
        "load_s",
        "fault",
        "replies",
        "tensor_parallel_size",
        "tensor_parallel_memory_bytes",
        "spec",
        "copy_prompt",
        "layer_types",
        "sliding_window",
        "attention_chunk_size",
        "kv_link",
        "lora",
    }
)
_LATENCY_KEYS = ("step_s", "per_token_s", "per_context_token_s")
_FAULT_KINDS = ("raise", "exit", "hang", "freeze")

# The synthetic model: a Llama-8B-like KV geometry on a 16 GiB device.
SYNTHETIC_NUM_LAYERS = 32
SYNTHETIC_NUM_KV_HEADS = 8
SYNTHETIC_HEAD_SIZE = 128
SYNTHETIC_DTYPE_BYTES = 2
SYNTHETIC_DEVICE_MEMORY_BYTES = 16 << 30
BYTE_VOCAB_SIZE = 258
"""Byte tokenizer: ids 0-255 are bytes, 256 is BOS, 257 is EOS."""

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True, slots=True)
class Latency:
    """Simulated duration of one forward pass:
    ``step_s + per_token_s * scheduled tokens + per_context_token_s * context tokens``, where the
    context tokens of a step are the sum over its batch of computed + scheduled tokens."""

    step_s: float = 0.0
    per_token_s: float = 0.0
    per_context_token_s: float = 0.0

    def duration(self, num_scheduled_tokens: int, num_context_tokens: int) -> float:
        """Seconds one step with these token counts takes."""
        return (
            self.step_s
            + self.per_token_s * num_scheduled_tokens
            + self.per_context_token_s * num_context_tokens
        )


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault injected at the ``at_step``-th call of ``execute_model`` (1-based)."""

    kind: Literal["raise", "exit", "hang", "freeze"]
    at_step: int
    rank: int | None = None
    """Only the engine of this ``data_parallel_rank`` fails (None: every engine)."""


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """What the mock pretends to load: KV shape, vocabulary, memory and context limit."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    vocab_size: int
    device_memory_bytes: int
    weight_bytes: int
    max_model_len: int | None
    layer_types: tuple[str, ...] | None = None
    """Per layer, Hugging Face's kind (``"full_attention"``, ``"sliding_attention"``,
    ``"chunked_attention"``); None: every layer full attention, one ``KVCacheSpec``."""
    sliding_window: int | None = None
    chunk_size: int | None = None
    """``attention_chunk_size`` of chunked-local layers."""


@dataclass(frozen=True, slots=True)
class MockOptions:
    """The parsed ``backend_options`` of a mock backend."""

    geometry: ModelGeometry
    latency: Latency | None
    fault: Fault | None
    load_s: float = 0.0
    """Seconds that constructing the backend takes (a model load)."""
    replies: tuple[Reply, ...] = ()
    """Scripted replies (``engine_core_mock._replies``)."""
    tensor_parallel_size: int = 1
    """Ranks to pretend: rank 0 is the backend, 1..N-1 dummy worker processes."""
    rank_memory_bytes: tuple[int, ...] | None = None
    """Per-rank device memory (``tensor_parallel_memory_bytes``), else ``device_memory_bytes``
    on every rank."""
    spec: SpecOptions | None = None
    """The drafter and its latency (``engine_core_mock._drafter``); None: no drafts."""
    copy: CopyRule | None = None
    """Outputs that copy spans of the prompt (``engine_core_mock._copy``)."""
    kv_link: KVLinkOptions | None = None
    """The host KV tier's modelled link and host pool (``engine_core_mock._kv_link``)."""


def _int_option(name: str, value: Any, *, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"backend_options[{name!r}] must be an int >= {minimum}, got {value!r}")
    return value


def _parse_latency(value: Any) -> Latency | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"backend_options['latency'] must be a dict, got {value!r}")
    unknown = sorted(set(value) - set(_LATENCY_KEYS))
    if unknown:
        raise ValueError(
            f"backend_options['latency'] has unknown key(s) {unknown}; "
            f"known: {', '.join(_LATENCY_KEYS)}"
        )
    latency = Latency(**{k: _seconds(f"'latency'][{k!r}", v) for k, v in value.items()})
    return latency if latency != Latency() else None


def _seconds(name: str, value: Any) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not value >= 0
        or value == float("inf")
    ):
        raise ValueError(f"backend_options[{name}] must be a finite number >= 0, got {value!r}")
    return float(value)


def _parse_fault(value: Any) -> Fault | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not {"kind", "at_step"} <= set(value) <= {
        "kind",
        "at_step",
        "rank",
    }:
        raise ValueError(
            "backend_options['fault'] must be a dict with the keys 'kind' and 'at_step' "
            f"(and optionally 'rank'), got {value!r}"
        )
    rank = value.get("rank")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
        raise ValueError(f"backend_options['fault']['rank'] must be an int >= 0, got {rank!r}")
    kind = value["kind"]
    if kind not in _FAULT_KINDS:
        raise ValueError(
            f"backend_options['fault']['kind'] must be one of {', '.join(_FAULT_KINDS)}, "
            f"got {kind!r}"
        )
    at_step = value["at_step"]
    if not isinstance(at_step, int) or isinstance(at_step, bool) or at_step < 1:
        raise ValueError(
            f"backend_options['fault']['at_step'] must be an int >= 1, got {at_step!r}"
        )
    return Fault(kind, at_step, rank)


def dtype_bytes(dtype: str, name: str) -> int:
    """Bytes of one element of ``dtype`` (``name`` says where the value came from)."""
    normalized = dtype.lower().removeprefix("torch.")
    if normalized.startswith(("float8", "fp8")):
        return 1
    if normalized not in _DTYPE_BYTES:
        raise ValueError(f"{name} {dtype!r} is not a known dtype ({', '.join(_DTYPE_BYTES)})")
    return _DTYPE_BYTES[normalized]


def _read_hf_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: cannot read the model config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"model: {path} does not hold a JSON object")
    # Multimodal configs keep the language model's geometry under text_config.
    text_config = data.get("text_config")
    if "num_hidden_layers" not in data and isinstance(text_config, dict):
        data = {**data, **text_config}
    return data


def _hf_geometry(path: Path) -> dict[str, Any]:
    """Geometry fields of the HF config at ``path`` (optional ones absent when missing)."""
    hf = _read_hf_config(path)

    def need(key: str) -> int:
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"model: {path} has no valid {key!r} (got {value!r})")
        return value

    found: dict[str, Any] = {"num_layers": need("num_hidden_layers")}
    num_heads = need("num_attention_heads")
    found["num_kv_heads"] = hf.get("num_key_value_heads") or num_heads
    found["head_size"] = hf.get("head_dim") or need("hidden_size") // num_heads
    dtype = hf.get("torch_dtype") or hf.get("dtype")
    if isinstance(dtype, str):
        found["dtype_bytes"] = dtype_bytes(dtype, f"model: torch_dtype in {path}")
    if isinstance(hf.get("vocab_size"), int):
        found["vocab_size"] = hf["vocab_size"]
    if isinstance(hf.get("max_position_embeddings"), int):
        found["max_model_len"] = hf["max_position_embeddings"]
    found.update(_hf_layer_types(hf, path, found["num_layers"]))
    return found


def _hf_layer_types(hf: dict[str, Any], path: Path, num_layers: int) -> dict[str, Any]:
    """``layer_types``, ``sliding_window`` and ``attention_chunk_size`` of an HF config, with
    the architectures' defaults where ``layer_types`` is absent: Mistral's window on every
    layer, Gemma 2 alternating (window first), Gemma 3's ``sliding_window_pattern``."""
    found: dict[str, Any] = {}
    window = hf.get("sliding_window")
    chunk = hf.get("attention_chunk_size")
    types = hf.get("layer_types")
    model_type = hf.get("model_type", "")
    if types is None and isinstance(window, int) and window > 0:
        if model_type in ("mistral", "qwen2", "ministral") and hf.get("use_sliding_window", True):
            types = ["sliding_attention"] * num_layers
        elif model_type == "gemma2":
            types = [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
            ]
        elif model_type in ("gemma3", "gemma3_text"):
            pattern = hf.get("sliding_window_pattern", 6)
            types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(num_layers)
            ]
    if types is not None:
        found["layer_types"] = types
        found["_layer_types_from"] = f"layer_types in {path}"
    if window is not None:
        found["sliding_window"] = window
    if chunk is not None:
        found["attention_chunk_size"] = chunk
    return found


def _parse_layer_types(values: dict[str, Any], options: dict[str, Any]) -> None:
    """Validate the layer kinds (options over the model's config) in ``values``."""
    source = values.pop("_layer_types_from", "backend_options['layer_types']")
    for key in ("layer_types", "sliding_window", "attention_chunk_size"):
        if options.get(key) is not None:
            values[key] = options[key]
            if key == "layer_types":
                source = "backend_options['layer_types']"
    types = values.pop("layer_types", None)
    window = values.pop("sliding_window", None)
    chunk = values.pop("attention_chunk_size", None)
    values["layer_types"] = values["sliding_window"] = values["chunk_size"] = None
    if types is None:
        return
    num_layers = values["num_layers"]
    if not isinstance(types, list | tuple) or not all(isinstance(t, str) for t in types):
        raise ValueError(f"{source} must be a list of layer kinds, got {types!r}")
    if len(types) != num_layers:
        raise ValueError(
            f"{source} has {len(types)} entries but the model has {num_layers} layers "
            "(num_hidden_layers / backend_options['num_layers'])"
        )
    for i, kind in enumerate(types):
        if kind not in LAYER_TYPES:
            raise ValueError(f"{source}[{i}] is {kind!r}; known kinds: {', '.join(LAYER_TYPES)}")
    if "sliding_attention" in types:
        values["sliding_window"] = _int_option("sliding_window", window, minimum=1)
    if "chunked_attention" in types:
        values["chunk_size"] = _int_option("attention_chunk_size", chunk, minimum=1)
    values["layer_types"] = tuple(types)


def _tokenizer_vocab_size(name: str) -> int:
    """The vocabulary of the served tokenizer (added tokens included), so that every token the
    mock samples decodes to text."""
    if name == "byte":
        return BYTE_VOCAB_SIZE
    from engine_core.abc import load_tokenizer

    return load_tokenizer(name).vocab_size


def parse_options(config: EngineConfig) -> MockOptions:
    """Validate ``config.backend_options`` and resolve the model geometry: options, else the
    model's ``config.json`` when ``config.model`` is set, else the synthetic model."""
    options = dict(config.backend_options)
    unknown = sorted(set(options) - OPTION_NAMES)
    if unknown:
        raise ValueError(
            f"unknown mock backend_options {unknown}; known: {', '.join(sorted(OPTION_NAMES))}"
        )
    values: dict[str, Any] = {
        "num_layers": SYNTHETIC_NUM_LAYERS,
        "num_kv_heads": SYNTHETIC_NUM_KV_HEADS,
        "head_size": SYNTHETIC_HEAD_SIZE,
        "dtype_bytes": SYNTHETIC_DTYPE_BYTES,
        "vocab_size": None,
        "device_memory_bytes": SYNTHETIC_DEVICE_MEMORY_BYTES,
        "weight_bytes": 0,
        "max_model_len": None,
    }
    if config.model is not None:
        model_dir = Path(config.model)
        values.update(_hf_geometry(model_dir / "config.json"))
        values["weight_bytes"] = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    layer_keys = ("layer_types", "sliding_window", "attention_chunk_size", "_layer_types_from")
    layers = {k: values.pop(k) for k in layer_keys if k in values}
    if config.dtype != "auto":
        values["dtype_bytes"] = dtype_bytes(config.dtype, "dtype")
    if config.kv_cache_dtype != "auto":  # FP8 KV cache: one byte per element
        values["dtype_bytes"] = 1
    for name in values:
        if options.get(name) is not None:
            values[name] = _int_option(
                name, options[name], minimum=0 if name == "weight_bytes" else 1
            )
    values.update(layers)
    _parse_layer_types(values, options)
    if values["vocab_size"] is None:
        values["vocab_size"] = _tokenizer_vocab_size(config.tokenizer_name)
    tp = options.get("tensor_parallel_size")
    tp = 1 if tp is None else _int_option("tensor_parallel_size", tp, minimum=1)
    memory = options.get("tensor_parallel_memory_bytes")
    if memory is not None:
        if not isinstance(memory, list) or len(memory) != tp:
            raise ValueError(
                "backend_options['tensor_parallel_memory_bytes'] must be a list of one int per "
                f"rank ({tp}), got {memory!r}"
            )
        memory = tuple(_int_option("tensor_parallel_memory_bytes", m, minimum=1) for m in memory)
    return MockOptions(
        ModelGeometry(**values),
        _parse_latency(options.get("latency")),
        _parse_fault(options.get("fault")),
        0.0 if options.get("load_s") is None else _seconds("'load_s'", options["load_s"]),
        parse_replies(options.get("replies")),
        tp,
        memory,
        parse_spec(options.get("spec")),
        parse_copy(options.get("copy_prompt")),
        parse_kv_link(options.get("kv_link")),
    )
