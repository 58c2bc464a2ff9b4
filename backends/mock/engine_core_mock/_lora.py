"""The mock's LoRA adapters: a PEFT directory's ``adapter_config.json`` (the weights are
ignored) and an optional ``mock.json`` ``{"offset": k}`` that shifts greedy output (next =
previous + 1 + k), so tests tell adapters apart.

``backend_options["lora"]`` (all optional): ``max_rank`` (64), ``target_modules`` (the seven
Llama projections), ``per_lora_s`` (seconds a step costs per distinct adapter in it, with the
latency model) and ``load_s`` (seconds ``add_lora`` takes).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_core.lora import (
    LORA_TARGET_MODULES,
    LoRAError,
    LoRARequest,
    LoRASupport,
    check_adapter,
    read_adapter_config,
)

__all__ = ["LoRAOptions", "MockLoRAs", "parse_lora"]

MOCK_ARCHITECTURE = "MockForCausalLM"
"""The base architecture the mock serves when its model directory names none."""

_KEYS = ("max_rank", "target_modules", "per_lora_s", "load_s")


@dataclass(frozen=True, slots=True)
class LoRAOptions:
    max_rank: int = 64
    target_modules: frozenset[str] = LORA_TARGET_MODULES
    per_lora_s: float = 0.0
    load_s: float = 0.0


def parse_lora(value: Any) -> LoRAOptions:
    """``backend_options["lora"]`` (None: the defaults)."""
    if value is None:
        return LoRAOptions()
    if not isinstance(value, dict):
        raise ValueError(f"backend_options['lora'] must be a dict, got {value!r}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"backend_options['lora'] has unknown key(s) {unknown}; known: {', '.join(_KEYS)}"
        )
    max_rank = value.get("max_rank", 64)
    if not isinstance(max_rank, int) or isinstance(max_rank, bool) or max_rank < 1:
        raise ValueError(
            f"backend_options['lora']['max_rank'] must be an int >= 1, got {max_rank!r}"
        )
    modules = value.get("target_modules", sorted(LORA_TARGET_MODULES))
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise ValueError(
            f"backend_options['lora']['target_modules'] must be a list of names, got {modules!r}"
        )
    seconds = {}
    for key in ("per_lora_s", "load_s"):
        v = value.get(key, 0.0)
        if not isinstance(v, int | float) or isinstance(v, bool) or not v >= 0:
            raise ValueError(f"backend_options['lora'][{key!r}] must be seconds >= 0, got {v!r}")
        seconds[key] = float(v)
    return LoRAOptions(max_rank, frozenset(modules), **seconds)


def _architectures(model_dir: str | None) -> list[str]:
    """``architectures`` of ``config.json`` in ``model_dir`` (empty: none readable)."""
    if not model_dir:
        return []
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    found = raw.get("architectures") if isinstance(raw, dict) else None
    return [a for a in found if isinstance(a, str)] if isinstance(found, list) else []


class MockLoRAs:
    """The adapters the mock holds: id -> greedy offset. ``add_lora`` runs on the core's loader
    thread; it publishes an adapter with one dict assignment, which a step reading the dict in
    another thread sees whole or not at all."""

    def __init__(self, options: LoRAOptions, model: str | None, max_lora_rank: int) -> None:
        self.options = options
        self.support = LoRASupport(max_rank=options.max_rank, target_modules=options.target_modules)
        self.architecture = (_architectures(model) or [MOCK_ARCHITECTURE])[0]
        self.max_lora_rank = max_lora_rank
        self.offsets: dict[int, int] = {}
        self.num_adds = 0
        self.num_removes = 0

    def add(self, lora: LoRARequest) -> None:
        config = read_adapter_config(lora)
        check_adapter(lora, config, self.support, max(self.max_lora_rank, self.support.max_rank))
        name = lora.lora_name
        base = self._base_architecture(lora, config.base_model_name_or_path)
        if base is not None and base != self.architecture:
            raise LoRAError(
                name,
                f"the adapter is for base architecture {base}, the model is {self.architecture}",
            )
        offset = 0
        mock_json = os.path.join(lora.lora_path, "mock.json")
        if os.path.exists(mock_json):
            try:
                raw = json.loads(Path(mock_json).read_text())
            except (OSError, ValueError) as e:
                raise LoRAError(name, f"cannot read {mock_json}: {e}") from None
            value = raw.get("offset", 0) if isinstance(raw, dict) else None
            if not isinstance(value, int) or isinstance(value, bool):
                raise LoRAError(name, f"mock.json: offset must be an int, got {value!r}")
            offset = value
        if self.options.load_s:
            time.sleep(self.options.load_s)
        self.offsets[lora.lora_int_id] = offset  # published whole (one assignment)
        self.num_adds += 1

    def remove(self, lora_int_id: int) -> None:
        if self.offsets.pop(lora_int_id, None) is not None:
            self.num_removes += 1

    @staticmethod
    def _base_architecture(lora: LoRARequest, base_path: str | None) -> str | None:
        """The base architecture the adapter names: ``auto_mapping.base_model_class`` of its
        ``adapter_config.json``, else ``architectures`` of its base model's ``config.json``
        (None: it names none)."""
        try:
            raw = json.loads((Path(lora.lora_path) / "adapter_config.json").read_text())
        except (OSError, ValueError):
            raw = {}
        mapping = raw.get("auto_mapping") if isinstance(raw, dict) else None
        if isinstance(mapping, dict) and isinstance(mapping.get("base_model_class"), str):
            return str(mapping["base_model_class"])
        found = _architectures(base_path)
        return found[0] if found else None
