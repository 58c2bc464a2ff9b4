"""Random PEFT LoRA adapters of the tiny models, written offline with ``peft`` (float32,
``lora_B`` non-zero), and the transformers model with each merged in (the reference)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ADAPTERS: dict[str, dict[str, Any]] = {
    # Every served module, rank 8.
    "all": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj",
            "o_proj", "gate_proj", "up_proj", "down_proj"]},
    # Attention only, rsLoRA scaling.
    "attn": {"r": 8, "lora_alpha": 8, "use_rslora": True,
             "target_modules": ["q_proj", "v_proj", "o_proj"]},
    # The MLP only, a smaller rank.
    "mlp": {"r": 4, "lora_alpha": 12, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    # k and the MLP's down projection, rank 8.
    "kdown": {"r": 8, "lora_alpha": 32, "target_modules": ["k_proj", "down_proj"]},
}  # fmt: skip


@dataclass
class Adapter:
    name: str
    path: Path
    merged: torch.nn.Module
    """The base model with this adapter merged in (transformers, float32)."""


def build_adapter(base: torch.nn.Module, name: str, directory: Path, seed: int) -> Adapter:
    """Write adapter ``name`` of :data:`ADAPTERS` for ``base`` into ``directory``."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(**ADAPTERS[name], lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # large enough to change the greedy tokens
        for param_name, param in model.named_parameters():
            if "lora_" in param_name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(str(directory))
    merged = model.merge_and_unload().eval()
    return Adapter(name, directory, merged)
