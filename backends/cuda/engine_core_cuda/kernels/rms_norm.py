"""Triton kernel: RMSNorm of each row, optionally after adding the residual stream (one pass
instead of the six or seven elementwise kernels of the torch formulation). Llama's norm scales
the normalized row, rounded to the model dtype, by the weight; Gemma's scales it by
``1 + weight`` in float32 and rounds once."""

# mypy: disable-error-code="no-untyped-def"
# (Triton reads the parameters of jit functions: they stay unannotated.)

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETED", "add_rms_norm", "gemma_add_rms_norm", "gemma_rms_norm", "rms_norm"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether the kernels of this module run in Triton's interpreter (fixed at import)."""


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the model dtype (it is the residual stream), then normalized.
        x = x + tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        tl.store(residual_ptr + row * stride_residual + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / num_cols
    h = h * tl.rsqrt(variance + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if UNIT_OFFSET:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
        y = h * (1.0 + weight.to(tl.float32))
    else:
        y = weight * h.to(x.dtype)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float, unit_offset: bool = False) -> torch.Tensor:  # fmt: skip
    rows, cols = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rows must be contiguous")
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = triton.next_power_of_2(cols)
    _rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        UNIT_OFFSET=unit_offset,
        BLOCK=block,
        num_warps=min(16, max(4, block // 512)),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` per row of ``x`` (``[rows, cols]``), computed in float32 and
    rounded as HF Llama does."""
    return _launch(x, None, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` (in place), then :func:`rms_norm` of the new residual."""
    return _launch(x, residual, weight, eps)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(1 + weight) * (x / rms(x))`` per row, computed in float32 and rounded once (HF
    Gemma's ``GemmaRMSNorm``)."""
    return _launch(x, None, weight, eps, unit_offset=True)


def gemma_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` (in place), then :func:`gemma_rms_norm` of the new residual."""
    return _launch(x, residual, weight, eps, unit_offset=True)
