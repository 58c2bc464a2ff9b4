"""Paged attention in batched torch operations: the ``"torch"`` kernels' attention (the CPU
default).

Unlike :func:`engine_core_cuda.kernels.reference.paged_attention_reference`, which loops over
every sequence, the decode rows of a step (one query each) are computed together: their keys are
gathered from the cache padded to the longest sequence and attended to in one
``scaled_dot_product_attention`` (grouped query heads share their KV head without a copy).
Sequences with several queries (prefill chunks) run together too, padded to the longest, unless
padding would more than double the work (then one at a time). It reads the lengths back to the
host, so it is not capturable in a CUDA graph.

In a window (or chunked) layer each sequence's keys are gathered from the block holding the first
key its queries see, and only from its own blocks: the gather never reads a block-table entry
behind the window (a null id there is fine) nor past the sequence's last block. A full layer's
table holds real blocks only: its gather is a slice of the rows' first columns, as long as the
longest sequence, whose keys past a shorter sequence's end are masked (they hold finite KV of
other requests). Soft-capped scores and sinks have no ``scaled_dot_product_attention``: those
layers compute the softmax explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine_core_cuda.kernels.attention_masks import check_attention_options, first_visible
from engine_core_cuda.kernels.cpu_attention import decode_attention_native

__all__ = ["paged_attention_torch"]


@dataclass(frozen=True, slots=True)
class _Layer:
    """The layer's attention options (see :func:`paged_attention_torch`)."""

    scale: float
    window: int | None
    chunk: int | None
    softcap: float | None
    sinks: torch.Tensor | None


