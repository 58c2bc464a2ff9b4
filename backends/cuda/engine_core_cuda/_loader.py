"""Filling a :class:`~engine_core_cuda._model.CausalLM` with weights: from the safetensors files
of an HF directory (one file, or shards listed by ``model.safetensors.index.json``), or random
ones for benchmarks.

A fused matrix is loaded shard by shard: the rows of shard ``s`` of ``...qkv_proj`` or
``...gate_up_proj`` come from the checkpoint's ``...{s}_proj``; a mixture-of-experts block's
stacked expert weights come from the checkpoint's per-expert matrices
(:meth:`~engine_core_cuda._moe.SparseMoeBlock.checkpoint_targets`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine_core_cuda._layers import Linear
from engine_core_cuda._model import CausalLM
from engine_core_cuda._moe import SparseMoeBlock

if TYPE_CHECKING:
    from engine_core_cuda._tp.shard import Slice

Slicer = Callable[[str, int], "Slice | None"]
"""Tensor parallelism: checkpoint tensor (name, ndim) -> the part this rank reads (None: all)."""

__all__ = ["checkpoint_files", "checkpoint_tensors", "init_random_weights", "load_weights"]

_INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of ``model_dir``. Raises ``FileNotFoundError`` naming what is
    missing."""
    directory = Path(model_dir)
    index = directory / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"model: {directory} lacks the shard(s) {', '.join(missing)} listed in {_INDEX}"
            )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"model: {directory} has no weights (model.safetensors, or shards and {_INDEX})"
        )
    return files


def _targets(model: CausalLM) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Checkpoint tensor name -> (parameter, first row, number of rows)."""
    targets: dict[str, tuple[torch.Tensor, int, int]] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, SparseMoeBlock):
            targets.update(module.checkpoint_targets(module_name))
        elif isinstance(module, Linear):
            parent = module_name.rpartition(".")[0]
            for shard, (start, rows) in module.shards.items():
                targets[f"{parent}.{shard}_proj.weight"] = (module.weight, start, rows)
                if module.bias is not None:
                    targets[f"{parent}.{shard}_proj.bias"] = (module.bias, start, rows)
    # Targets may be views into a parameter (a stacked expert's rows): it is covered too.
    fused = {id(t[0] if t[0]._base is None else t[0]._base) for t in targets.values()}
    for name, param in model.named_parameters():
        if id(param) not in fused:
            targets[name] = (param, 0, param.shape[0])
    return targets


def checkpoint_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under their checkpoint names (views; fused matrices split)."""
    return {
        name: param[start : start + rows] for name, (param, start, rows) in _targets(model).items()
    }


def _read(f: Any, name: str, slicer: Slicer | None) -> torch.Tensor:
    """A checkpoint tensor, or only this rank's slice of it (zero-padded to its rows)."""
    if slicer is None:
        return f.get_tensor(name)
    part = f.get_slice(name)
    cut = slicer(name, len(part.get_shape()))
    if cut is None:
        return f.get_tensor(name)
    tensor = part[cut.start : cut.stop] if cut.dim == 0 else part[:, cut.start : cut.stop]
    missing = cut.rows - (cut.stop - cut.start)
    if missing:
        tensor = torch.cat([tensor, tensor.new_zeros(missing, *tensor.shape[1:])])
    return tensor


def load_weights(model: CausalLM, model_dir: str | Path, slicer: Slicer | None = None) -> None:
    """Copy every weight of the checkpoint in ``model_dir`` into ``model`` (converting dtypes);
    with ``slicer`` (tensor parallelism) only this rank's slices are read. Raises ``ValueError``
    naming a missing, unexpected or misshapen weight."""
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise ImportError(
            "loading safetensors weights needs the 'safetensors' package: pip install safetensors"
        ) from exc
    targets = _targets(model)
    device = model.lm_head_weight.device
    read_device = str(device) if device.type == "cuda" else "cpu"
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device=read_device) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                target = targets.get(name)
                if target is None:
                    if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                        continue
                    raise ValueError(
                        f"model: unexpected weight {name!r} in {path.name} for "
                        f"{model.config.architecture}"
                    )
                param, start, rows = target
                tensor = _read(f, name, slicer)
                expected = (rows, *param.shape[1:])
                if tuple(tensor.shape) != expected:
                    raise ValueError(
                        f"model: weight {name!r} in {path.name} has shape {tuple(tensor.shape)}, "
                        f"expected {expected}"
                    )
                with torch.no_grad():
                    param[start : start + rows].copy_(tensor)
                loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(
            f"model: the checkpoint in {model_dir} lacks weight(s) {', '.join(missing[:5])}{more}"
        )


def init_random_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights (normal, std 0.02; norms 1, Gemma's 0 as they scale by 1 + w; biases 0)
    for benchmarks without a checkpoint."""
    generator = torch.Generator(device=model.lm_head_weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(0.0 if model.config.is_gemma else 1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
