"""Per-request KV block bookkeeping on top of the :class:`BlockPool`, with prefix caching."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine_core._core.block_pool import BlockPool, KVCacheBlock
from engine_core._core.kv_groups import FULL, KVGroup, KVLayout
from engine_core._core.request import Request

__all__ = ["NULL_BLOCK", "GroupedKVCacheManager", "KVCacheManager", "PrefixCacheStats"]

NULL_BLOCK = KVCacheBlock(-1)
"""The entry of a released block in a window group's table (its id, -1, is the null id)."""


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

    num_groups = 1
    nested = False
    """Whether block ids go out as one list per group (several groups)."""

    def group_usage(self) -> list[tuple[str, int | None, int]]:
        """Per group: its kind, window (chunk) and blocks in use."""
        return [(FULL, None, self.pool.num_blocks - self.pool.num_free_blocks)]

    def table_ids(self, request: Request, start: int = 0) -> list[Any]:
        """The request's block ids from entry ``start`` on (as they go out on the wire)."""
        return [b.block_id for b in request.blocks[start:]]

    def get_computed_blocks(self, request: Request) -> tuple[list[Any], int]:
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
        new_computed_blocks: Sequence[Any] = (),
        *,
        full_sequence_must_fit: bool = False,
        keep_free: int = 0,
    ) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens after its computed ones and
        its ``new_computed_blocks`` (prefix hits). Returns False, changing nothing, when the pool
        cannot provide them. With ``full_sequence_must_fit``, also fails unless blocks for the
        whole current sequence would fit with ``keep_free`` blocks to spare (those that
        prefills under way still need)."""
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
                required = max(required, whole + keep_free)
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

    # -- capacity: what one request can ever get (admission refuses what never fits) -----------

    num_reserved_blocks = 0
    """Blocks held outside requests (pinned, parked for a transfer, taken from a cache that
    shrank): no request can get them."""
    _reserved: list[KVCacheBlock] | None = None

    @property
    def num_usable_blocks(self) -> int:
        """The most blocks one request can ever hold: the pool less the reserved blocks."""
        return self.pool.num_blocks - self.num_reserved_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks of the pool one request of ``num_tokens`` tokens needs at its peak."""
        return -(-num_tokens // self.block_size)

    def describe_need(self, num_tokens: int) -> str:
        """The need of :meth:`blocks_for_tokens` per KV-cache group ("" with one group)."""
        return ""

    def blocks_to_finish(self, request: Request, num_tokens: int) -> int:
        """The blocks ``request`` still needs to hold ``num_tokens`` tokens (a prefill under
        way: those admission must leave free for it)."""
        return max(0, -(-num_tokens // self.block_size) - len(request.blocks))

    def reserve_blocks(self, num_blocks: int) -> int:
        """Take up to ``num_blocks`` free blocks out of use (a cache that shrinks, blocks
        pinned or parked); returns how many were taken. :meth:`release_reserved_blocks` gives
        them back."""
        taken = self.pool.allocate(min(num_blocks, self.pool.num_free_blocks))
        if self._reserved is None:
            self._reserved = []
        self._reserved += taken
        self.num_reserved_blocks = len(self._reserved)
        return len(taken)

    def release_reserved_blocks(self) -> None:
        if self._reserved:
            self.pool.free(self._reserved)
        self._reserved = []
        self.num_reserved_blocks = 0


class GroupedKVCacheManager(KVCacheManager):
    """Block tables per KV-cache group, all groups in one pool (``KVLayout``).

    Every group's table has one entry per block of the request's positions, so positions stay
    aligned; a window (chunked-local) group releases the blocks its next queries cannot see,
    leaving :data:`NULL_BLOCK` in their place, into the free queue as cached blocks (they can
    still serve another request's prefix hit until evicted). Cache keys are per (block digest,
    group). A request's hits are a fixed point over the groups: full groups need every block of
    the hit (scanned left to right), window groups only those their window sees from its end
    (scanned right to left from a candidate length); each window group shrinks the candidate
    until no group shrinks it. All groups' hits are touched before any block is allocated.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        layout: KVLayout,
        *,
        enable_caching: bool = True,
        tokens_per_step: int = 8192,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_caching=enable_caching)
        self.layout = layout
        self.groups = layout.groups
        self.num_groups = len(layout.groups)
        self.nested = self.num_groups > 1
        self.tokens_per_step = tokens_per_step
        # Group 0's keys are the block digests themselves (what KV events report).
        self._suffixes = [b"" if g == 0 else b"/g%d" % g for g in range(self.num_groups)]
        self._full = [g for g, group in enumerate(self.groups) if group.span is None]
        self._windowed: list[tuple[int, KVGroup]] = [
            (g, group) for g, group in enumerate(self.groups) if group.span is not None
        ]
        self.blocks_in_use = [0] * self.num_groups

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return self.layout.blocks_needed(num_tokens, self.tokens_per_step, self.block_size)

    def blocks_to_finish(self, request: Request, num_tokens: int) -> int:
        released = request.released_blocks
        current = len(request.blocks)
        held = sum(current - r for r in released) if released is not None else 0
        return max(0, self.blocks_for_tokens(num_tokens) - held)

    def describe_need(self, num_tokens: int) -> str:
        parts = []
        for group in self.groups:
            what = group.kind if group.span is None else f"{group.kind}({group.span})"
            need = group.max_live_blocks(num_tokens, self.tokens_per_step, self.block_size)
            parts.append(f"{what}: {need}")
        return ", ".join(parts)

    def group_usage(self) -> list[tuple[str, int | None, int]]:
        return [
            (group.kind, group.span, used)
            for group, used in zip(self.groups, self.blocks_in_use, strict=True)
        ]

    # -- ids --------------------------------------------------------------------------------------

    def table_ids(self, request: Request, start: int = 0) -> list[Any]:
        """The request's block ids from entry ``start`` on: one list per group (several
        groups), else the one list; a released block is the null id -1."""
        tables = request.group_blocks
        if tables is None:
            return [[] for _ in range(self.num_groups)] if self.nested else []
        if not self.nested:
            return [b.block_id for b in tables[0][start:]]
        return [[b.block_id for b in table[start:]] for table in tables]

    # -- prefix hits ------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[Any], int]:
        """Per group, the hit blocks (null entries where a window group needs none), and the
        hit's length in tokens: the fixed point over the groups (see the class)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        block_size = self.block_size
        max_blocks = (len(request.all_token_ids) - 1) // block_size
        keys = request.block_keys[:max_blocks]
        cached = self.pool.cached
        suffixes = self._suffixes
        length = len(keys)
        for g in self._full:
            suffix = suffixes[g]
            n = 0
            for key in keys[:length]:
                if key + suffix not in cached:
                    break
                n += 1
            length = n
        changed = True
        while changed and length > 0:
            changed = False
            for g, group in self._windowed:
                suffix = suffixes[g]
                candidate = length
                while candidate > 0:
                    # At least the last block: a hit that no block of the group confirms (a
                    # chunk boundary) is no hit.
                    first = min(
                        group.first_live_block(candidate * block_size, block_size), candidate - 1
                    )
                    j = candidate - 1
                    while j >= first and keys[j] + suffix in cached:
                        j -= 1
                    if j < first:
                        break  # every block the window sees from here is cached
                    candidate = j  # block j is missing: the hit must end before it
                if candidate < length:
                    length = candidate
                    changed = True
        if length == 0:
            return [], 0
        hits: list[list[KVCacheBlock]] = []
        for g, group in enumerate(self.groups):
            suffix = suffixes[g]
            first = min(group.first_live_block(length * block_size, block_size), length - 1)
            hits.append(
                [NULL_BLOCK] * first + [cached[keys[i] + suffix] for i in range(first, length)]
            )
        return hits, length * block_size

    # -- allocation -------------------------------------------------------------------------------

    def _tables(self, request: Request) -> list[list[KVCacheBlock]]:
        tables = request.group_blocks
        if tables is None:
            tables = request.group_blocks = [[] for _ in range(self.num_groups)]
            request.blocks = tables[0]
            request.released_blocks = [0] * self.num_groups
        return tables

    def _prompt_window(self, request: Request, group: KVGroup) -> tuple[int, int]:
        """The entries a prefix hit of the request's whole prompt needs in a window group."""
        block_size = self.block_size
        end = min((request.num_prompt_tokens - 1) // block_size, len(request.block_keys))
        if end <= 0:
            return 0, 0
        return min(group.first_live_block(end * block_size, block_size), end - 1), end

    def _release(self, request: Request, tables: list[list[KVCacheBlock]]) -> None:
        """Release the window groups' blocks that no query from the computed tokens on sees.

        With prefix caching, the blocks a hit of the request's prompt would need (the window
        before the prompt's end) are kept until the request ends: released while it decodes,
        they would be evicted before the rest of its blocks, and the prompt would never hit
        again. That is a few blocks per group while the outputs are shorter than the window,
        at most the window's."""
        released = request.released_blocks
        assert released is not None
        computed = request.num_computed_tokens
        block_size = self.block_size
        pool = self.pool
        caching = self.enable_caching
        for g, group in self._windowed:
            first = group.first_live_block(computed, block_size)
            start = released[g]
            if first <= start:
                continue
            table = tables[g]
            if first > len(table):
                first = len(table)
            keep_from, keep_to = self._prompt_window(request, group) if caching else (0, 0)
            if keep_to <= start or first <= keep_from:
                gone = [b for b in table[start:first] if b is not NULL_BLOCK]
                table[start:first] = [NULL_BLOCK] * (first - start)
            else:
                gone = []
                for i in range(start, first):
                    block = table[i]
                    if block is not NULL_BLOCK and not keep_from <= i < keep_to:
                        gone.append(block)
                        table[i] = NULL_BLOCK
            released[g] = first
            if gone:
                gone.reverse()
                free_before = pool.num_free_blocks
                pool.free(gone)
                self.blocks_in_use[g] -= pool.num_free_blocks - free_before

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[Any] = (),
        *,
        full_sequence_must_fit: bool = False,
        keep_free: int = 0,
    ) -> bool:
        """As :meth:`KVCacheManager.allocate_slots`, per group; ``new_computed_blocks`` is the
        per-group hit of :meth:`get_computed_blocks`. Window groups first release what their
        windows left behind (that is never undone: those blocks are not needed again)."""
        block_size = self.block_size
        tables = self._tables(request)
        hits: Sequence[list[KVCacheBlock]] = new_computed_blocks
        num_hits = len(hits[0]) if hits else 0
        current = len(tables[0])
        if current:
            self._release(request, tables)
        num_total = request.num_computed_tokens + num_hits * block_size + num_new_tokens
        num_needed = -(-num_total // block_size) - current - num_hits
        if num_needed < 0:
            num_needed = 0
        pool = self.pool
        free = pool.num_free_blocks
        if num_hits:
            free -= sum(1 for hit in hits for b in hit if b.ref_cnt == 0 and b is not NULL_BLOCK)
        required = num_needed * self.num_groups
        if full_sequence_must_fit:
            released = request.released_blocks
            assert released is not None
            held = sum(current - r for r in released) + sum(
                1 for hit in hits for b in hit if b is not NULL_BLOCK
            )
            whole = self.layout.blocks_needed(
                len(request.all_token_ids), self.tokens_per_step, block_size
            )
            required = max(required, whole - held + keep_free)
        if required > free:
            return False
        if num_hits:
            released = request.released_blocks
            assert released is not None
            for g, hit in enumerate(hits):
                real = [b for b in hit if b is not NULL_BLOCK]
                free_before = pool.num_free_blocks
                pool.touch(real)
                self.blocks_in_use[g] += free_before - pool.num_free_blocks
                if len(real) != len(hit):
                    released[g] = len(hit) - len(real)
                tables[g].extend(hit)
        if num_needed:
            for g, table in enumerate(tables):
                table.extend(pool.allocate(num_needed))
                self.blocks_in_use[g] += num_needed
        if self.enable_caching:
            keys = request.block_keys
            num_full = min(num_total // block_size, len(keys))
            if num_full > request.num_cached_blocks:
                cache_block = pool.cache_block
                for g, table in enumerate(tables):
                    suffix = self._suffixes[g]
                    for i in range(request.num_cached_blocks, num_full):
                        block = table[i]
                        if block.key is None and block is not NULL_BLOCK:
                            cache_block(block, keys[i] + suffix)
                request.num_cached_blocks = num_full
        return True

    def uncache_uncomputed(self, request: Request, num_computed_tokens: int) -> None:
        first = num_computed_tokens // self.block_size
        tables = request.group_blocks
        if tables is None or request.num_cached_blocks <= first:
            return
        uncache = self.pool.uncache
        for table in tables:
            for block in table[first : request.num_cached_blocks]:
                if block.key is not None:
                    uncache(block)
        request.num_cached_blocks = first

    def free(self, request: Request) -> None:
        """Release every block of every group, each table tail first."""
        tables = request.group_blocks
        if tables is not None:
            pool = self.pool
            for g, table in enumerate(tables):
                real = [b for b in reversed(table) if b is not NULL_BLOCK]
                if real:
                    free_before = pool.num_free_blocks
                    pool.free(real)
                    self.blocks_in_use[g] -= pool.num_free_blocks - free_before
            request.group_blocks = None
            request.released_blocks = None
            request.blocks = []
        request.num_cached_blocks = 0
