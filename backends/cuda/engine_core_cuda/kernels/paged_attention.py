"""Triton kernels: causal attention of a mixed batch over the paged KV cache.

A batch holds sequences laid end to end (``query_start_loc``); sequence ``s`` has
``seq_lens[s]`` tokens in the cache, of which its last ``q_len`` are this step's queries (a
prefill chunk, possibly after a prefix-cache hit, or a single decode token). Its keys live in the
blocks of row ``seq_rows[s]`` of ``block_table``.

One program handles one block of query tokens of one sequence and one KV head, with that head's
whole group of query heads (GQA) stacked into the rows of its tiles. Programs are numbered over
the batch without knowing the sequences' lengths on the host: program ``i`` finds its sequence
by binary search, which keeps the launch free of host synchronization (and capturable in a CUDA
graph). For short batches of long sequences the keys can be split into segments computed by
separate programs and merged by a second kernel (split-KV decoding).

Per layer, the attention may be narrowed and reshaped (see :func:`paged_attention`):

- a sliding window ``w``: query position ``p`` sees keys ``p - w + 1 .. p``;
- chunked local attention of ``chunk`` tokens: it sees keys from ``p // chunk * chunk`` on;
- logit soft-capping: scores become ``softcap * tanh(score / softcap)`` (Gemma 2);
- attention sinks: a learned logit per query head that joins the softmax's denominator and
  attends to nothing (gpt-oss).

A program only visits the tiles from the first key its first query sees: the blocks behind a
window (or before a chunk) are never read, neither their block-table entries nor their keys,
so the KV-cache manager may release them while the request runs.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton reads the parameters of jit functions: they stay unannotated.)

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine_core_cuda.kernels.attention_masks import check_attention_options

__all__ = ["INTERPRETED", "paged_attention"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether the kernels of this module run in Triton's interpreter (fixed at import)."""


