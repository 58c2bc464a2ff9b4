"""FP8 (e4m3) weights: quantisation, the FP8 linear layer's product, and the model-wide passes
that give a model FP8 storage (:mod:`engine_core_cuda._quant_config` says when).

Weights are held as ``float8_e4m3fn`` with one float32 scale per output channel (row): ``w ≈ q *
scale[:, None]``. Activations are quantised per token as they go (``x ≈ q_x * s_x[:, None]``).
On a GPU with FP8 tensor cores (compute capability 8.9 and up: Ada, Hopper, Blackwell) the
product is ``torch._scaled_mm`` with row-wise scales; elsewhere (older GPUs, the CPU tests) the
same quantised operands are dequantised and multiplied in the activations' dtype, so the CPU
computes what the GPU computes up to the accumulation order.

:func:`prepare_fp8_storage` gives a model FP8 storage before it is loaded: the loader then
copies an FP8 checkpoint's weights and scales as they are, or quantises each tensor of a
16/32-bit checkpoint per row as it reads it (``EngineConfig.quantization="fp8"``: rows are
independent, so the fused matrices' shards quantise one by one and no 16-bit copy of the model
is ever held).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from engine_core_cuda._layers import Linear
    from engine_core_cuda._moe import Experts

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "device_has_fp8",
    "dequantize_blocks",
    "fp8_linear",
    "prepare_fp8_storage",
    "quantize_rows",
    "randomize_fp8",
    "resolve_kv_cache_dtype",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_has_fp8(device: torch.device) -> bool:
    """Whether ``device`` multiplies FP8 natively (CUDA compute capability >= 8.9)."""
    return device.type == "cuda" and _capability(device.index or 0) >= (8, 9)


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype for ``EngineConfig.kv_cache_dtype``: ``"auto"`` is the model's
    ``dtype``; ``"fp8"``/``"fp8_e4m3"`` is e4m3, on GPUs with FP8 (compute capability >= 8.9)
    and on the CPU (the test path). Raises ``ValueError`` naming the field, the value and what
    the device supports otherwise (FP8 would be emulated slowly there)."""
    if name == "auto":
        return dtype
    if name not in ("fp8", "fp8_e4m3"):
        raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {name!r}")
    if device.type == "cuda" and not device_has_fp8(device):
        major, minor = _capability(device.index or 0)
        raise ValueError(
            f"kv_cache_dtype={name!r} needs a GPU with FP8 (compute capability 8.9 or later); "
            f"{device} ({torch.cuda.get_device_name(device)}) has {major}.{minor}: "
            "supported there: 'auto'"
        )
    return FP8_DTYPE


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``w ≈ q * scale[..., None]``: one float32 scale per row (the last
    dimension's amax maps to the FP8 maximum)."""
    amax = w.abs().amax(dim=-1).float().clamp(min=_MIN_SCALE)
    scale = amax / FP8_MAX
    q = (w.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Float32 ``q * scale`` where ``scale[i, j]`` covers rows ``i * block[0] …`` and columns
    ``j * block[1] …`` of ``q`` (the last blocks may be partial)."""
    rows, cols = q.shape
    full = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)
    return q.float() * full[:, :cols]


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T (+ b)`` for an FP8 weight ``[out, in]`` with per-row ``scale``; ``x`` is
    quantised per token."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x.is_cuda:  # one kernel instead of torch's six
        from engine_core_cuda.kernels.fp8_quant import quantize_per_token

        qx, sx = quantize_per_token(x2)
    else:
        qx, sx = quantize_rows(x2)
    out, k = weight.shape
    if (
        device_has_fp8(x.device)
        and x.dtype == torch.bfloat16
        and k % 16 == 0
        and out % 16 == 0
        and x2.shape[0] > 0
    ):
        y = torch._scaled_mm(
            qx, weight.t(), scale_a=sx[:, None], scale_b=scale[None, :].float(),
            out_dtype=x.dtype,
        )  # fmt: skip
    else:
        xd = (qx.float() * sx[:, None]).to(x.dtype)
        y = F.linear(xd, (weight.float() * scale.float()[:, None]).to(x.dtype))
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], out)


def _fp8_param(*shape: int, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=FP8_DTYPE, device=device), requires_grad=False)


def _scale_param(*shape: int, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.ones(*shape, dtype=torch.float32, device=device),
                        requires_grad=False)  # fmt: skip


def _linears(model: nn.Module, ignore: tuple[str, ...]) -> list[Linear]:
    """The model's quantisable linear layers (attention, MLPs, shared experts; never the LM
    head, the embeddings, the routers): those none of whose checkpoint shards is ignored."""
    from engine_core_cuda._layers import Linear
    from engine_core_cuda._quant_config import is_ignored

    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        parent = name.rpartition(".")[0]
        shards = [f"{parent}.{shard}_proj" for shard in module.shards]
        ignored = [is_ignored(s, ignore) for s in shards]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(
                f"model: the quantization_config ignores only some of {', '.join(shards)}, "
                "which the cuda backend computes in one matrix"
            )
        chosen.append(module)
    return chosen


def _experts(model: nn.Module, ignore: tuple[str, ...] = ()) -> list[Experts]:
    """The model's routed experts, less those the checkpoint leaves unquantised (every expert
    of the block ignored; some but not all is refused)."""
    from engine_core_cuda._moe import SparseMoeBlock
    from engine_core_cuda._quant_config import is_ignored

    chosen = []
    for name, block in model.named_modules():
        if not isinstance(block, SparseMoeBlock):
            continue
        parent = f"{name.rpartition('.')[0]}.{block.moe.prefix}.experts"
        names = [f"{parent}.{e}.{w}" for e in range(block.moe.num_experts)
                 for w in block.moe.weight_names]  # fmt: skip
        ignored = [is_ignored(n, ignore) for n in names]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(
                f"model: the quantization_config ignores only some of the experts of {parent}, "
                "which the cuda backend stacks in one FP8 tensor"
            )
        chosen.append(block.experts)
    return chosen


def prepare_fp8_storage(model: nn.Module, ignore: tuple[str, ...] = ()) -> None:
    """Give the quantisable layers FP8 weights and per-row scales (empty, for the loader to fill
    from an FP8 checkpoint)."""
    for module in _linears(model, ignore):
        rows, cols = module.weight.shape
        device = module.weight.device
        module.weight = _fp8_param(rows, cols, device=device)
        module.weight_scale = _scale_param(rows, device=device)
    for experts in _experts(model, ignore):
        device = experts.w13.device
        experts.w13 = _fp8_param(*experts.w13.shape, device=device)
        experts.w2 = _fp8_param(*experts.w2.shape, device=device)
        experts.w13_scale = _scale_param(*experts.w13.shape[:2], device=device)
        experts.w2_scale = _scale_param(*experts.w2.shape[:2], device=device)


def randomize_fp8(model: nn.Module, generator: torch.Generator, std: float = 0.02) -> None:
    """Random FP8 weights (normal with ``std``, quantised per row) for the model's FP8 layers
    (benchmarks without a checkpoint)."""
    pairs: list[tuple[nn.Module, str]] = [(m, "weight") for m in _fp8_linears(model)]
    pairs += [(e, name) for e in _experts(model) if e.w13_scale is not None
              for name in ("w13", "w2")]  # fmt: skip
    with torch.no_grad():
        for module, name in pairs:
            weight = getattr(module, name)
            w = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
            q, scale = quantize_rows(w.normal_(0.0, std, generator=generator))
            weight.copy_(q)
            getattr(module, f"{name}_scale").copy_(scale)


def _fp8_linears(model: nn.Module) -> list[Linear]:
    from engine_core_cuda._layers import Linear

    return [m for m in model.modules() if isinstance(m, Linear) and m.weight_scale is not None]
