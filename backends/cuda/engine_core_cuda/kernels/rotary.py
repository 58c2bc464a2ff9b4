"""Triton kernel: rotary position embedding ("rotate half" layout) of query and key heads, in
place, reading the cos/sin tables at each token's position."""

# mypy: disable-error-code="no-untyped-def"
# (Triton reads the parameters of jit functions: they stay unannotated.)

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETED", "rotary_embedding"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether the kernels of this module run in Triton's interpreter (fixed at import)."""


@triton.jit
def _rotate_heads(x_ptr, stride_head, num_heads, cos, sin,
                  HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):  # fmt: skip
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    first = x_ptr + heads * stride_head + cols
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], each product rounded as in HF.
    out1 = (x1 * cos).to(x1.dtype) + (-x2 * sin).to(x1.dtype)
    out2 = (x2 * cos).to(x1.dtype) + (x1 * sin).to(x1.dtype)
    tl.store(first, out1.to(x1.dtype), mask=mask)
    tl.store(first + HALF, out2.to(x1.dtype), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])  # a slice of the step's inputs
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_table,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)[None, :]
    # The tables hold [freqs, freqs]: the first half is enough.
    cos = tl.load(cos_ptr + position * stride_table + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(sin_ptr + position * stride_table + cols, mask=cols < HALF, other=0.0)
    _rotate_heads(q_ptr + token * stride_q_token, stride_q_head, num_q_heads, cos, sin,
                  HALF, Q_HEADS_PAD, HALF_PAD)  # fmt: skip
    _rotate_heads(k_ptr + token * stride_k_token, stride_k_head, num_k_heads, cos, sin,
                  HALF, K_HEADS_PAD, HALF_PAD)  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotate ``q`` (``[tokens, heads, head_size]``) and ``k`` (``[tokens, kv_heads,
    head_size]``) in place; ``cos``/``sin``: ``[max_positions, head_size]`` tables."""
    num_tokens, num_q_heads, head_size = q.shape
    num_k_heads = k.shape[1]
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1:
        raise ValueError("q, k and the tables must be contiguous in their last dimension")
    if num_tokens == 0:
        return
    half = head_size // 2
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        positions,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        num_q_heads,
        num_k_heads,
        HALF=half,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
        HALF_PAD=triton.next_power_of_2(half),
    )
