"""Triton kernels of multi-LoRA: ``shrink`` (``y = x A^T``) and ``expand``
(``out += y B^T``) over the adapter segments of a batch.

A step's tokens come in runs ("segments") of one adapter each: segment ``s`` covers the tokens
``[seg_start[s], seg_start[s + 1])`` and uses the device slot ``seg_slot[s]`` (-1: the base model,
nothing is computed). The adapters' matrices are stacked by slot: ``a`` is
``[slots, ranks, in_features]``, ``b`` is ``[slots, out_features, rank]`` (the scaling folded in).
One program handles one segment (and one block of ranks or output columns), looping over the
segment's tokens in blocks of ``BLOCK_M``; a segment past the step's last one is empty, so a CUDA
graph captured for ``S`` segments replays any step of at most ``S`` with the segment tensors as
its inputs.

The intermediate ``y`` is float32; ``expand`` adds its product into ``out`` (a view: a column
slice of a fused projection's output) in ``out``'s dtype.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton reads the parameters of jit functions: they stay unannotated.)

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETED", "lora_expand", "lora_shrink"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether the kernels run in Triton's interpreter (fixed at import): it multiplies bfloat16
tiles wrongly, so they are widened to float32 there."""


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    seg_start_ptr,
    seg_slot_ptr,
    num_k,
    num_r,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_ym,
    stride_yr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    WIDEN: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_r = tl.program_id(1)
    slot = tl.load(seg_slot_ptr + seg)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    if slot >= 0:
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        r_mask = offs_r < num_r
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        for m0 in range(start, end, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_mask = offs_m < end
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, num_k, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < num_k
                x = tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
                a = tl.load(
                    a_base + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                    mask=k_mask[:, None] & r_mask[None, :],
                    other=0.0,
                )
                if WIDEN:
                    acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
                elif IEEE:
                    acc += tl.dot(x, a, input_precision="ieee")
                else:
                    acc += tl.dot(x, a)
            tl.store(
                y_ptr + offs_m[:, None] * stride_ym + offs_r[None, :] * stride_yr,
                acc,
                mask=m_mask[:, None] & r_mask[None, :],
            )


@triton.jit
def _expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    seg_start_ptr,
    seg_slot_ptr,
    start0,
    rows0,
    start1,
    rows1,
    start2,
    rows2,
    num_r,
    stride_ym,
    stride_yr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Program (segment, column block) of up to three shards: the blocks of shard 0, then
    shard 1's, then shard 2's; shard ``j`` reads ``y``'s columns ``[j * num_r, (j + 1) *
    num_r)`` and writes its rows of ``b`` into its columns of ``out``."""
    seg = tl.program_id(0)
    pid_n = tl.program_id(1)
    nb0 = tl.cdiv(rows0, BLOCK_N)
    nb01 = nb0 + tl.cdiv(rows1, BLOCK_N)
    in1 = pid_n >= nb0
    in2 = pid_n >= nb01
    local = pid_n - tl.where(in2, nb01, tl.where(in1, nb0, 0))
    start = tl.where(in2, start2, tl.where(in1, start1, start0))
    rows = tl.where(in2, rows2, tl.where(in1, rows1, rows0))
    shard = tl.where(in2, 2, tl.where(in1, 1, 0))
    slot = tl.load(seg_slot_ptr + seg)
    seg_begin = tl.load(seg_start_ptr + seg)
    seg_end = tl.load(seg_start_ptr + seg + 1)
    if slot >= 0:
        offs_n = local * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < rows
        cols = start + offs_n
        b_base = b_ptr + slot.to(tl.int64) * stride_bs
        y_base = y_ptr + shard * num_r * stride_yr
        for m0 in range(seg_begin, seg_end, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_mask = offs_m < seg_end
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, num_r, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_mask = offs_r < num_r
                y = tl.load(
                    y_base + offs_m[:, None] * stride_ym + offs_r[None, :] * stride_yr,
                    mask=m_mask[:, None] & r_mask[None, :],
                    other=0.0,
                )
                b = tl.load(
                    b_base + cols[None, :] * stride_bn + offs_r[:, None] * stride_br,
                    mask=r_mask[:, None] & n_mask[None, :],
                    other=0.0,
                ).to(tl.float32)
                acc += tl.dot(y, b, input_precision="ieee")
            out_ptrs = out_ptr + offs_m[:, None] * stride_om + cols[None, :] * stride_on
            mask = m_mask[:, None] & n_mask[None, :]
            out = tl.load(out_ptrs, mask=mask, other=0.0)
            tl.store(out_ptrs, (out.to(tl.float32) + acc).to(out.dtype), mask=mask)


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    y: torch.Tensor,
    seg_start: torch.Tensor,
    seg_slot: torch.Tensor,
    num_segments: int,
) -> None:
    """``y[t] = x[t] @ a[slot(t)]^T`` for the tokens of every segment with a slot (the rows of
    base-model segments are left as they are). ``x``: ``[tokens, in]``; ``a``:
    ``[slots, ranks, in]``; ``y``: ``[tokens, ranks]`` float32."""
    num_r = a.shape[1]
    block_r = max(16, min(64, triton.next_power_of_2(num_r)))
    grid = (num_segments, triton.cdiv(num_r, block_r))
    _shrink_kernel[grid](
        x, a, y, seg_start, seg_slot, x.shape[1], num_r,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        y.stride(0), y.stride(1),
        # Compiled: long K tiles (a decode segment has one token; fewer loop trips).
        BLOCK_M=16, BLOCK_R=block_r, BLOCK_K=64 if INTERPRETED else 256,
        IEEE=x.dtype == torch.float32,
        WIDEN=INTERPRETED and x.dtype != torch.float32,
    )  # fmt: skip


def lora_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    seg_start: torch.Tensor,
    seg_slot: torch.Tensor,
    num_segments: int,
    shards: list[tuple[int, int]] | None = None,
) -> None:
    """``out[t, shard j] += y[t, j * R:(j + 1) * R] @ b[slot(t), shard j]^T`` for the tokens
    of every segment with a slot, in one launch for every shard (at most three: a fused
    ``qkv``'s). ``y``: ``[tokens, shards * R]`` float32; ``b``: ``[slots, out, R]``; ``out``:
    ``[tokens, out]``, any strides; ``shards``: (first column, columns) of each (default: all
    of ``out``, one shard)."""
    num_r = b.shape[2]
    if shards is None:
        shards = [(0, b.shape[1])]
    if not 1 <= len(shards) <= 3:
        raise ValueError(f"lora_expand takes one to three shards, got {len(shards)}")
    padded = [*shards, *[(0, 0)] * (3 - len(shards))]
    block_n = 64
    block_r = max(16, min(64, triton.next_power_of_2(num_r)))
    blocks = sum(triton.cdiv(rows, block_n) for _, rows in shards)
    grid = (num_segments, blocks)
    (s0, r0), (s1, r1), (s2, r2) = padded
    _expand_kernel[grid](
        y, b, out, seg_start, seg_slot, s0, r0, s1, r1, s2, r2, num_r,
        y.stride(0), y.stride(1), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip
