"""Triton kernel: dynamic per-token FP8 quantisation of activations, in one pass (the torch
version takes half a dozen elementwise kernels, which at batch 1 cost more than the FP8 matrix
product saves).

Each program reads one row, finds its largest magnitude, and writes the row divided by
``amax / 448`` as ``float8_e4m3fn`` (rounded to nearest even) and that scale as float32:
``x ≈ q * scale[:, None]``, the contract of :func:`engine_core_cuda._fp8.quantize_rows`.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton reads the parameters of jit functions: they stay unannotated.)

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETED", "quantize_per_token"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 0), 1e-12)
    # IEEE divisions (Triton's "/" is approximate on GPUs), so the codes are torch's exactly.
    scale = tl.math.div_rn(amax, 448.0)
    q = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
    q = q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(q_ptr + row * stride_q + offs, q, mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [rows, cols] float8_e4m3fn, scale [rows] float32)`` of a 2-D ``x`` (contiguous
    rows)."""
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(cols)
        _quantize_kernel[(rows,)](x, q, scale, x.stride(0), q.stride(0), cols, BLOCK=block,
                                  num_warps=4 if block <= 4096 else 8)  # fmt: skip
    return q, scale
