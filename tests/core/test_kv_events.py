"""KV events: what a block pool reports of its prefix cache, and the router's index fed by them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core._core.block_pool import BlockPool, KVCacheBlock
from engine_core._core.engine_io import KVEvents
from engine_core._core.kv_events import KVEventLog, block_digest
from engine_core._core.router import Router

KEYS = [bytes([i]) * 20 for i in range(12)]

_op = st.one_of(
    st.tuples(st.just("allocate"), st.integers(1, 4)),
    st.tuples(st.just("cache"), st.integers(0, 50), st.sampled_from(KEYS)),
    st.tuples(st.just("free"), st.integers(0, 50)),
    st.tuples(st.just("reset")),
    st.tuples(st.just("drain")),
)


def _index_of(router: Router) -> set[bytes]:
    return router.engine_digests(0)


@settings(max_examples=300, deadline=None)
@given(st.lists(_op, max_size=80))
def test_events_rebuild_exactly_the_cached_digests(ops: list[tuple]) -> None:
    pool = BlockPool(8)
    log = pool.events = KVEventLog()
    router = Router(2, block_size=4)
    held: list[KVCacheBlock] = []

    def drain() -> None:
        events = log.drain()
        if events is not None:
            router.apply_events(0, events)
        assert _index_of(router) == {block_digest(k) for k in pool.cached}

    for op in ops:
        match op:
            case ("allocate", n) if n <= pool.num_free_blocks:
                held.extend(pool.allocate(n))
            case ("cache", i, key) if held:
                block = held[i % len(held)]
                if block.key is None:
                    pool.cache_block(block, key)
            case ("free", i) if held:
                pool.free([held.pop(i % len(held))])
            case ("reset",):
                pool.reset_prefix_cache()
            case ("drain",):
                drain()
    drain()
    assert not router.engine_digests(1)


def test_a_step_reports_each_block_once_by_its_last_change() -> None:
    log = KVEventLog()
    log.stored(b"a")
    log.removed(b"a")
    log.removed(b"b")
    log.stored(b"b")
    events = log.drain()
    assert events == KVEvents([block_digest(b"b")], [block_digest(b"a")], False)
    assert log.drain() is None
    log.stored(b"c")
    log.clear()
    log.stored(b"d")
    assert log.drain() == KVEvents([block_digest(b"d")], [], True)


def test_no_log_records_nothing() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"k")
    assert pool.events is None
