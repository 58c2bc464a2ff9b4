"""Per-request KV block bookkeeping on top of the :class:`BlockPool`, with prefix caching."""

from __future__ import annotations

from collections.abc import Sequence

from engine_core._core.block_pool import BlockPool, KVCacheBlock
from engine_core._core.request import Request

__all__ = ["KVCacheManager", "PrefixCacheStats"]


class PrefixCacheStats:
    """Prefix-cache counters, recorded when a request is admitted (not per lookup attempt)."""

    __slots__ = ("requests", "queries", "hits")

    def __init__(self) -> None:
        self.requests = 0
        self.queries = 0
        """Tokens looked up."""
        self.hits = 0
        """Tokens found in the cache."""

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates blocks to requests, finds prefix-cache hits and caches newly full blocks.

    A request's blocks live on the request (``request.blocks``) so the hot path needs no lookup.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of ``request`` (whole blocks) and its length in tokens.

        The last token is always recomputed, since its logits are needed: a fully cached 32-token
        prompt with 16-token blocks hits 16 tokens, a 33-token one 32. A request that asks for
        prompt logprobs gets no hits: cached positions would not be computed, so they would have
        no logprobs.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (len(request.all_token_ids) - 1) // self.block_size
        cached = self.pool.cached
        hits: list[KVCacheBlock] = []
        for key in request.block_keys[:max_blocks]:
            # The key holds the block's tokens, so a dict hit is verified against them.
            block = cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        *,
        full_sequence_must_fit: bool = False,
    ) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens after its computed ones and
        its ``new_computed_blocks`` (prefix hits). Returns False, changing nothing, when the pool
        cannot provide them. With ``full_sequence_must_fit``, also fails unless blocks for the
        whole current sequence would fit."""
        block_size = self.block_size
        blocks = request.blocks
        num_hits = len(new_computed_blocks)
        num_total = request.num_computed_tokens + num_hits * block_size + num_new_tokens
        num_needed = -(-num_total // block_size) - len(blocks) - num_hits
        # Mutation testing: `num_needed >= 0` is an equivalent mutant (no block needed passes the
        # check below: free is never negative).
        if num_needed > 0 or num_hits or full_sequence_must_fit:
            free = self.pool.num_free_blocks
            # Hits that sit in the free queue stop being free once touched.
            free -= sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            required = num_needed
            if full_sequence_must_fit:
                # Mutation testing: `/` for `//` is equivalent: for an integer ``free``,
                # ceil(x) > free exactly when x > free.
                whole = -(-len(request.all_token_ids) // block_size) - len(blocks) - num_hits
                required = max(required, whole)
            if required > free:
                return False
            if num_hits:
                self.pool.touch(new_computed_blocks)
                blocks.extend(new_computed_blocks)
            # Mutation testing: `>= 0` is equivalent (allocate(0) returns no block).
            if num_needed > 0:  # pragma: no mutate
                blocks.extend(self.pool.allocate(num_needed))
        if self.enable_caching:
            num_full = min(num_total // block_size, len(request.block_keys))
            # Mutation testing: `>=` is equivalent (an empty range of blocks to register).
            if num_full > request.num_cached_blocks:  # pragma: no mutate
                self._cache_blocks(request, num_full)
        return True

    def _cache_blocks(self, request: Request, num_full: int) -> None:
        keys = request.block_keys
        blocks = request.blocks
        cache_block = self.pool.cache_block
        for i in range(request.num_cached_blocks, num_full):
            if blocks[i].key is None:
                cache_block(blocks[i], keys[i])
        request.num_cached_blocks = num_full

    def uncache_uncomputed(self, request: Request, num_computed_tokens: int) -> None:
        """Take back the prefix-cache entries ``request`` registered for blocks that are not
        full within its first ``num_computed_tokens`` tokens.

        Blocks are registered when a step is scheduled, before the step computes them. A request
        taken out of a step it was already scheduled in (preempted for another one) never
        computes those tokens, so its blocks past that point must not serve prefix hits. They
        are its own: hits only ever cover computed tokens, and nobody else holds them yet.
        """
        first = num_computed_tokens // self.block_size
        # Mutation testing: `<` is equivalent (an empty slice, and num_cached_blocks is first).
        if request.num_cached_blocks <= first:  # pragma: no mutate
            return
        uncache = self.pool.uncache
        for block in request.blocks[first : request.num_cached_blocks]:
            if block.key is not None:
                uncache(block)
        request.num_cached_blocks = first

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        stats = self.stats
        stats.requests += 1
        stats.queries += len(request.all_token_ids)
        stats.hits += num_hit_tokens

    def free(self, request: Request) -> None:
        """Release all blocks of ``request``, tail first."""
        blocks = request.blocks
        if blocks:
            blocks.reverse()
            self.pool.free(blocks)
            request.blocks = []
        request.num_cached_blocks = 0

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
