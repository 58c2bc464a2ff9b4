"""PEFT adapter directories for the LoRA tests: ``adapter_config.json`` and the mock's
``mock.json`` (its greedy offset)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine_core import LoRARequest


def make_adapter(
    root: Path,
    name: str,
    lora_int_id: int,
    *,
    offset: int | None = None,
    rank: int = 8,
    target_modules: list[str] | None = None,
    **extra: Any,
) -> LoRARequest:
    """A PEFT-style adapter directory ``root/name``; ``offset`` shifts the mock's greedy rule."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": target_modules or ["q_proj", "v_proj"],
        "base_model_name_or_path": None,
        **extra,
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    if offset is not None:
        (path / "mock.json").write_text(json.dumps({"offset": offset}))
    return LoRARequest(name, lora_int_id, str(path))
