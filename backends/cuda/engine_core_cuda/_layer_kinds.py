"""Each layer's kind of attention, read from an HF ``config.json`` (no torch).

A layer is ``"full_attention"``, ``"sliding_attention"`` (it sees the last ``sliding_window`` keys,
its own included) or ``"chunked_attention"`` (attention restarts every ``attention_chunk_size``
tokens): Hugging Face's ``layer_types`` names, which are also what the KV-cache manager groups
layers by. Where a config has no ``layer_types`` they follow from the architecture: Mistral's
``sliding_window`` applies to every layer, Gemma 2 and gpt-oss alternate window and full layers
(window first), Gemma 3 has ``sliding_window_pattern - 1`` window layers before each full one.

:class:`LayerAttention` is what one layer's attention computes besides the causal softmax:
its score scale, its window or chunk, and its logit soft cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["GEMMA_ARCHITECTURES", "LAYER_TYPES", "LayerAttention", "layer_types_of", "logit_fields"]

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Hugging Face's defaults where a Gemma config leaves a field out.
_GEMMA_DEFAULTS: dict[str, dict[str, float | None]] = {
    "Gemma2ForCausalLM": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "Gemma3ForCausalLM": {"attn_logit_softcapping": None, "final_logit_softcapping": None},
}


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """One layer's attention parameters (the kernels' per-layer arguments)."""

    kind: str = "full_attention"
    scale: float = 1.0
    """Multiplies ``q . k`` (``head_size ** -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``)."""
    window: int | None = None
    """Sliding window: the query at ``p`` sees keys ``p - window + 1 .. p``."""
    chunk: int | None = None
    """Chunked local attention: the query at ``p`` sees keys from ``p // chunk * chunk``."""
    softcap: float | None = None
    """Scores become ``softcap * tanh(score / softcap)`` (Gemma 2)."""

    @property
    def span(self) -> int | None:
        """The most keys one query sees (None: unbounded)."""
        if self.window is None:
            return self.chunk
        return self.window if self.chunk is None else min(self.window, self.chunk)


def _positive_number(
    hf: dict[str, Any], key: str, path: Path, default: float | None = None
) -> float | None:
    """``hf[key]`` as a finite number > 0, None when null, ``default`` when absent;
    ``ValueError`` naming the key otherwise."""
    value = hf.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"model: {path} has an invalid {key} {value!r}")
    if value <= 0:
        raise ValueError(f"model: {path} has {key} {value!r}; it must be > 0")
    return float(value)


def _positive_int(hf: dict[str, Any], key: str, path: Path) -> int | None:
    value = hf.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"model: {path} has an invalid {key} {value!r} (an int > 0 or null)")
    return value


def _default_layer_types(hf: dict[str, Any], architecture: str, num_layers: int,
                         window: int | None, path: Path) -> list[str]:  # fmt: skip
    if architecture in ("Gemma2ForCausalLM", "GptOssForCausalLM"):
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if architecture == "Gemma3ForCausalLM":
        pattern = _positive_int(hf, "sliding_window_pattern", path) or 6
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM") and window is not None:
        return ["sliding_attention"] * num_layers
    return ["full_attention"] * num_layers


def layer_types_of(
    hf: dict[str, Any], architecture: str, num_layers: int, path: Path
) -> tuple[tuple[str, ...], int | None, int | None]:
    """``(layer_types, sliding_window, attention_chunk_size)`` of a config: one type per
    layer, the window (None when no layer slides) and the chunk (None when no layer is
    chunked). ``ValueError`` naming the field: ``layer_types`` whose length is not
    ``num_hidden_layers``, an unknown type, a window or chunk layer without its size."""
    window = _positive_int(hf, "sliding_window", path)
    chunk = _positive_int(hf, "attention_chunk_size", path)
    given = hf.get("layer_types")
    if given is None:
        types = _default_layer_types(hf, architecture, num_layers, window, path)
    elif not isinstance(given, list) or not all(isinstance(t, str) for t in given):
        raise ValueError(f"model: {path} has an invalid layer_types {given!r} (a list of names)")
    elif len(given) != num_layers:
        raise ValueError(
            f"model: {path}: layer_types has {len(given)} entries but num_hidden_layers is "
            f"{num_layers}"
        )
    else:
        types = list(given)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(
            f"model: {path} has layer_types {', '.join(map(repr, unknown))}; supported: "
            f"{', '.join(LAYER_TYPES)}"
        )
    for kind, size, key in (("sliding_attention", window, "sliding_window"),
                            ("chunked_attention", chunk, "attention_chunk_size")):  # fmt: skip
        if kind in types and size is None:
            raise ValueError(f"model: {path} has {kind} layers but no {key}")
    return (
        tuple(types),
        window if "sliding_attention" in types else None,
        chunk if "chunked_attention" in types else None,
    )


def logit_fields(hf: dict[str, Any], architecture: str, path: Path) -> dict[str, float | None]:
    """Gemma's score scale and soft caps (``ModelConfig`` fields; None for other
    architectures): ``query_pre_attn_scalar`` (256 when absent), ``attn_logit_softcapping``
    and ``final_logit_softcapping``. Gemma 3 has no attention soft-capping (transformers
    ignores the field there), only the final one when set."""
    fields: dict[str, float | None] = {
        "query_pre_attn_scalar": None,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    }
    defaults = _GEMMA_DEFAULTS.get(architecture)
    if defaults is None:
        return fields
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"model: {path} sets use_bidirectional_attention, which is not supported")
    fields["query_pre_attn_scalar"] = _positive_number(hf, "query_pre_attn_scalar", path, 256)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        fields[key] = _positive_number(hf, key, path, defaults[key])
    if architecture == "Gemma3ForCausalLM":
        fields["attn_logit_softcapping"] = None
    return fields
