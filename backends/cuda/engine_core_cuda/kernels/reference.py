"""Pure-torch references of the Triton kernels: simple, slow, and the ground truth in tests.

They take the same arguments as the kernels. :func:`paged_attention_reference` loops over the
sequences on the host (it reads the lengths back), so it is not capturable in a CUDA graph.
"""

from __future__ import annotations

import torch

from engine_core_cuda.kernels.attention_masks import (
    check_attention_options,
    first_visible,
    first_visible_int,
)

__all__ = [
    "add_rms_norm_reference",
    "gelu_tanh_and_mul_reference",
    "gemma_add_rms_norm_reference",
    "gemma_rms_norm_reference",
    "paged_attention_reference",
    "rms_norm_reference",
    "rotary_embedding_reference",
    "silu_and_mul_reference",
    "write_kv_reference",
]


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as :func:`engine_core_cuda.kernels.kv_write.write_kv`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep].to(key_cache.dtype)
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep].to(value_cache.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    out: torch.Tensor | None = None,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`engine_core_cuda.kernels.paged_attention.paged_attention`,
    computed in float32 one sequence at a time (reading only the blocks from the one holding
    the first key its queries see)."""
    num_heads = q.shape[1]
    _, block_size, num_kv_heads, head_size = key_cache.shape
    group = num_heads // num_kv_heads
    check_attention_options(num_heads, window, chunk, softcap, sinks)
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for seq, (row, seq_len) in enumerate(zip(seq_rows.tolist(), seq_lens.tolist(), strict=True)):
        q_start, q_end = starts[seq], starts[seq + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        first_block = first_visible_int(seq_len - q_len, window, chunk) // block_size
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[row, first_block:num_blocks].long()
        first_key = first_block * block_size
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_size)[: seq_len - first_key].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_size)[: seq_len - first_key].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        queries = q[q_start:q_end].float()
        scores = torch.einsum("qhd,khd->hqk", queries, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_positions = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_positions = torch.arange(first_key, seq_len, device=q.device)
        visible = (k_positions[None, :] <= q_positions[:, None]) & (
            k_positions[None, :] >= first_visible(q_positions, window, chunk)[:, None]
        )
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # one more logit per head in the denominator, attending to nothing
            sink = sinks.float()[:, None, None].expand(num_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as :func:`engine_core_cuda.kernels.rms_norm.rms_norm` (HF Llama's
    ``LlamaRMSNorm``)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def gemma_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as :func:`engine_core_cuda.kernels.rms_norm.gemma_rms_norm` (HF Gemma's
    ``GemmaRMSNorm``)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(torch.float32))).to(x.dtype)


def gemma_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Same contract as :func:`engine_core_cuda.kernels.rms_norm.gemma_add_rms_norm`."""
    residual.copy_(x + residual)
    return gemma_rms_norm_reference(residual, weight, eps)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Same contract as :func:`engine_core_cuda.kernels.rms_norm.add_rms_norm`."""
    residual.copy_(x + residual)
    return rms_norm_reference(residual, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding_reference(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Same contract as :func:`engine_core_cuda.kernels.rotary.rotary_embedding` (HF's
    ``apply_rotary_pos_emb``)."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    q.copy_(q * c + _rotate_half(q) * s)
    k.copy_(k * c + _rotate_half(k) * s)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`engine_core_cuda.kernels.activation.silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`engine_core_cuda.kernels.activation.gelu_tanh_and_mul` (HF's
    ``gelu_pytorch_tanh``)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up
