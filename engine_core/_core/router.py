"""Which engine of a data-parallel deployment serves a request (pure logic, no I/O).

The router keeps an index from block digest to the engines holding that block, fed by the KV
events every engine sends with its step outputs, plus *provisional* entries for requests routed
but not started yet (until their first output, whose message carries the real events): so the
siblings of a request and follow-up turns sent in a burst land on the same engine.

Policy ``"prefix"``: among the live engines within a balance window of the least loaded (in-flight
requests at most ``balance_abs`` more, or ``balance_rel`` times as many) that have room for the
request's uncached blocks, the one holding the longest prefix wins (ties: fewer in flight, fewer
prefill tokens pending, then a stable hash). A prompt cached nowhere (a cold prefix) goes where a
rendezvous hash of its first block says among the least loaded (within one request), so identical
cold prompts meet while unrelated ones spread. ``"least_loaded"`` and ``"round_robin"`` ignore
prefixes. A request may pin an engine.

Engines with a host KV tier also report the blocks it holds (``KVEvents.host_stored``): a block
in an engine's host tier continues that engine's prefix past its device hit, counted as a cheaper
hit (:data:`HOST_HIT_WEIGHT` of a device block: it is loaded, not computed, but not free).
"""

from __future__ import annotations

from typing import NamedTuple

from xxhash import xxh3_64_intdigest

from engine_core._core.block_hash import block_digests, iter_block_digests
from engine_core._core.engine_io import EngineLoad, KVEvents

__all__ = ["POLICIES", "REASONS", "RouteDecision", "Router"]

POLICIES = ("prefix", "least_loaded", "round_robin")
HOST_HIT_WEIGHT = 0.5
"""What a block in an engine's host tier is worth to the prefix policy, against one in its
device cache (1) and a miss (0)."""
REASONS = ("affinity", "balance", "cold", "explicit", "failover", "single", "policy", "handoff")
"""Why a request went where it went: the engine held its longest prefix (``affinity``); another
engine held a longer one but was too loaded or too full (``balance``); none held any
(``cold``); the request pinned it (``explicit``); its engine died (``failover``, set by the
caller); only one engine was alive (``single``); a policy that ignores prefixes (``policy``);
a prefill engine handed the request to a decode engine (``handoff``, set by the caller:
disaggregation)."""


class RouteDecision(NamedTuple):
    engine: int
    reason: str
    predicted_hit_tokens: int
    """Tokens of the prompt the chosen engine is expected to find cached."""


class _Routed:
    __slots__ = ("engine", "digests", "prefill_tokens", "blocks")

    def __init__(self, engine: int, digests: list[bytes], prefill_tokens: int, blocks: int):
        self.engine = engine
        self.digests = digests
        """Provisional index entries, until the first output."""
        self.prefill_tokens = prefill_tokens
        self.blocks = blocks