def _gather(
    block_table: torch.Tensor,
    rows: torch.Tensor,
    lengths: list[int],
    q_lens: list[int],
    block_size: int,
    layer: _Layer,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(blocks [S, n], first_key [S] or None for 0)``: a window (chunk) layer's sequences'
    blocks from the one holding the first key their queries see, padded with that block
    (masked out) to the longest, the indices computed on the host where the lengths are; a full
    layer's first ``n`` columns of each row."""
    if layer.window is None and layer.chunk is None:
        return block_table[rows.long(), : -(-max(lengths) // block_size)].long(), None
    device = block_table.device
    ends = -(-np.asarray(lengths, dtype=np.int64) // block_size)
    first_query = np.asarray(lengths, dtype=np.int64) - np.asarray(q_lens, dtype=np.int64)
    first = np.zeros_like(first_query)
    if layer.window is not None:
        first = np.maximum(first, first_query - layer.window + 1)
    if layer.chunk is not None:
        first = np.maximum(first, first_query // layer.chunk * layer.chunk)
    first //= block_size
    index = first[:, None] + np.arange(int((ends - first).max()))
    index = np.where(index < ends[:, None], index, first[:, None])
    blocks = block_table[rows.long()[:, None], torch.from_numpy(index).to(device)].long()
    return blocks, torch.from_numpy(first * block_size).to(device)


def _blocks_of(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The cache blocks ``blocks`` (``[S, n]``) of each sequence, one after the other: float32
    ``[S, n * block_size, kv_heads, head_size]``. ``index_select`` copies whole blocks (rows of
    the cache), several times faster on the CPU than advanced indexing's element-wise gather."""
    num_seqs, num_blocks = blocks.shape
    rows = cache.index_select(0, blocks.reshape(-1))
    rows = rows.view(num_seqs, num_blocks * cache.shape[1], *cache.shape[2:])
    return rows if rows.dtype == torch.float32 else rows.float()


def _softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, layer: _Layer
) -> torch.Tensor:
    """Attention with the scores written out (soft-capping, sinks): ``q`` ``[S, Q, heads, D]``,
    ``k``/``v`` ``[S, L, kv_heads, D]``, ``visible`` ``[S, Q, L]``; returns ``[S, Q, heads,
    D]``."""
    num_seqs, num_queries, num_heads, head_size = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    grouped = q.view(num_seqs, num_queries, num_kv_heads, group, head_size)
    scores = torch.einsum("sqhgd,slhd->shgql", grouped, k) * layer.scale
    if layer.softcap is not None:
        scores = layer.softcap * torch.tanh(scores / layer.softcap)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    if layer.sinks is not None:
        sink = layer.sinks.float().view(1, num_kv_heads, group, 1, 1)
        sink = sink.expand(num_seqs, num_kv_heads, group, num_queries, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("shgql,slhd->sqhgd", probs, v)
    return out.reshape(num_seqs, num_queries, num_heads, head_size)


def _attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    first_key: torch.Tensor | None,
    seq_lens: torch.Tensor,
    layer: _Layer,
) -> torch.Tensor:
    """``q``: ``[S, Q, heads, head_size]``, the last ``Q`` positions of ``S`` sequences of
    ``seq_lens`` tokens whose keys from ``first_key`` (None: 0) on are in the cache blocks
    ``blocks`` (``[S, blocks]``). Returns float32 ``[S, Q, heads, head_size]``."""
    num_queries = q.shape[1]
    k = _blocks_of(key_cache, blocks)  # [S, L, kv_heads, D]
    v = _blocks_of(value_cache, blocks)
    # Query i of a sequence of n tokens sits at position n - Q + i and sees keys up to that.
    key_pos = torch.arange(k.shape[1], device=q.device)[None, :]  # [1 or S, L]
    if first_key is not None:
        key_pos = key_pos + first_key[:, None]
    query_pos = (seq_lens[:, None] - num_queries) + torch.arange(num_queries, device=q.device)
    visible = key_pos[:, None, :] <= query_pos[:, :, None]  # [S, Q, L]
    if layer.window is not None or layer.chunk is not None:
        start = first_visible(query_pos, layer.window, layer.chunk)
        visible &= key_pos[:, None, :] >= start[:, :, None]
    if layer.softcap is not None or layer.sinks is not None:
        return _softmax_attention(q.float(), k, v, visible, layer)
    # Query head h reads KV head h // group (enable_gqa), as the kernel's grouping does.
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=visible[:, None],
        scale=layer.scale,
        enable_gqa=True,
    )  # [S, heads, Q, D]
    return out.transpose(1, 2)


def _attend_chunks(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    chunks: list[int],
    starts: list[int],
    q_lens: list[int],
    lengths: list[int],
    layer: _Layer,
) -> None:
    """Attention of the sequences ``chunks`` (several queries each), padded to the longest."""
    longest = max(q_lens[i] for i in chunks)
    index = torch.tensor(chunks, device=q.device)
    # Each sequence's queries, right-aligned: padding rows come first and are dropped after.
    token_index = torch.tensor(
        [max(starts[i], starts[i + 1] - longest + j) for i in chunks for j in range(longest)],
        device=q.device,
    )
    queries = q[token_index].view(len(chunks), longest, *q.shape[1:])
    blocks, first_key = _gather(block_table, seq_rows[index], [lengths[i] for i in chunks],
                                [q_lens[i] for i in chunks], key_cache.shape[1], layer)  # fmt: skip
    result = _attend(queries, key_cache, value_cache, blocks, first_key, seq_lens[index].long(),
                     layer)  # fmt: skip
    for k, i in enumerate(chunks):
        n = q_lens[i]
        out[starts[i] : starts[i + 1]] = result[k, longest - n :].to(out.dtype)


def paged_attention_torch(
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
    native: bool = True,
    **_: Any,
) -> torch.Tensor:
    """Same contract as :func:`engine_core_cuda.kernels.paged_attention.paged_attention` (the
    tile shape and split-KV arguments mean nothing here), computed in float32. On the CPU the
    decode rows of a full-attention float32 layer read K/V in place through the native kernel
    (:mod:`engine_core_cuda.kernels.cpu_attention`) where it is available and ``native``."""
    check_attention_options(q.shape[1], window, chunk, softcap, sinks)
    layer = _Layer(scale, window, chunk, softcap, sinks)
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(num_seqs)]
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    if decodes:
        all_decode = len(decodes) == num_seqs
        index = None if all_decode else torch.tensor(decodes, device=q.device)
        rows = seq_rows if index is None else seq_rows[index]
        lens = seq_lens if index is None else seq_lens[index]
        tokens = (query_start_loc[:-1] if index is None else query_start_loc[index]).long()
        in_place = (
            native
            and q.device.type == "cpu"
            and window is None
            and chunk is None
            and softcap is None
            and sinks is None
            and decode_attention_native(
                q, key_cache, value_cache, block_table, rows, lens, tokens, out, scale
            )  # fmt: skip
        )
        if not in_place:
            blocks, first_key = _gather(block_table, rows, [lengths[i] for i in decodes],
                                        [1] * len(decodes), block_size, layer)  # fmt: skip
            if index is None and q.shape[0] == num_seqs:  # decode only: token i is sequence i
                result = _attend(q[:, None], key_cache, value_cache, blocks, first_key,
                                 lens.long(), layer)  # fmt: skip
                out.copy_(result[:, 0])
            else:
                result = _attend(q[tokens][:, None], key_cache, value_cache, blocks, first_key,
                                 lens.long(), layer)  # fmt: skip
                out[tokens] = result[:, 0].to(out.dtype)
    chunks = [i for i, n in enumerate(q_lens) if n > 1]
    if chunks:
        longest = max(q_lens[i] for i in chunks)
        padded = len(chunks) * longest <= 2 * sum(q_lens[i] for i in chunks)
        # Chunks of similar lengths run together (padded to the longest), others one by one.
        for group in [chunks] if padded else [[i] for i in chunks]:
            _attend_chunks(q, key_cache, value_cache, block_table, seq_rows, seq_lens, out,
                           group, starts, q_lens, lengths, layer)  # fmt: skip
    return out
