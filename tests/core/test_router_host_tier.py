"""The data-parallel router counts an engine's host KV tier as a cheaper prefix hit."""

from __future__ import annotations

from engine_core._core.block_hash import block_digests
from engine_core._core.engine_io import KVEvents
from engine_core._core.router import HOST_HIT_WEIGHT, Router

BS = 16
PROMPT = list(range(1, 8 * BS + 2))  # 8 full blocks to look up


def _router() -> Router:
    return Router(2, block_size=BS, balance_abs=10)


def test_host_residency_attracts_a_request() -> None:
    router = _router()
    digests = block_digests(PROMPT, BS, 8)
    router.apply_events(1, KVEvents(host_stored=digests))
    decision = router.route("r", PROMPT)
    assert decision.engine == 1
    assert decision.reason == "affinity"
    assert decision.predicted_hit_tokens == 8 * BS


def test_a_device_hit_is_worth_more_than_a_host_hit_of_the_same_length() -> None:
    router = _router()
    digests = block_digests(PROMPT, BS, 8)
    router.apply_events(0, KVEvents(stored=digests[:4]))
    router.apply_events(1, KVEvents(host_stored=digests[:7]))
    assert HOST_HIT_WEIGHT * 7 < 4
    assert router.route("r", PROMPT).engine == 0
    router.finished("r")
    # The host tier continues past the device prefix of the same engine.
    router.apply_events(0, KVEvents(host_stored=digests[4:]))
    decision = router.route("s", PROMPT)
    assert decision.engine == 0 and decision.predicted_hit_tokens == 8 * BS


def test_host_blocks_leave_with_their_events_and_with_a_dead_engine() -> None:
    router = _router()
    digests = block_digests(PROMPT, BS, 8)
    router.apply_events(1, KVEvents(host_stored=digests))
    router.apply_events(1, KVEvents(host_removed=digests[:1]))
    assert digests[0] not in router.host_index
    router.remove_engine(1)
    assert not router.host_index
