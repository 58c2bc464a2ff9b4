"""What the layers need to know about one step: the batch geometry over the paged KV cache and
the kernels to run it with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core_cuda._kernel_ops import KernelOps

__all__ = [
    "MAX_SEGMENTS",
    "MAX_SPLIT_QUERY_LEN",
    "AttentionContext",
    "KVCache",
    "split_kv_segments",
]

MAX_SEGMENTS = 128
"""Most split-KV segments a sequence's keys are cut into."""
MIN_SEGMENT_TOKENS = 256
"""Fewest keys per segment worth a program of its own (at the longest sequence's length)."""
MAX_SPLIT_QUERY_LEN = 16
"""Longest query per sequence that still splits: decode steps, and steps verifying up to 15
draft tokens per request (speculative decoding), whose few queries per sequence leave the GPU
as idle as a decode step does."""

KVCache = tuple[torch.Tensor, torch.Tensor]
"""One layer's (key_cache, value_cache), each ``[num_blocks, block_size, num_kv_heads,
head_size]``."""


def split_kv_segments(
    num_seqs: int, num_kv_heads: int, sm_count: int, max_seq_len: int, max_query_len: int
) -> int:
    """Split-KV segments (a power of two) for a decode batch on ``sm_count`` SMs (0: not a GPU,
    no split): enough programs for about four per SM when the batch alone has fewer, but no
    segment shorter than :data:`MIN_SEGMENT_TOKENS` keys of the longest sequence, and at most
    :data:`MAX_SEGMENTS`. Steps with longer queries than :data:`MAX_SPLIT_QUERY_LEN` (prefill
    chunks) never split."""
    if sm_count <= 0 or max_query_len > MAX_SPLIT_QUERY_LEN:
        return 1
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-4 * sm_count // programs)
    if wanted <= 1:
        return 1
    by_length = max(1, max_seq_len // MIN_SEGMENT_TOKENS)
    limit = 1 << (min(by_length, MAX_SEGMENTS).bit_length() - 1)  # powers of two, rounded down
    return min(1 << (wanted - 1).bit_length(), limit)


@dataclass(slots=True)
class AttentionContext:
    """The step's batch geometry, shared by every layer (tensors on the device).

    ``seq_rows`` selects each sequence's row of the persistent ``block_table``; ``slot_mapping``
    gives each token's cache slot (negative: padding, not written).
    """

    ops: KernelOps
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_rows: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    num_segments: int = 1

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: KVCache) -> None:
        """Store this step's keys and values (``[tokens, kv_heads, head_size]``)."""
        self.ops.write_kv(key, value, cache[0], cache[1], self.slot_mapping)

    def attend(self, q: torch.Tensor, cache: KVCache, scale: float) -> torch.Tensor:
        """Causal attention of ``q`` (``[tokens, heads, head_size]``) over the cache; returns a
        new contiguous tensor of ``q``'s shape."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return self.ops.paged_attention(
            q,
            cache[0],
            cache[1],
            self.block_table,
            self.seq_rows,
            self.query_start_loc,
            self.seq_lens,
            scale=scale,
            max_query_len=self.max_query_len,
            num_segments=self.num_segments,
            out=out,
        )
