"""Faster torch versions of the KV write and the rotary embedding for the ``"torch"`` kernels
(the CPU default): the same results as :mod:`engine_core_cuda.kernels.reference` in fewer
operations per layer.

- :func:`write_kv_torch` copies with one ``index_copy_`` per cache when no slot is negative
  (checked on the host: the torch kernels synchronize anyway) instead of masking;
- :func:`rotary_embedding_torch` rotates the query and key heads together when the key heads
  follow the query heads in memory (the fused QKV projection), with the reference's products and
  roundings;
- :func:`rms_norm_torch` and :func:`add_rms_norm_torch` use torch's one-call ``rms_norm`` in
  float32 (the same operations as the reference, bit for bit) and add the residual in place, as
  :func:`add_gemma_rms_norm_torch` does for Gemma's norm.

On the CPU, float32 RMS norms (the residual add fused) and rotary embeddings go to the C
kernels of :mod:`engine_core_cuda.kernels.cpu_ops` where they take the input (one call in place
of several torch operations); the torch code here runs for the rest.
"""

from __future__ import annotations

import torch

from engine_core_cuda.kernels import cpu_ops
from engine_core_cuda.kernels.reference import (
    gemma_rms_norm_reference,
    rms_norm_reference,
    rotary_embedding_reference,
    write_kv_reference,
)

__all__ = [
    "add_gemma_rms_norm_torch",
    "add_rms_norm_torch",
    "rms_norm_torch",
    "rotary_embedding_torch",
    "write_kv_torch",
]


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as :func:`engine_core_cuda.kernels.rms_norm.rms_norm`."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return rms_norm_reference(x, weight, eps)  # rounds to the model dtype before the weight
    if x.device.type == "cpu":
        out = cpu_ops.rms_norm(x, weight, eps)
        if out is not None:
            return out
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Same contract as :func:`engine_core_cuda.kernels.rms_norm.add_rms_norm`."""
    if x.device.type == "cpu" and x.dtype == residual.dtype == torch.float32:
        out = cpu_ops.rms_norm(x, weight, eps, residual=residual)
        if out is not None:
            return out
    residual.add_(x)
    return rms_norm_torch(residual, weight, eps)


def add_gemma_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Same contract as :func:`engine_core_cuda.kernels.rms_norm.gemma_add_rms_norm`."""
    residual.add_(x)
    return gemma_rms_norm_reference(residual, weight, eps)


def write_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Same contract as :func:`engine_core_cuda.kernels.kv_write.write_kv`."""
    if key_cache.dtype == torch.float8_e4m3fn:
        # Copied as bytes: indexed copies have no FP8 kernels on every device.
        key = (key.float() / k_scale).clamp(-448.0, 448.0).to(key_cache.dtype).view(torch.uint8)
        value = (value.float() / v_scale).clamp(-448.0, 448.0).to(key_cache.dtype)
        value = value.view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    if slot_mapping.numel() == 0 or int(slot_mapping.min()) < 0:
        write_kv_reference(key, value, key_cache, value_cache, slot_mapping)
        return
    slots = slot_mapping.long()
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value.to(value_cache.dtype))


def _heads_together(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``q`` and ``k`` as one ``[tokens, heads + kv_heads, head_size]`` view when ``k``'s heads
    follow ``q``'s in every token's row; else None."""
    num_tokens, num_heads, head_size = q.shape
    same_layout = (
        q.dtype == k.dtype
        and q.stride(1) == k.stride(1) == head_size
        and q.stride(2) == k.stride(2) == 1
        and q.stride(0) == k.stride(0)
        and k.shape[0] == num_tokens
        and k.data_ptr() == q.data_ptr() + num_heads * head_size * q.element_size()
    )
    if not same_layout:
        return None
    return q.as_strided(
        (num_tokens, num_heads + k.shape[1], head_size), (q.stride(0), head_size, 1)
    )


def rotary_embedding_torch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Same contract as :func:`engine_core_cuda.kernels.rotary.rotary_embedding`."""
    if q.device.type == "cpu" and cpu_ops.rotary(positions, q, k, cos, sin):
        return
    heads = _heads_together(q, k)
    if heads is None:
        rotary_embedding_reference(positions, q, k, cos, sin)
        return
    half = heads.shape[-1] // 2
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], as the reference rounds it.
    rotated = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    heads.copy_(heads * c + rotated * s)
