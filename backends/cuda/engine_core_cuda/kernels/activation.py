"""Triton kernel: the SwiGLU activation ``silu(gate) * up`` of a fused gate/up projection."""

# mypy: disable-error-code="no-untyped-def"
# (Triton reads the parameters of jit functions: they stay unannotated.)

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETED", "silu_and_mul"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether the kernels of this module run in Triton's interpreter (fixed at import)."""

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # silu, rounded like torch's
    tl.store(out_ptr + row * stride_out + cols, (activated * up).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :n]) * x[:, n:]`` for ``x`` of shape ``[rows, 2n]``."""
    rows, width = x.shape
    size = width // 2
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous in its last dimension")
    out = torch.empty((rows, size), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(size))
    _silu_and_mul_kernel[(rows, triton.cdiv(size, block))](
        x, out, x.stride(0), out.stride(0), size, BLOCK=block
    )
    return out
