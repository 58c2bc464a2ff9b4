"""What the layers need to know about one step: the batch geometry over the paged KV cache and
the kernels to run it with.

**KV-cache groups.** The cache's layers are split into groups (:mod:`engine_core_cuda._kv_layout`);
each group has a block table of its own per request, and so its own cache slot per token: a
layer writes and reads through its group's ``block_tables[g]`` and ``slot_mappings[g]``. With
one group (every layer full attention, or every layer reading the one full table while the
engine core has no groups) ``g`` is 0 throughout. A window layer's table may hold anything
(a null id) for the blocks wholly behind its window: attention never reads those entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_core_cuda._kernel_ops import KernelOps
from engine_core_cuda._layer_kinds import LayerAttention

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

    ``seq_rows`` selects each sequence's row of the persistent block table of each KV-cache
    group (``block_tables[g]``); ``slot_mappings[g]`` gives each token's cache slot in group
    ``g`` (negative: padding, not written).
    """

    ops: KernelOps
    slot_mappings: tuple[torch.Tensor, ...]
    block_tables: tuple[torch.Tensor, ...]
    seq_rows: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    num_segments: int = 1
    """Split-KV segments of full-attention layers."""
    span_segments: dict[int, int] = field(default_factory=dict)
    """Split-KV segments of the layers whose queries see at most ``span`` keys (a window or a
    chunk): fewer keys, fewer segments."""

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: KVCache,
        group: int = 0,
        scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        """Store this step's keys and values (``[tokens, kv_heads, head_size]``) in the slots of
        KV-cache group ``group``; an FP8 cache divides them by ``scales`` (per tensor: keys,
        values)."""
        if cache[0].dtype == torch.float8_e4m3fn:
            self.ops.write_kv(key, value, cache[0], cache[1], self.slot_mappings[group], *scales)
        else:
            self.ops.write_kv(key, value, cache[0], cache[1], self.slot_mappings[group])

    def attend(
        self,
        q: torch.Tensor,
        cache: KVCache,
        layer: LayerAttention,
        group: int = 0,
        sinks: torch.Tensor | None = None,
        scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """Causal attention of ``q`` (``[tokens, heads, head_size]``) over the cache, of the
        kind ``layer`` (its scale, window, chunk, soft cap; ``sinks``: one logit per query
        head), through the block table of KV-cache group ``group``; returns a new contiguous
        tensor of ``q``'s shape. An FP8 cache's ``scales`` (keys, values) multiply the scores
        and the output (exact: attention is linear in each)."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        span = layer.span
        k_scale, v_scale = scales if cache[0].dtype == torch.float8_e4m3fn else (1.0, 1.0)
        out = self.ops.paged_attention(
            q,
            cache[0],
            cache[1],
            self.block_tables[group],
            self.seq_rows,
            self.query_start_loc,
            self.seq_lens,
            scale=layer.scale * k_scale,
            max_query_len=self.max_query_len,
            num_segments=self.num_segments if span is None else self.span_segments.get(span, 1),
            out=out,
            window=layer.window,
            chunk=layer.chunk,
            softcap=layer.softcap,
            sinks=sinks,
        )
        return out if v_scale == 1.0 else out.mul_(v_scale)
