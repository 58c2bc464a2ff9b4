"""Paged attention in batched torch operations: the ``"torch"`` kernels' attention (the CPU
default).

Unlike :func:`engine_core_cuda.kernels.reference.paged_attention_reference`, which loops over
every sequence, the decode rows of a step (one query each) are computed together: their keys are
gathered from the cache padded to the longest sequence and attended to in one
``scaled_dot_product_attention`` (grouped query heads share their KV head without a copy).
Sequences with several queries (prefill chunks) run together too, padded to the longest, unless
padding would more than double the work (then one at a time). It reads the lengths back to the host, so it is not capturable in a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["paged_attention_torch"]


def _attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """``q``: ``[S, Q, heads, head_size]``, the last ``Q`` positions of ``S`` sequences of
    ``seq_lens`` tokens whose cache blocks are ``blocks`` (``[S, blocks]``). Returns float32
    ``[S, Q, heads, head_size]``."""
    num_queries = q.shape[1]
    k = key_cache[blocks].flatten(1, 2)[:, :max_len].float()  # [S, L, kv_heads, D]
    v = value_cache[blocks].flatten(1, 2)[:, :max_len].float()
    # Query i of a sequence of n tokens sits at position n - Q + i and sees keys 0..that.
    key_pos = torch.arange(max_len, device=q.device)
    query_pos = (seq_lens[:, None] - num_queries) + torch.arange(num_queries, device=q.device)
    visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [S, Q, L]
    # Query head h reads KV head h // group (enable_gqa), as the kernel's grouping does.
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=visible[:, None],
        scale=scale,
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
    scale: float,
) -> None:
    """Attention of the sequences ``chunks`` (several queries each), padded to the longest."""
    longest = max(q_lens[i] for i in chunks)
    max_len = max(lengths[i] for i in chunks)
    index = torch.tensor(chunks, device=q.device)
    # Each sequence's queries, right-aligned: padding rows come first and are dropped after.
    token_index = torch.tensor(
        [max(starts[i], starts[i + 1] - longest + j) for i in chunks for j in range(longest)],
        device=q.device,
    )
    queries = q[token_index].view(len(chunks), longest, *q.shape[1:])
    blocks = block_table[seq_rows[index].long(), : -(-max_len // key_cache.shape[1])].long()
    result = _attend(queries, key_cache, value_cache, blocks, seq_lens[index].long(), max_len,
                     scale)  # fmt: skip
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
    **_: Any,
) -> torch.Tensor:
    """Same contract as :func:`engine_core_cuda.kernels.paged_attention.paged_attention` (the
    tile shape and split-KV arguments mean nothing here), computed in float32."""
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
        max_len = max(lengths[i] for i in decodes)
        rows = seq_rows if index is None else seq_rows[index]
        lens = seq_lens if index is None else seq_lens[index]
        blocks = block_table[rows.long(), : -(-max_len // block_size)].long()
        if index is None and q.shape[0] == num_seqs:  # a decode-only step: token i is sequence i
            result = _attend(q[:, None], key_cache, value_cache, blocks, lens.long(), max_len,
                             scale)  # fmt: skip
            out.copy_(result[:, 0])
        else:
            tokens = (query_start_loc[:-1] if index is None else query_start_loc[index]).long()
            result = _attend(q[tokens][:, None], key_cache, value_cache, blocks, lens.long(),
                             max_len, scale)  # fmt: skip
            out[tokens] = result[:, 0].to(out.dtype)
    chunks = [i for i, n in enumerate(q_lens) if n > 1]
    if chunks:
        longest = max(q_lens[i] for i in chunks)
        padded = len(chunks) * longest <= 2 * sum(q_lens[i] for i in chunks)
        # Chunks of similar lengths run together (padded to the longest), others one by one.
        for group in [chunks] if padded else [[i] for i in chunks]:
            _attend_chunks(q, key_cache, value_cache, block_table, seq_rows, seq_lens, out,
                           group, starts, q_lens, lengths, scale)  # fmt: skip
    return out
