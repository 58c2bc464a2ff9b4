"""Triton kernel: write the keys and values of a step's tokens into their KV-cache slots."""

# mypy: disable-error-code="no-untyped-def"
# (Triton reads the parameters of jit functions: they stay unannotated.)

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETED", "write_kv"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether the kernels of this module run in Triton's interpreter (fixed at import)."""

_MAX_TILE_ELEMENTS = 4096


# The token count changes every step and the slots are a slice of the step's packed inputs:
# neither is specialized on, so one variant serves every batch.
@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_key_token,
    stride_value_token,
    stride_cache_slot,
    inv_k_scale,
    inv_v_scale,
    ROW_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    FP8: tl.constexpr,
):
    # One program copies BLOCK_T tokens; a token's row (num_kv_heads * head_size elements) is
    # contiguous both in the projection output and in its cache slot.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    in_batch = offs_t < num_tokens
    slots = tl.load(slot_mapping_ptr + offs_t, mask=in_batch, other=-1).to(tl.int64)
    # A negative slot marks a padding token (CUDA-graph batches, profiling): nothing is written.
    mask = (in_batch & (slots >= 0))[:, None] & (offs_e < ROW_SIZE)[None, :]
    rows = offs_t.to(tl.int64)[:, None]
    cache_offsets = slots[:, None] * stride_cache_slot + offs_e[None, :]
    key = tl.load(key_ptr + rows * stride_key_token + offs_e[None, :], mask=mask)
    value = tl.load(value_ptr + rows * stride_value_token + offs_e[None, :], mask=mask)
    dtype = key_cache_ptr.dtype.element_ty
    if FP8:  # scaled per tensor, saturated to e4m3's range (e4m3fn has no infinities), rounded
        # to nearest even as torch rounds
        key = tl.clamp(key.to(tl.float32) * inv_k_scale, -448.0, 448.0)
        value = tl.clamp(value.to(tl.float32) * inv_v_scale, -448.0, 448.0)
        key = key.to(dtype, fp_downcast_rounding="rtne")
        value = value.to(dtype, fp_downcast_rounding="rtne")
    tl.store(key_cache_ptr + cache_offsets, key.to(dtype), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(dtype), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store ``key``/``value`` (``[num_tokens, num_kv_heads, head_size]``, each token's heads
    contiguous) at ``slot_mapping`` (``[num_tokens]``; slot ``block_id * block_size + offset``,
    negative: skip) of ``key_cache``/``value_cache`` (``[num_blocks, block_size, num_kv_heads,
    head_size]``, contiguous). An FP8 cache stores ``key / k_scale`` and ``value / v_scale``
    saturated to e4m3's range."""
    num_tokens, num_heads, head_size = key.shape
    row_size = num_heads * head_size
    for name, t in (("key", key), ("value", value)):
        if t.stride(2) != 1 or t.stride(1) != head_size:
            raise ValueError(f"{name} must have contiguous heads, got strides {t.stride()}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    if num_tokens == 0:
        return
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    if fp8 and INTERPRETED:
        # Triton's interpreter rounds conversions to FP8 wrongly near powers of two (1.99 -> 1):
        # interpreted, torch converts and the kernel copies bytes; compiled, the kernel converts.
        key = (key.float() / k_scale).clamp(-448.0, 448.0).to(key_cache.dtype).view(torch.uint8)
        value = (value.float() / v_scale).clamp(-448.0, 448.0).to(key_cache.dtype)
        value = value.view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        fp8 = False
    block_e = triton.next_power_of_2(row_size)
    block_t = max(1, _MAX_TILE_ELEMENTS // block_e)  # fixed per model: one compiled variant
    grid = (triton.cdiv(num_tokens, block_t),)
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        value.stride(0),
        row_size,
        1.0 / k_scale,
        1.0 / v_scale,
        ROW_SIZE=row_size,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        FP8=fp8,
    )
