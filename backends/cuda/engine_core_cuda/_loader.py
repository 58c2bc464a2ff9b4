"""Filling a :class:`~engine_core_cuda._model.CausalLM` with weights: from the safetensors files
of an HF directory (one file, or shards listed by ``model.safetensors.index.json``), or random
ones for benchmarks.

A fused matrix is loaded shard by shard: the rows of shard ``s`` of ``...qkv_proj`` or
``...gate_up_proj`` come from the checkpoint's ``...{s}_proj``; a mixture-of-experts block's
stacked expert weights come from the checkpoint's per-expert matrices
(:meth:`~engine_core_cuda._moe.SparseMoeBlock.checkpoint_targets`), or from gpt-oss's stacked
tensors (:meth:`~engine_core_cuda._moe.SparseMoeBlock.stacked_loaders`), which an MXFP4
checkpoint stores as ``…_blocks`` and ``…_scales`` pairs, dequantised as they are read
(:func:`~engine_core_cuda._mxfp4.dequantize_mxfp4`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine_core_cuda._fp8 import FP8_DTYPE, dequantize_blocks, quantize_rows, randomize_fp8
from engine_core_cuda._layers import Attention, Linear
from engine_core_cuda._model import CausalLM
from engine_core_cuda._moe import SparseMoeBlock
from engine_core_cuda._mxfp4 import dequantize_mxfp4

if TYPE_CHECKING:
    from engine_core_cuda._quant_config import QuantConfig
    from engine_core_cuda._tp.shard import Slice

Slicer = Callable[[str, int], "Slice | None"]
"""Tensor parallelism: checkpoint tensor (name, ndim) -> the part this rank reads (None: all)."""

__all__ = [
    "checkpoint_files",
    "checkpoint_tensors",
    "init_random_weights",
    "load_weights",
    "stacked_checkpoint_tensors",
]

_INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_FP8_IGNORED_SUFFIXES = (".input_scale",)
_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".k_proj.output_scale", ".v_proj.output_scale")
"""FP8 checkpoints' static activation scales: activations are quantised per token instead."""


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


def _stacked_loaders(model: CausalLM) -> dict[str, Callable[[torch.Tensor], None]]:
    """gpt-oss's stacked expert tensors: checkpoint name -> the function that stores one."""
    loaders: dict[str, Callable[[torch.Tensor], None]] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, SparseMoeBlock):
            loaders.update(module.stacked_loaders(module_name))
    return loaders


def _targets(model: CausalLM) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Checkpoint tensor name -> (parameter, first row, number of rows); stacked experts
    (:func:`_stacked_loaders`) are left out."""
    targets: dict[str, tuple[torch.Tensor, int, int]] = {}
    stacked: set[int] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, SparseMoeBlock):
            targets.update(module.checkpoint_targets(module_name))
            if module.moe.stacked:
                stacked |= {id(p) for p in module.experts.parameters()}
        elif isinstance(module, Linear):
            parent = module_name.rpartition(".")[0]
            for shard, (start, rows) in module.shards.items():
                targets[f"{parent}.{shard}_proj.weight"] = (module.weight, start, rows)
                if module.weight_scale is not None:
                    scale = module.weight_scale
                    targets[f"{parent}.{shard}_proj.weight_scale"] = (scale, start, rows)
                if module.bias is not None:
                    targets[f"{parent}.{shard}_proj.bias"] = (module.bias, start, rows)
    # Targets may be views into a parameter (a stacked expert's rows): it is covered too.
    fused = {id(t[0] if t[0]._base is None else t[0]._base) for t in targets.values()} | stacked
    for name, param in model.named_parameters():
        if id(param) not in fused:
            targets[name] = (param, 0, param.shape[0])
    return targets


def checkpoint_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under their checkpoint names (views; fused matrices split). gpt-oss's
    stacked experts are not among them: the checkpoint's layout is a rearrangement of ``w13``,
    not a view."""
    return {
        name: param[start : start + rows] for name, (param, start, rows) in _targets(model).items()
    }


def stacked_checkpoint_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """gpt-oss's stacked experts of an unsharded model in its dtype (not FP8) under their
    checkpoint names, in the checkpoint's layout (copies): with :func:`checkpoint_tensors`, a
    checkpoint of the model."""
    tensors: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, SparseMoeBlock):
            tensors.update(module.stacked_checkpoint(module_name))
    return tensors