@triton.jit
def _find_sequence(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence s owns query blocks starting at query_start_loc[s] // BLOCK_Q + s: increasing in s,
    # and each range is long enough for the sequence's tokens.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _first_visible(position, window, chunk):
    # The first key position a query at ``position`` sees (0 without a window or chunk).
    start = tl.where(window > 0, position - window + 1, 0)
    start = tl.maximum(start, 0)
    size = tl.maximum(chunk, 1)
    return tl.maximum(start, tl.where(chunk > 0, (position // size) * size, 0))


@triton.jit
def _tanh(x):
    # tanh from one exponential of a non-positive argument (no overflow).
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


# The sequence count changes every step and the per-sequence arrays are slices of the step's
# packed inputs (read one value at a time): neither is specialized on, so one variant per tile
# shape serves every batch. Nor are the window and chunk sizes (layers of different windows
# share a variant) or the sinks' address (a placeholder without sinks).
@triton.jit(
    do_not_specialize=["num_seqs", "window", "chunk"],
    do_not_specialize_on_alignment=[
        "seq_rows_ptr",
        "query_start_loc_ptr",
        "seq_lens_ptr",
        "sinks_ptr",
    ],
)
def _paged_attention_kernel(
    out_ptr,
    segm_out_ptr,
    segm_max_ptr,
    segm_sum_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    seq_rows_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    sinks_ptr,
    scale,
    softcap,
    window,
    chunk,
    num_seqs,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_row,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    LOCAL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_sequence(query_start_loc_ptr, q_block_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    table_row = block_table_ptr + tl.load(seq_rows_ptr + seq).to(tl.int64) * stride_table_row

    # Row m of the tile is query token m // GROUP of the block, query head m % GROUP of the group.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_index = q_block * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m // GROUP < BLOCK_Q) & (q_index < q_len)
    d_valid = offs_d < HEAD_SIZE
    q_token = (q_start + q_index).to(tl.int64)
    q = tl.load(
        q_ptr + q_token[:, None] * stride_q_token + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    q_position = context_len + q_index

    # Keys [kv_start, kv_end) seen by some query of the block (the first query sees the first
    # of them, the last query the last), split evenly into segments of whole tiles. A full
    # layer (not LOCAL) starts at key 0 and compiles without the window's arithmetic.
    kv_start = 0
    row_start = q_position
    if LOCAL:
        kv_start = _first_visible(context_len + q_block * BLOCK_Q, window, chunk)
        row_start = _first_visible(q_position, window, chunk)
    kv_end = context_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len)
    first_tile = kv_start // TILE_N
    num_tiles = tl.cdiv(kv_end, TILE_N) - first_tile
    tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
    tile_start = first_tile + segment * tiles_per_segment
    tile_end = tl.minimum(tile_start + tiles_per_segment, first_tile + num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        # The sink is a key of logit sink[head] and value 0, counted once (in segment 0).
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_i = tl.where(segment == 0, sink, m_i)
        l_i = tl.where(segment == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    for tile in range(tile_start, tile_end):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        n_valid = offs_n < kv_end
        if LOCAL:
            n_valid = n_valid & (offs_n >= kv_start)
        block_ids = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        slot_offsets = (
            block_ids * stride_cache_block
            + (offs_n % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        k = tl.load(
            key_cache_ptr + slot_offsets[None, :] + offs_d[:, None],
            mask=d_valid[:, None] & n_valid[None, :],
            other=0.0,
        ).to(q.dtype)  # an FP8 cache's keys widened (its scale is folded into ``scale``)
        if IEEE:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        visible = (offs_n[None, :] <= q_position[:, None]) & n_valid[None, :] & row_valid[:, None]
        if LOCAL:
            visible = visible & (offs_n[None, :] >= row_start[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet keeps m = -inf; subtract 0 instead to avoid inf - inf.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            value_cache_ptr + slot_offsets[:, None] + offs_d[None, :],
            mask=n_valid[:, None] & d_valid[None, :],
            other=0.0,
        ).to(q.dtype)
        if IEEE:  # noqa: SIM108
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr
            + q_token[:, None] * stride_out_token
            + head[:, None] * stride_out_head
            + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_valid[None, :],
        )
    else:
        stat = (q_token * NUM_HEADS + head) * NUM_SEGMENTS + segment
        tl.store(segm_max_ptr + stat, m_i, mask=row_valid)
        tl.store(segm_sum_ptr + stat, l_i, mask=row_valid)
        tl.store(
            segm_out_ptr + stat[:, None] * HEAD_PAD + offs_d[None, :],
            acc,
            mask=row_valid[:, None],
        )


@triton.jit
def _merge_segments_kernel(
    out_ptr,
    segm_out_ptr,
    segm_max_ptr,
    segm_sum_ptr,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_PAD)
    stat = (token * NUM_HEADS + head) * NUM_SEGMENTS + offs_s
    m = tl.load(segm_max_ptr + stat)
    total_max = tl.max(m, 0)  # finite: a query sees its own key in some segment
    weight = tl.where(m > float("-inf"), tl.exp(m - total_max), 0.0)
    denominator = tl.sum(tl.load(segm_sum_ptr + stat) * weight, 0)
    acc = tl.load(segm_out_ptr + stat[:, None] * HEAD_PAD + offs_d[None, :])
    out = tl.sum(acc * weight[:, None], 0) / denominator
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_SIZE,
    )


def _block_m(max_query_len: int, group: int) -> int:
    rows = max(16, triton.next_power_of_2(group))
    return rows if max_query_len == 1 else max(rows, 64)


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    max_query_len: int,
    num_segments: int = 1,
    out: torch.Tensor | None = None,
    tile_size: int = 32,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` (``[num_tokens, num_heads, head_size]``) over the cache.

    ``key_cache``/``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_size]``;
    ``block_table``: ``[rows, max_blocks]`` int32; ``seq_rows``: ``[num_seqs]`` int32, the
    table row of each sequence; ``query_start_loc``: ``[num_seqs + 1]`` int32 offsets of each
    sequence's queries in ``q``; ``seq_lens``: ``[num_seqs]`` int32 cached tokens of each sequence,
    this step's included. ``max_query_len`` (a host int, an upper bound) picks the tile shape;
    ``num_segments`` (a power of two) splits each sequence's keys across programs. Returns
    ``out`` (``[num_tokens, num_heads, head_size]``, allocated when not given).

    The layer's kind: ``window`` (a sliding window of that many keys, the query's own
    included), ``chunk`` (chunked local attention), ``softcap`` (scores soft-capped after
    ``scale``) and ``sinks`` (``[num_heads]`` float logits added to each head's softmax
    denominator); see :mod:`engine_core_cuda.kernels.attention_masks`. Block-table entries of
    blocks wholly before the first key a sequence's queries see are never read.
    """
    num_tokens, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two, got {num_segments}")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError("key_cache and value_cache must share a layout with contiguous heads")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dimension")
    check_attention_options(num_heads, window, chunk, softcap, sinks)
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = _block_m(max_query_len, group)
    block_q = block_m // group
    head_pad = max(16, triton.next_power_of_2(head_size))
    tile_n = max(16, triton.next_power_of_2(tile_size))
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    if num_segments > 1:
        stats = (num_tokens, num_heads, num_segments)
        segm_out = torch.empty((*stats, head_pad), dtype=torch.float32, device=q.device)
        segm_max = torch.empty(stats, dtype=torch.float32, device=q.device)
        segm_sum = torch.empty(stats, dtype=torch.float32, device=q.device)
    else:
        segm_out = segm_max = segm_sum = out  # unused
    _paged_attention_kernel[grid](
        out,
        segm_out,
        segm_max,
        segm_sum,
        q,
        key_cache,
        value_cache,
        block_table,
        seq_rows,
        query_start_loc,
        seq_lens,
        sinks if sinks is not None else seq_lens,  # unused without sinks
        scale,
        softcap or 0.0,
        window or 0,
        chunk or 0,
        num_seqs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        NUM_HEADS=num_heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        BLOCK_SIZE=block_size,
        NUM_SEGMENTS=num_segments,
        LOCAL=window is not None or chunk is not None,
        HAS_SINKS=sinks is not None,
        HAS_SOFTCAP=softcap is not None,
        IEEE=q.dtype == torch.float32,
    )
    if num_segments > 1:
        _merge_segments_kernel[(num_tokens, num_heads)](
            out,
            segm_out,
            segm_max,
            segm_sum,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            NUM_SEGMENTS=num_segments,
        )
    return out