class Router:
    """Routing state of ``num_engines`` engines (ranks ``0..num_engines-1``)."""

    def __init__(
        self,
        num_engines: int,
        *,
        block_size: int,
        policy: str = "prefix",
        balance_abs: int = 2,
        balance_rel: float = 1.5,
        caching: bool = True,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.num_engines = num_engines
        self.block_size = block_size
        self.policy = policy
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.caching = caching
        self.alive = [True] * num_engines
        self.inflight = [0] * num_engines
        self.pending_prefill_tokens = [0] * num_engines
        self.pending_blocks = [0] * num_engines
        self.free_blocks: list[int | None] = [None] * num_engines
        """From each engine's latest load report (None before the first)."""
        self.index: dict[bytes, int] = {}
        """Block digest -> bitmask of the engines that cache it (from their events)."""
        self.host_index: dict[bytes, int] = {}
        """Block digest -> bitmask of the engines whose host KV tier holds it."""
        self._pending_mask: dict[bytes, int] = {}
        self._pending_counts: list[dict[bytes, int]] = [{} for _ in range(num_engines)]
        self._routed: dict[str, _Routed] = {}
        self._next = 0
        self._lora_key = b""
        """The LoRA adapter key of the request being routed (block digests include it)."""

    # -- decisions ------------------------------------------------------------------------------

    def live_engines(self) -> list[int]:
        return [e for e in range(self.num_engines) if self.alive[e]]

    def route(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        cache_salt: str | None = None,
        rank: int | None = None,
        engines: list[int] | None = None,
        least_loaded: bool = False,
        lora_key: bytes = b"",
    ) -> RouteDecision:
        """Choose the engine of a new request and count it in flight there: among ``engines``
        (None: every engine; disaggregation routes among the engines of one role), by the
        policy, or the least loaded with ``least_loaded``. Raises ``ValueError`` for a pinned
        engine that does not exist or is dead, ``LookupError`` when no engine is alive."""
        if request_id in self._routed:
            raise ValueError(f"request {request_id!r} is routed already")
        alive = self.live_engines()
        if engines is not None and rank is None:
            alive = [e for e in alive if e in engines]
        if not alive:
            raise LookupError("no engine is alive")
        if least_loaded and rank is None and len(alive) > 1:
            inflight = self.inflight
            engine = min(alive, key=lambda e: (inflight[e], -self._free_estimate(e)))
            blocks = -(-(len(prompt_token_ids) + 1) // self.block_size)
            return self._commit(request_id, engine, "policy", 0, [], len(prompt_token_ids), blocks)
        self._lora_key = lora_key
        return self._decide(request_id, prompt_token_ids, cache_salt, rank, alive)

    def _decide(
        self,
        request_id: str,
        prompt: list[int],
        cache_salt: str | None,
        rank: int | None,
        alive: list[int],
    ) -> RouteDecision:
        bs = self.block_size
        blocks = -(-(len(prompt) + 1) // bs)
        if rank is not None:
            if not (0 <= rank < self.num_engines) or not self.alive[rank]:
                raise ValueError(
                    f"data_parallel_rank {rank} is not a live engine "
                    f"(live: {', '.join(map(str, alive))})"
                )
            return self._commit(request_id, rank, "explicit", 0, [], len(prompt), blocks)
        if len(alive) == 1:
            return self._commit(request_id, alive[0], "single", 0, [], len(prompt), blocks)
        inflight = self.inflight
        if self.policy == "round_robin":
            engine = self._round_robin(alive)
            return self._commit(request_id, engine, "policy", 0, [], len(prompt), blocks)
        if self.policy == "least_loaded":
            engine = min(alive, key=lambda e: (inflight[e], -self._free_estimate(e)))
            return self._commit(request_id, engine, "policy", 0, [], len(prompt), blocks)
        depth, digests = self._walk(prompt, cache_salt, alive)
        score: list[float] = list(depth)
        host = [0] * self.num_engines
        if self.host_index:
            host = self._host_extension(prompt, cache_salt, alive, depth)
            score = [d + HOST_HIT_WEIGHT * h for d, h in zip(depth, host, strict=True)]
        lo = min(inflight[e] for e in alive)
        limit = max(lo + self.balance_abs, lo * self.balance_rel)
        window = [e for e in alive if inflight[e] <= limit]
        candidates = [e for e in window if self._free_estimate(e) >= blocks - depth[e]]
        if not candidates:
            candidates = [min(alive, key=lambda e: (inflight[e], -self._free_estimate(e)))]
        stable = digests[0] if digests else request_id.encode()
        best = max(
            candidates,
            key=lambda e: (
                score[e],
                -inflight[e],
                -self.pending_prefill_tokens[e],
                xxh3_64_intdigest(stable, seed=e),
            ),
        )
        if score[best] == 0:
            # Cold everywhere: a stable place for this prefix among the least loaded (within
            # one request), so that identical prompts meet even without provisional entries
            # (another front end, a restart) while cold traffic stays balanced.
            least = min(inflight[e] for e in candidates)
            best = max(
                (e for e in candidates if inflight[e] <= least + 1),
                key=lambda e: xxh3_64_intdigest(stable, seed=e),
            )
        deepest = max(score[e] for e in alive)
        reason = "balance" if score[best] < deepest else "affinity" if deepest else "cold"
        hit = (depth[best] + host[best]) * bs
        return self._commit(request_id, best, reason, hit, digests, len(prompt) - hit, blocks)

    def _round_robin(self, alive: list[int]) -> int:
        for offset in range(self.num_engines):
            engine = (self._next + offset) % self.num_engines
            if self.alive[engine]:
                self._next = engine + 1
                return engine
        return alive[0]

    def _free_estimate(self, engine: int) -> float:
        free = self.free_blocks[engine]
        if free is None:
            return float("inf")
        return free - self.pending_blocks[engine]

    def _walk(
        self, prompt: list[int], cache_salt: str | None, engines: list[int]
    ) -> tuple[list[int], list[bytes]]:
        """Each engine's longest cached prefix of ``prompt`` (blocks, by rank), and the digests
        of the blocks looked at: hashing stops at the first block that no engine holds (it and
        the blocks before are what a provisional entry needs)."""
        depth = [0] * self.num_engines
        digests: list[bytes] = []
        if not self.caching:
            return depth, digests
        live = 0
        for e in engines:
            live |= 1 << e
        index, pending = self.index, self._pending_mask
        bs = self.block_size
        num = (len(prompt) - 1) // bs
        for digest in iter_block_digests(prompt, bs, num, cache_salt, self._lora_key):
            digests.append(digest)
            held = (index.get(digest, 0) | pending.get(digest, 0)) & live
            dropped = live & ~held
            if dropped:
                for e in engines:
                    if dropped >> e & 1:
                        depth[e] = len(digests) - 1
            live = held
            if not live:
                return depth, digests
        for e in engines:
            if live >> e & 1:
                depth[e] = len(digests)
        return depth, digests

    def _host_extension(
        self, prompt: list[int], cache_salt: str | None, engines: list[int], depth: list[int]
    ) -> list[int]:
        """For each engine, the blocks after its device prefix that its host tier (or its
        device) holds, in a row."""
        extra = [0] * self.num_engines
        digests = block_digests(
            prompt,
            self.block_size,
            (len(prompt) - 1) // self.block_size,
            cache_salt,
            self._lora_key,
        )
        index, host = self.index, self.host_index
        for e in engines:
            bit = 1 << e
            i = depth[e]
            while i < len(digests) and (
                host.get(digests[i], 0) & bit or index.get(digests[i], 0) & bit
            ):
                i += 1
            extra[e] = i - depth[e]
        return extra

    def depths(self, digests: list[bytes], engines: list[int]) -> list[int]:
        """For each engine (by rank; 0 for those not in ``engines``), how many leading blocks
        of ``digests`` it holds, from its events and the provisional entries."""
        depth = [0] * self.num_engines
        live = 0
        for e in engines:
            live |= 1 << e
        index, pending = self.index, self._pending_mask
        for i, digest in enumerate(digests):
            held = (index.get(digest, 0) | pending.get(digest, 0)) & live
            dropped = live & ~held
            if dropped:
                for e in engines:
                    if dropped >> e & 1:
                        depth[e] = i
            live = held
            if not live:
                return depth
        for e in engines:
            if live >> e & 1:
                depth[e] = len(digests)
        return depth

    def _commit(
        self,
        request_id: str,
        engine: int,
        reason: str,
        hit: int,
        digests: list[bytes],
        prefill_tokens: int,
        blocks: int,
    ) -> RouteDecision:
        self.inflight[engine] += 1
        self.pending_prefill_tokens[engine] += prefill_tokens
        self.pending_blocks[engine] += blocks
        if digests:
            counts = self._pending_counts[engine]
            bit = 1 << engine
            mask = self._pending_mask
            for digest in digests:
                n = counts.get(digest, 0)
                counts[digest] = n + 1
                if not n:
                    mask[digest] = mask.get(digest, 0) | bit
        self._routed[request_id] = _Routed(engine, digests, prefill_tokens, blocks)
        return RouteDecision(engine, reason, hit)

    # -- what the engines report ----------------------------------------------------------------

    def engine_of(self, request_id: str) -> int | None:
        routed = self._routed.get(request_id)
        return None if routed is None else routed.engine

    def started(self, request_id: str) -> None:
        """The request's first output arrived: its provisional entries end (the same message
        carried the events of the blocks it cached)."""
        routed = self._routed.get(request_id)
        if routed is not None and routed.blocks >= 0:
            self._end_pending(routed)

    def finished(self, request_id: str) -> None:
        """The request ended (or was aborted, or moves elsewhere)."""
        routed = self._routed.pop(request_id, None)
        if routed is None:
            return
        if routed.blocks >= 0:
            self._end_pending(routed)
        self.inflight[routed.engine] -= 1

    def _end_pending(self, routed: _Routed) -> None:
        engine = routed.engine
        self.pending_prefill_tokens[engine] -= routed.prefill_tokens
        self.pending_blocks[engine] -= routed.blocks
        routed.blocks = -1  # ended
        if routed.digests:
            counts = self._pending_counts[engine]
            mask = self._pending_mask
            bit = 1 << engine
            for digest in routed.digests:
                n = counts[digest] - 1
                if n:
                    counts[digest] = n
                    continue
                del counts[digest]
                left = mask[digest] & ~bit
                if left:
                    mask[digest] = left
                else:
                    del mask[digest]
            routed.digests = []

    def apply_events(self, engine: int, events: KVEvents) -> None:
        """Apply one step's prefix-cache changes of ``engine``."""
        if not self.alive[engine]:
            return
        index = self.index
        bit = 1 << engine
        if events.cleared:
            self._drop_bit(bit)
        for digest in events.removed:
            held = index.get(digest)
            if held is not None:
                held &= ~bit
                if held:
                    index[digest] = held
                else:
                    del index[digest]
        for digest in events.stored:
            index[digest] = index.get(digest, 0) | bit
        if events.host_stored or events.host_removed:
            host = self.host_index
            for digest in events.host_removed:
                held = host.get(digest)
                if held is not None:
                    held &= ~bit
                    if held:
                        host[digest] = held
                    else:
                        del host[digest]
            for digest in events.host_stored:
                host[digest] = host.get(digest, 0) | bit

    def update_load(self, engine: int, load: EngineLoad) -> None:
        self.free_blocks[engine] = load.num_free_blocks

    def engine_digests(self, engine: int) -> set[bytes]:
        """What the index says ``engine`` caches (its events only)."""
        bit = 1 << engine
        return {d for d, held in self.index.items() if held & bit}

    # -- engines coming and going ---------------------------------------------------------------

    def remove_engine(self, engine: int) -> list[str]:
        """``engine`` died: it gets nothing more and is forgotten by the index. Returns the
        requests that were routed to it (no longer in flight anywhere)."""
        self.alive[engine] = False
        lost = [rid for rid, routed in self._routed.items() if routed.engine == engine]
        for request_id in lost:
            self.finished(request_id)
        self._drop_bit(1 << engine)
        self.free_blocks[engine] = None
        return lost

    def add_engine(self, engine: int) -> None:
        """``engine`` (re)joins with an empty cache."""
        self._drop_bit(1 << engine)
        self.alive[engine] = True
        self.free_blocks[engine] = None

    def _drop_bit(self, bit: int) -> None:
        for index in (self.index, self.host_index):
            for digest in [d for d, held in index.items() if held & bit]:
                left = index[digest] & ~bit
                if left:
                    index[digest] = left
                else:
                    del index[digest]