def _read(f: Any, name: str, slicer: Slicer | None) -> torch.Tensor:
    """A checkpoint tensor, or only this rank's slice of it (zero-padded to its rows)."""
    if slicer is None:
        return f.get_tensor(name)
    part = f.get_slice(name)
    shape = part.get_shape()
    cut = slicer(name, len(shape))
    if cut is None or math.prod(shape) == 1:  # a per-tensor scale belongs to every slice
        return f.get_tensor(name)
    tensor = part[cut.start : cut.stop] if cut.dim == 0 else part[:, cut.start : cut.stop]
    missing = cut.rows - (cut.stop - cut.start)
    if missing:
        tensor = torch.cat([tensor, tensor.new_zeros(missing, *tensor.shape[1:])])
    return tensor


def _set_kv_scale(model: CausalLM, name: str, tensor: torch.Tensor) -> None:
    """An FP8 KV cache's per-tensor scale of one layer (``…self_attn.k_scale``, ``v_scale``, or
    compressed-tensors' ``…self_attn.k_proj.output_scale``)."""
    path, _, leaf = name.rpartition(".")
    if leaf == "output_scale":
        path, _, proj = path.rpartition(".")
        leaf = f"{proj[0]}_scale"
    attention = model.get_submodule(path)
    if not isinstance(attention, Attention) or tensor.numel() != 1:
        raise ValueError(
            f"model: unexpected KV-cache scale {name!r} of shape {tuple(tensor.shape)}"
        )
    k, v = attention.kv_scales
    value = float(tensor.float().reshape(()))
    attention.kv_scales = (value, v) if leaf == "k_scale" else (k, value)


