"""Weight quantisation of a model (no torch): the ``quantization_config`` of an HF checkpoint,
or ``EngineConfig.quantization``.

Served:

- FP8 checkpoints (e4m3 weights with their scales, activations quantised per token as they go):
  ``quant_method: "fp8"`` (per-tensor ``weight_scale``, or block-wise ``weight_scale_inv`` with
  ``weight_block_size`` 128×128 as DeepSeek publishes) and ``"compressed-tensors"`` in the
  ``float-quantized`` / ``naive-quantized`` formats with 8-bit float weights of the ``tensor``,
  ``channel`` or ``block`` strategy;
- ``EngineConfig.quantization="fp8"`` on a 16/32-bit checkpoint: quantised at load with
  per-output-channel scales.

Anything else (another method, 4-bit weights, integer types, …) is refused at startup with an
error naming the field, its value and what is served.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["QuantConfig", "is_ignored", "quant_config_of"]

METHODS = ("fp8", "compressed-tensors")
STRATEGIES = ("tensor", "channel", "block")
CT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """How a model's linear layers and experts hold their weights."""

    source: str
    """``"checkpoint"`` (FP8 weights and scales read as published) or ``"dynamic"`` (a 16/32-bit
    checkpoint quantised at load)."""
    strategy: str = "channel"
    """The checkpoint's weight scales: ``"tensor"``, ``"channel"`` or ``"block"`` (served as
    per-output-channel scales: a per-tensor scale repeated over its rows; blocks dequantised
    and requantised per channel at load)."""
    block: tuple[int, int] | None = None
    """``(rows, cols)`` of a block-wise scale."""
    ignore: tuple[str, ...] = ()
    """Checkpoint module names (or ``re:`` patterns) left unquantised."""


def is_ignored(module: str, ignore: tuple[str, ...]) -> bool:
    """Whether the checkpoint module ``module`` (e.g. ``model.layers.0.mlp.gate_proj``) is one the
    quantisation leaves alone."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif module == entry or module.endswith("." + entry):
            return True
    return False


def _refuse(path: Path, field: str, value: Any, supported: str) -> ValueError:
    return ValueError(
        f"model: {path} has quantization_config.{field}={value!r}, which the cuda backend does "
        f"not serve; supported: {supported}"
    )


def _block(value: Any, path: Path, field: str) -> tuple[int, int]:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise _refuse(path, field, value, "two positive ints, e.g. [128, 128]")
    return (value[0], value[1])


def _fp8_method(q: dict[str, Any], path: Path) -> QuantConfig:
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _refuse(path, "activation_scheme", scheme, "'dynamic', 'static'")
    ignore = tuple(q.get("modules_to_not_convert") or ()) + tuple(q.get("ignored_layers") or ())
    block = q.get("weight_block_size")
    if block is None:
        return QuantConfig("checkpoint", "tensor", None, ignore)
    return QuantConfig("checkpoint", "block", _block(block, path, "weight_block_size"), ignore)


def _compressed_tensors(q: dict[str, Any], path: Path) -> QuantConfig:
    fmt = q.get("format", "float-quantized")
    if fmt not in CT_FORMATS:
        raise _refuse(path, "format", fmt, ", ".join(CT_FORMATS) + " (FP8)")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _refuse(path, "config_groups", groups, "one or more groups of FP8 weights")
    strategies: set[str] = set()
    block: tuple[int, int] | None = None
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        where = f"config_groups.{name}.weights"
        if weights.get("num_bits") != 8:
            raise _refuse(path, f"{where}.num_bits", weights.get("num_bits"), "8")
        if weights.get("type") != "float":
            raise _refuse(path, f"{where}.type", weights.get("type"), "'float' (FP8)")
        strategy = weights.get("strategy", "tensor")
        if strategy not in STRATEGIES:
            raise _refuse(path, f"{where}.strategy", strategy, ", ".join(STRATEGIES))
        if strategy == "block":
            block = _block(weights.get("block_structure"), path, f"{where}.block_structure")
        strategies.add(strategy)
        acts = (group or {}).get("input_activations")
        if acts is not None and (acts.get("num_bits"), acts.get("type")) != (8, "float"):
            raise _refuse(
                path,
                f"config_groups.{name}.input_activations",
                {k: acts.get(k) for k in ("num_bits", "type")},
                "8-bit float activations, or none",
            )
    if len(strategies) > 1:
        raise _refuse(path, "config_groups", sorted(strategies), "one weight strategy per model")
    return QuantConfig("checkpoint", strategies.pop(), block, tuple(q.get("ignore") or ()))


def quant_config_of(hf: dict[str, Any], path: Path, requested: str | None) -> QuantConfig | None:
    """The quantisation of the checkpoint whose ``config.json`` (at ``path``) is ``hf``, or the
    one ``requested`` (``EngineConfig.quantization``) for an unquantised checkpoint. Raises
    ``ValueError`` naming the field for what is not served."""
    q = hf.get("quantization_config")
    if q is None:
        return QuantConfig("dynamic") if requested == "fp8" else None
    if not isinstance(q, dict):
        raise _refuse(path, "", q, "a JSON object")
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8_method(q, path)
    if method == "compressed-tensors":
        return _compressed_tensors(q, path)
    raise _refuse(path, "quant_method", method, ", ".join(repr(m) for m in METHODS) + " (FP8)")
