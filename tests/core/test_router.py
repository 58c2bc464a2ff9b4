"""The data-parallel router: longest prefix, balance window, capacity, provisional entries,
cold-prefix stickiness, pinning and engine removal (pure logic)."""

from __future__ import annotations

import pytest

from engine_core._core.block_hash import block_digests
from engine_core._core.engine_io import EngineLoad, KVEvents
from engine_core._core.router import Router

BS = 4


def prompt(seed: int, blocks: int, tail: int = 1) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BS + tail)]


def store(router: Router, engine: int, tokens: list[int], blocks: int | None = None) -> None:
    digests = block_digests(tokens, BS, (len(tokens) - 1) // BS)
    router.apply_events(engine, KVEvents(stored=digests[:blocks]))


def make(n: int = 2, **kwargs: object) -> Router:
    return Router(n, block_size=BS, **kwargs)  # type: ignore[arg-type]


def test_longest_prefix_wins() -> None:
    router = make(3)
    p = prompt(1, 6)
    store(router, 0, p, 2)
    store(router, 1, p, 5)
    store(router, 2, p, 3)
    assert router.depths(block_digests(p, BS, 6), [0, 1, 2]) == [2, 5, 3]
    decision = router.route("r", p)
    assert decision.engine == 1
    assert decision.reason == "affinity"
    assert decision.predicted_hit_tokens == 5 * BS
    # until its first output, the request's blocks count as held by its engine
    assert router.depths(block_digests(p, BS, 6), [0, 1, 2]) == [2, 6, 3]


def test_a_prefix_differing_in_one_block_stops_there() -> None:
    router = make()
    p = prompt(1, 4)
    store(router, 0, p)
    q = list(p)
    q[BS + 1] += 1  # the second block differs
    assert router.depths(block_digests(q, BS, 4), [0, 1]) == [1, 0]


def test_the_balance_window_overrides_affinity() -> None:
    router = make(balance_abs=2, balance_rel=1.5)
    p = prompt(1, 4)
    store(router, 0, p)
    for i in range(3):
        router.route(f"x{i}", prompt(50 + i, 0), rank=0)
    # engine 0 has 3 in flight, engine 1 none: 3 > max(0 + 2, 0 * 1.5)
    decision = router.route("r", p)
    assert decision == (1, "balance", 0)
    router.finished("x0")
    router.finished("r")
    # 2 <= max(0 + 2, 0 * 1.5): within the window, affinity again
    assert router.route("r2", p) == (0, "affinity", 4 * BS)


def test_the_capacity_filter_skips_an_engine_without_room() -> None:
    router = make()
    p = prompt(1, 8)
    store(router, 0, p, 1)
    router.update_load(0, EngineLoad(0, 0, num_free_blocks=3, num_blocks=100))
    router.update_load(1, EngineLoad(0, 0, num_free_blocks=50, num_blocks=100))
    decision = router.route("r", p)  # needs 9 blocks, 1 cached on engine 0, 3 free there
    assert decision.engine == 1
    assert decision.reason == "balance"


def test_provisional_entries_last_until_the_first_output() -> None:
    router = make()
    p = prompt(7, 5)
    first = router.route("a", p)
    # Same prompt in a burst: follows the first one before any event arrived.
    second = router.route("b", p)
    assert second.engine == first.engine
    assert second.reason == "affinity"
    router.started("a")
    router.started("b")
    other = 1 - first.engine
    assert router.depths(block_digests(p, BS, 5), [0, 1]) == [0, 0]
    assert router.pending_prefill_tokens == [0, 0]
    assert router.pending_blocks == [0, 0]
    store(router, first.engine, p)
    assert router.route("c", p).engine == first.engine
    assert router.inflight[other] == 0


def test_finishing_unstarted_requests_ends_their_entries() -> None:
    router = make()
    p = prompt(3, 3)
    router.route("a", p)
    router.finished("a")
    assert router.depths(block_digests(p, BS, 3), [0, 1]) == [0, 0]
    assert router.inflight == [0, 0]


def test_cold_prefixes_stick_by_their_first_block_and_unrelated_ones_spread() -> None:
    engines = set()
    for seed in range(40):
        router = make(balance_abs=100)
        p = prompt(seed, 4)
        engines.add(router.route("a", p).engine)
        # a fresh router decides the same for the same prompt
        assert make(balance_abs=100).route("z", p).engine == router.route("b", p).engine
    assert engines == {0, 1}


def test_a_cold_burst_of_one_prefix_lands_together() -> None:
    router = make(4, balance_abs=8)
    p = prompt(9, 6)
    chosen = {router.route(f"r{i}", p + [i]).engine for i in range(6)}
    assert len(chosen) == 1


def test_pinning() -> None:
    router = make()
    p = prompt(1, 3)
    store(router, 0, p)
    assert router.route("r", p, rank=1) == (1, "explicit", 0)
    router.remove_engine(1)
    with pytest.raises(ValueError, match="not a live engine"):
        router.route("s", p, rank=1)
    with pytest.raises(ValueError, match="not a live engine"):
        router.route("t", p, rank=5)


def test_engine_removal_forgets_its_blocks_and_requests() -> None:
    router = make(3)
    p = prompt(1, 3)
    store(router, 1, p)
    store(router, 2, p)
    router.route("a", p, rank=1)
    router.route("b", prompt(2, 2), rank=1)
    router.route("c", p, rank=2)
    assert sorted(router.remove_engine(1)) == ["a", "b"]
    assert router.inflight == [0, 0, 1]
    assert router.engine_digests(1) == set()
    assert router.engine_digests(2) == set(block_digests(p, BS, 3))
    assert router.route("d", p).engine == 2
    router.remove_engine(0)
    assert router.route("e", p).reason == "single"
    router.remove_engine(2)
    with pytest.raises(LookupError):
        router.route("f", p)
    router.add_engine(1)
    assert router.route("g", p) == (1, "single", 0)


def test_cleared_and_removed_events() -> None:
    router = make()
    p = prompt(1, 3)
    store(router, 0, p)
    store(router, 1, p)
    digests = block_digests(p, BS, 3)
    router.apply_events(0, KVEvents(removed=[digests[2]]))
    assert router.depths(digests, [0, 1]) == [2, 3]
    router.apply_events(1, KVEvents(cleared=True))
    assert router.depths(digests, [0, 1]) == [2, 0]


def test_round_robin_and_least_loaded() -> None:
    rr = make(3, policy="round_robin")
    assert [rr.route(f"r{i}", prompt(i, 2)).engine for i in range(6)] == [0, 1, 2, 0, 1, 2]
    rr.remove_engine(1)
    assert [rr.route(f"s{i}", prompt(i, 2)).engine for i in range(4)] == [0, 2, 0, 2]
    ll = make(2, policy="least_loaded")
    p = prompt(1, 3)
    store(ll, 1, p)
    assert [ll.route(f"r{i}", p).engine for i in range(4)] == [0, 1, 0, 1]
    assert ll.route("x", p).reason == "policy"


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="policy"):
        make(policy="random")
    router = make()
    router.route("a", prompt(1, 1))
    with pytest.raises(ValueError, match="routed already"):
        router.route("a", prompt(1, 1))