def _scale_rows(tensor: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A checkpoint's weight scale as one value per row: a per-tensor scale repeated, a
    per-channel one (``[rows]`` or ``[rows, 1]``) flattened."""
    if tensor.numel() == 1:
        return tensor.reshape(1).float().expand(rows)
    if tensor.numel() == rows:
        return tensor.reshape(rows).float()
    raise ValueError(
        f"model: weight scale {name!r} has shape {tuple(tensor.shape)}: neither per tensor nor "
        f"per channel ({rows} rows)"
    )


def load_weights(
    model: CausalLM,
    model_dir: str | Path,
    slicer: Slicer | None = None,
    quant: QuantConfig | None = None,
) -> None:
    """Copy every weight of the checkpoint in ``model_dir`` into ``model`` (converting dtypes);
    with ``slicer`` (tensor parallelism) only this rank's slices are read. An FP8 checkpoint
    (``quant.source == "checkpoint"``; the model has FP8 storage,
    :func:`~engine_core_cuda._fp8.prepare_fp8_storage`) keeps its FP8 weights, its scales
    become per-row scales, block-wise ones are dequantised and requantised per row; static
    activation scales are not used (activations are quantised per token). Raises
    ``ValueError`` naming a missing, unexpected or misshapen weight."""
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise ImportError(
            "loading safetensors weights needs the 'safetensors' package: pip install safetensors"
        ) from exc
    targets = _targets(model)
    stacked = _stacked_loaders(model)
    mxfp4: dict[str, dict[str, torch.Tensor]] = {}
    """MXFP4 experts: each tensor's blocks and scales, until both are read."""
    device = model.lm_head_weight.device
    read_device = str(device) if device.type == "cuda" else "cpu"
    tied = model.config.tie_word_embeddings
    fp8 = quant is not None and quant.source == "checkpoint"
    blocks: dict[str, dict[str, torch.Tensor]] = {}
    """Block-wise FP8: each weight's FP8 matrix and block scales, until both are read."""
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device=read_device) as f:
            for checkpoint_name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = checkpoint_name
                if fp8 and name.endswith(".weight_scale_inv"):  # DeepSeek's name
                    name = name.removesuffix("_inv")
                if fp8 and name.endswith(_FP8_IGNORED_SUFFIXES):
                    continue
                if name.endswith(_KV_SCALE_SUFFIXES):
                    _set_kv_scale(model, name, f.get_tensor(checkpoint_name))
                    continue
                if stacked:
                    base, _, part = name.rpartition("_")
                    if base in stacked and part in ("blocks", "scales"):
                        pair = mxfp4.setdefault(base, {})
                        pair[part] = f.get_tensor(checkpoint_name)
                        if len(pair) == 2:
                            dtype = model.lm_head_weight.dtype
                            # [experts, out, in] dequantised (expert by expert, to bound the
                            # temporaries): the stacked tensor's transpose
                            codes, exponents = pair["blocks"], pair["scales"]
                            tensor = torch.cat([
                                dequantize_mxfp4(codes[e : e + 1], exponents[e : e + 1], dtype)
                                for e in range(codes.shape[0])
                            ])  # fmt: skip
                            stacked[base](tensor.transpose(1, 2))
                            loaded.add(base)
                            del mxfp4[base]
                        continue
                    if name in stacked:
                        stacked[name](f.get_tensor(checkpoint_name))
                        loaded.add(name)
                        continue
                target = targets.get(name)
                if fp8 and quant is not None and quant.strategy == "block" and target is not None:
                    base, _, kind = name.rpartition(".")
                    if kind == "weight_scale" or (
                        kind == "weight" and f"{base}.weight_scale" in targets
                    ):
                        blocks.setdefault(base, {})[kind] = _read(f, checkpoint_name, slicer)
                        continue
                if target is None:
                    if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                        continue
                    raise ValueError(
                        f"model: unexpected weight {name!r} in {path.name} for "
                        f"{model.config.architecture}"
                    )
                param, start, rows = target
                tensor = _read(f, checkpoint_name, slicer)
                if fp8 and name.endswith(".weight_scale"):
                    tensor = _scale_rows(tensor, rows, checkpoint_name)
                expected = (rows, *param.shape[1:])
                if tuple(tensor.shape) != expected:
                    raise ValueError(
                        f"model: weight {name!r} in {path.name} has shape {tuple(tensor.shape)}, "
                        f"expected {expected}"
                    )
                if param.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
                    # EngineConfig.quantization="fp8": quantised per row as it is read.
                    tensor, scale = quantize_rows(tensor)
                    scale_name = f"{name.removesuffix('.weight')}.weight_scale"
                    scale_param, scale_start, _ = targets[scale_name]
                    with torch.no_grad():
                        scale_param[scale_start : scale_start + rows].copy_(scale)
                    loaded.add(scale_name)
                with torch.no_grad():
                    param[start : start + rows].copy_(tensor)
                loaded.add(name)
    if blocks:
        assert quant is not None and quant.block is not None
        loaded |= _load_blocks(targets, blocks, quant.block)
    if mxfp4:
        raise ValueError(
            "model: the checkpoint has MXFP4 "
            + ", ".join(f"{base}_{next(iter(p))}" for base, p in mxfp4.items())
            + " without its other half (_blocks and _scales)"
        )
    missing = sorted((set(targets) | set(stacked)) - loaded)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(
            f"model: the checkpoint in {model_dir} lacks weight(s) {', '.join(missing[:5])}{more}"
        )


def _load_blocks(
    targets: dict[str, tuple[torch.Tensor, int, int]],
    blocks: dict[str, dict[str, torch.Tensor]],
    block: tuple[int, int],
) -> set[str]:
    """Block-wise FP8 weights dequantised and requantised with one scale per row."""
    loaded: set[str] = set()
    for base, parts in blocks.items():
        if set(parts) != {"weight", "weight_scale"}:
            raise ValueError(f"model: the checkpoint has {base}'s {', '.join(parts)} alone")
        q, scale = quantize_rows(dequantize_blocks(parts["weight"], parts["weight_scale"], block))
        for kind, tensor in (("weight", q), ("weight_scale", scale)):
            param, start, rows = targets[f"{base}.{kind}"]
            if tensor.shape[0] != rows:
                raise ValueError(
                    f"model: weight {base}.{kind} has {tensor.shape[0]} rows, expected {rows}"
                )
            with torch.no_grad():
                param[start : start + rows].copy_(tensor)
            loaded.add(f"{base}.{kind}")
    return loaded


def init_random_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights (normal, std 0.02; norms 1, Gemma's 0 as they scale by 1 + w; biases 0)
    for benchmarks without a checkpoint."""
    generator = torch.Generator(device=model.lm_head_weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dtype == FP8_DTYPE or name.endswith("_scale"):
                continue  # FP8 layers: below
            if name.endswith("norm.weight"):
                param.fill_(0.0 if model.config.is_gemma else 1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
    randomize_fp8(model, generator)
