"""Triton kernels: the gated activations of a fused gate/up projection, SwiGLU's
``silu(gate) * up`` and GeGLU's ``gelu_tanh(gate) * up`` (Gemma)."""

# mypy: disable-error-code="no-untyped-def"
# (Triton reads the parameters of jit functions: they stay unannotated.)

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETED", "gelu_tanh_and_mul", "silu_and_mul"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether the kernels of this module run in Triton's interpreter (fixed at import)."""

_BLOCK = 1024


@triton.jit
def _gated_kernel(x_ptr, out_ptr, stride_x, stride_out, size, GELU_TANH: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU_TANH:
        # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh from one bounded exponential.
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = tl.exp(-2.0 * tl.abs(inner))
        tanh = (1.0 - t) / (1.0 + t)
        activated = 0.5 * g * (1.0 + tl.where(inner < 0, -tanh, tanh))
    else:
        activated = g / (1.0 + tl.exp(-g))  # silu
    activated = activated.to(gate.dtype)  # rounded like torch's
    tl.store(out_ptr + row * stride_out + cols, (activated * up).to(gate.dtype), mask=mask)


def _launch(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    rows, width = x.shape
    size = width // 2
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous in its last dimension")
    out = torch.empty((rows, size), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(size))
    _gated_kernel[(rows, triton.cdiv(size, block))](
        x, out, x.stride(0), out.stride(0), size, GELU_TANH=gelu_tanh, BLOCK=block
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :n]) * x[:, n:]`` for ``x`` of shape ``[rows, 2n]``."""
    return _launch(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(x[:, :n], approximate="tanh") * x[:, n:]`` for ``x`` of shape ``[rows, 2n]``."""
    return _launch(x, gelu_tanh=True)
