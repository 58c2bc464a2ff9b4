"""The host KV tier and the KV connector rules, end to end on the mock (``docs/kv_connector.md``).

Every test ends with the leak check: the device pool whole again, no block pinned or parked,
nothing in flight on the modelled link, no block held in the mock's ledger.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from engine_core_mock._backend import MockBackend
from engine_core_mock._kv_link import MockHostWorker

from engine_core._core.engine_io import EngineCoreRequest
from engine_core._engine.core import EngineCore
from engine_core.config import EngineConfig
from engine_core.kv_connector import (
    KVConnectorLayout,
    KVConnectorMetadata,
    KVConnectorReport,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from engine_core.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)

BLOCK = 16
PAGE = 2 * 2 * BLOCK * 1 * 8 * 2  # 2 layers, K and V, 1 head of 8, 2 bytes
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def make_core(
    num_blocks: int = 40,
    host_blocks: int = 256,
    *,
    link: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> EngineCore:
    backend_options: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 1, "head_size": 8}
    backend_options["kv_link"] = {"host_memory_bytes": 1 << 40, **(link or {})}
    backend_options.update(options or {})
    config = EngineConfig(
        backend="mock",
        tokenizer="byte",
        num_kv_blocks=num_blocks,
        block_size=BLOCK,
        max_model_len=512,
        kv_offload_bytes=host_blocks * PAGE,
        backend_options=backend_options,
        **kwargs,
    )
    return EngineCore(config)


def prompt(i: int, length: int = 160) -> list[int]:
    return [(i * 31 + j * 7) % 250 + 1 for j in range(length)]


def run(
    core: EngineCore, requests: list[tuple[str, list[int]]], params: SamplingParams = GREEDY
) -> tuple[dict[str, list[int]], dict[str, str | None]]:
    """Add the requests, step until the engine has no work; tokens and finish reasons."""
    for req_id, tokens in requests:
        core.add_request(EngineCoreRequest(req_id, tokens, params))
    out_tokens: dict[str, list[int]] = {r: [] for r, _ in requests}
    finished: dict[str, str | None] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not core.has_work:
            break
        out = core.step()
        for rid, new in zip(out.req_ids, out.new_token_ids, strict=True):
            out_tokens.setdefault(rid, []).extend(new)
        for f in out.finished:
            finished[f.req_id] = f.error or f.finish_reason
    else:
        raise AssertionError("the engine did not finish")
    return out_tokens, finished


def assert_no_leaks(core: EngineCore) -> None:
    scheduler = core.scheduler
    kv = scheduler.kv
    assert not scheduler.requests
    assert kv.num_free_blocks == kv.num_blocks, "device blocks leaked"
    connector = scheduler.connector
    assert connector is not None
    assert not connector.pins, f"blocks still pinned: {list(connector.pins)}"
    assert not connector.parked and connector.parked_blocks == 0
    backend = core.backend
    assert isinstance(backend, MockBackend)
    worker = backend._connector
    if isinstance(worker, MockHostWorker):
        assert not worker._pending, "transfers still in flight"
    ledger = backend._blocks
    assert ledger is not None
    # The backend drops ended requests with the next step it runs: only theirs may be held.
    live = [0] * ledger.num_blocks
    for state in backend._requests.values():
        for table in state.group_tables or [state.block_ids]:
            for block_id in table:
                if block_id >= 0:
                    live[block_id] += 1
    assert ledger._refs == live, "the mock's ledger holds blocks for a transfer"
    stats = core.get_stats()
    assert stats.kv_offload_free_blocks + stats.kv_offload_resident_blocks == (
        stats.kv_offload_capacity_blocks
    ), "host blocks leaked"
    groups = getattr(kv, "blocks_in_use", None)
    if groups is not None:
        assert groups == [0] * len(groups)


def rounds(n: int, k: int = 6, length: int = 160) -> list[list[tuple[str, list[int]]]]:
    return [[(f"r{r}-{i}", prompt(i, length)) for i in range(k)] for r in range(n)]


def reference(requests: list[tuple[str, list[int]]]) -> dict[str, list[int]]:
    """Greedy mock tokens count up from the last prompt token."""
    return {r: [(p[-1] + 1 + j) % 258 for j in range(4)] for r, p in requests}


# -- hits ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_evicted_prompts_come_back_from_the_host_tier(async_scheduling: bool) -> None:
    core = make_core(async_scheduling=async_scheduling)
    for batch in rounds(3):
        tokens, finished = run(core, batch)
        assert tokens == reference(batch)
        assert set(finished.values()) == {"length"}
    stats = core.get_stats()
    assert stats.kv_offload_hit_tokens > 0
    assert stats.kv_offload_bytes_loaded > 0 and stats.kv_offload_bytes_stored > 0
    assert stats.kv_offload_failed_blocks == 0
    assert_no_leaks(core)


def test_tier_off_and_on_give_the_same_tokens_with_more_hits() -> None:
    off = EngineCore(
        EngineConfig(
            backend="mock",
            tokenizer="byte",
            num_kv_blocks=40,
            max_model_len=512,
            backend_options={"num_layers": 2, "num_kv_heads": 1, "head_size": 8},
        )
    )
    on = make_core()
    for batch in rounds(3):
        assert run(off, batch) == run(on, batch)
    assert on.get_stats().prefix_cache_hits > off.get_stats().prefix_cache_hits
    assert_no_leaks(on)


def test_cache_salt_isolates_the_host_tier() -> None:
    core = make_core()
    p = prompt(1)
    for salt in ("a", "b"):
        core.add_request(EngineCoreRequest(f"x-{salt}", p, GREEDY, cache_salt=salt))
    run(core, [])
    run(core, [(f"evict{i}", prompt(10 + i)) for i in range(6)])
    before = core.get_stats().kv_offload_hit_tokens
    core.add_request(EngineCoreRequest("y", p, GREEDY, cache_salt="c"))
    run(core, [])
    assert core.get_stats().kv_offload_hit_tokens == before  # salt "c" finds nothing
    core.add_request(EngineCoreRequest("z", p, GREEDY, cache_salt="a"))
    run(core, [])
    assert core.get_stats().kv_offload_hit_tokens > before
    assert_no_leaks(core)


def test_kv_cache_groups_with_a_window_group() -> None:
    options = {
        "num_layers": 4,
        "layer_types": ["full_attention", "sliding_attention"] * 2,
        "sliding_window": 64,
    }
    core = make_core(num_blocks=80, host_blocks=512, options=options)
    assert core.scheduler.kv.num_groups == 2
    for batch in rounds(3):
        tokens, _ = run(core, batch)
        assert tokens == reference(batch)
    assert core.get_stats().kv_offload_hit_tokens > 0
    assert_no_leaks(core)


def test_speculative_decoding_beside_the_host_tier() -> None:
    core = make_core(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "dynamic": False}
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for batch in rounds(2):
        tokens, _ = run(core, batch, params)
        assert tokens == {r: [(p[-1] + 1 + j) % 258 for j in range(24)] for r, p in batch}
    assert core.get_stats().kv_offload_hit_tokens > 0
    assert_no_leaks(core)


def test_preempted_requests_resume_with_a_load() -> None:
    def recomputed(core: EngineCore) -> tuple[int, dict[str, list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        batch = [(f"p{i}", prompt(i, 96)) for i in range(8)]
        tokens, _ = run(core, batch, params)
        assert core.get_stats().num_preemptions > 0
        return core.scheduler.num_recomputed_tokens, tokens

    off = EngineCore(
        EngineConfig(
            backend="mock",
            tokenizer="byte",
            num_kv_blocks=36,
            max_model_len=512,
            backend_options={"num_layers": 2, "num_kv_heads": 1, "head_size": 8},
        )
    )
    on = make_core(num_blocks=36)
    off_tokens, off_out = recomputed(off)
    on_tokens, on_out = recomputed(on)
    assert on_out == off_out
    assert on_tokens < off_tokens
    assert_no_leaks(on)


# -- failures -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["drop", "corrupt", "late"])
def test_failed_loads_recompute_and_give_the_fault_free_tokens(kind: str) -> None:
    link = {"fault": {"kind": kind, "probability": 0.5, "seed": 3, "late_s": 0.05}}
    link["deadline_s"] = 0.01
    core = make_core(link=link)
    for batch in rounds(3):
        tokens, finished = run(core, batch)
        assert tokens == reference(batch)
        assert set(finished.values()) == {"length"}
    stats = core.get_stats()
    assert stats.kv_offload_failed_blocks > 0
    assert_no_leaks(core)


def test_failed_loads_with_several_kv_cache_groups() -> None:
    options = {
        "num_layers": 4,
        "layer_types": ["full_attention", "sliding_attention"] * 2,
        "sliding_window": 64,
    }
    link = {"fault": {"kind": "drop", "probability": 0.5, "seed": 5}}
    core = make_core(num_blocks=80, host_blocks=512, options=options, link=link)
    for batch in rounds(3):
        tokens, finished = run(core, batch)
        assert tokens == reference(batch)
        assert set(finished.values()) == {"length"}
    assert core.get_stats().kv_offload_failed_blocks > 0
    assert_no_leaks(core)


def test_saves_past_their_lease_are_cancelled_and_nothing_leaks() -> None:
    core = make_core(link={"bytes_per_s": 1e3}, kv_lease_s=0.2)  # a save takes seconds
    batch = rounds(1)[0]
    tokens, _ = run(core, batch)
    assert tokens == reference(batch)
    connector = core.scheduler.connector
    assert connector is not None and connector.counters.lease_expired > 0
    assert core.get_stats().kv_offload_resident_blocks == 0  # no save was committed
    assert_no_leaks(core)


def test_the_host_tier_evicts_least_recently_used_blocks() -> None:
    core = make_core(host_blocks=24)  # two prompts' worth of blocks
    for batch in rounds(2):
        tokens, _ = run(core, batch)
        assert tokens == reference(batch)
    connector = core.scheduler.connector
    assert connector is not None
    host = connector.connector
    assert host.stats()["evictions"] > 0
    assert core.get_stats().kv_offload_resident_blocks <= 24
    assert_no_leaks(core)


def test_failure_policy_fail_ends_the_request_with_an_error() -> None:
    link = {"fault": {"kind": "drop", "probability": 1.0, "seed": 0}}
    core = make_core(link=link, kv_load_failure_policy="fail")
    run(core, rounds(1)[0])  # fills the host tier (the fault hits loads only)
    _, finished = run(core, [(f"again{i}", prompt(i)) for i in range(6)])
    errors = [e for e in finished.values() if e not in ("length",)]
    assert errors and all("KV load" in str(e) and "failed" in str(e) for e in errors)
    assert_no_leaks(core)


def test_a_wrong_block_never_passes_silently() -> None:
    link = {"fault": {"kind": "corrupt", "probability": 1.0, "seed": 0, "detect": False}}
    core = make_core(link=link)
    run(core, rounds(1)[0])
    run(core, [(f"evict{i}", prompt(20 + i)) for i in range(6)])
    with pytest.raises(RuntimeError, match="different token prefix|no request has finished"):
        run(core, [("again", prompt(0))])


class _NeverWorker(KVConnectorWorker):
    """Starts loads and never finishes them (a remote that went silent)."""

    def register_kv_caches(self, kv_caches: Any) -> None:
        pass

    def start_step(self, metadata: KVConnectorMetadata | None) -> None:
        pass

    def get_finished(self) -> KVConnectorReport | None:
        return None


class _OfferAll(KVConnectorScheduler):
    """Offers every whole block but the last of every prompt; loads never arrive."""

    def __init__(self, config: EngineConfig, layout: KVConnectorLayout) -> None:
        super().__init__(config, layout)
        self.raise_for: int | None = None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self.raise_for is not None and request.all_token_ids[0] == self.raise_for:
            raise RuntimeError("index unavailable")
        if request.all_token_ids[0] == 9:
            return 0, False
        usable = (len(request.all_token_ids) - 1) // BLOCK * BLOCK
        return usable - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, block_ids: Any, n: int) -> None:
        self.pending = getattr(self, "pending", []) + ([request.request_id] if n else [])

    def build_metadata(self, step: Any) -> KVConnectorMetadata | None:
        loads = getattr(self, "pending", [])
        self.pending = []
        if not loads and not step.cancelled:
            return None
        return KVConnectorMetadata(cancelled=list(step.cancelled))

    def on_report(self, report: KVConnectorReport) -> None:
        pass

    hold = False

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self.hold, {"remote": "never"} if self.hold else None


class _Provider:
    name = "never"
    last: _OfferAll | None = None

    def scheduler(self, config: EngineConfig, layout: KVConnectorLayout) -> KVConnectorScheduler:
        _Provider.last = _OfferAll(config, layout)
        return _Provider.last

    def worker(
        self, config: EngineConfig, layout: KVConnectorLayout, backend: str, rank: int
    ) -> Any:
        return _NeverWorker(config, layout, rank)


@pytest.fixture
def never_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine_core_mock._backend as mock_backend

    import engine_core._engine.startup as startup

    monkeypatch.setattr(startup, "load_kv_connector", lambda name: _Provider())
    monkeypatch.setattr(mock_backend, "load_kv_connector", lambda name: _Provider())


def _never_core(**kwargs: Any) -> EngineCore:
    return EngineCore(
        EngineConfig(
            backend="mock",
            tokenizer="byte",
            num_kv_blocks=24,
            max_model_len=256,
            kv_connector="never",
            kv_lease_s=0.2,
            backend_options={"num_layers": 2, "num_kv_heads": 1, "head_size": 8},
            **kwargs,
        )
    )


@pytest.mark.usefixtures("never_connector")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_parked_loads_holding_the_heads_blocks_are_cancelled_not_stalled(
    async_scheduling: bool,
) -> None:
    # Two parked loads hold 20 of the 24 blocks; the head needs 10: nothing runs, and the
    # loads never arrive. The scheduler cancels them (they recompute) instead of stalling.
    core = _never_core(kv_max_parked_fraction=1.0, async_scheduling=async_scheduling)
    batch = [("a", prompt(1, 150)), ("b", prompt(2, 150)), ("head", prompt(3, 150))]
    tokens, finished = run(core, batch)
    assert tokens == reference(batch)
    assert set(finished.values()) == {"length"}
    stats = core.get_stats()
    assert stats.kv_loads_cancelled >= 2
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks
    assert not core.scheduler.connector.parked  # type: ignore[union-attr]


@pytest.mark.usefixtures("never_connector")
def test_held_blocks_of_a_finished_request_are_freed_when_the_lease_ends() -> None:
    core = _never_core()
    assert _Provider.last is not None
    _Provider.last.hold = True
    tokens, finished = run(core, [("a", [9] + prompt(1, 20))])  # a device miss: no offer
    connector = core.scheduler.connector
    assert connector is not None
    assert finished == {"a": "length"}
    # Its save is never reported: the blocks were held until kv_lease_s (0.2 s) ran out.
    assert not connector.pins
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks
    assert connector.counters.lease_expired >= 1


@pytest.mark.usefixtures("never_connector")
def test_what_parked_loads_hold_is_bounded() -> None:
    core = _never_core(kv_max_parked_fraction=0.5)
    for i in range(4):
        core.add_request(EngineCoreRequest(f"r{i}", prompt(i, 150), GREEDY))
    core.step()
    connector = core.scheduler.connector
    assert connector is not None
    assert connector.parked_blocks <= connector.max_parked_blocks == 12
    run(core, [])
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks


@pytest.mark.usefixtures("never_connector")
def test_a_scheduler_half_that_raises_ends_only_its_requests() -> None:
    core = _never_core()
    assert _Provider.last is not None
    bad = prompt(5, 40)
    _Provider.last.raise_for = bad[0]
    good = [9] + prompt(6, 10)
    tokens, finished = run(core, [("bad", bad), ("good", good)])
    assert "index unavailable" in str(finished["bad"]) and "KV connector" in str(finished["bad"])
    assert finished["good"] == "length" and tokens["good"] == reference([("g", good)])["g"]
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks


def test_a_worker_half_that_raises_is_a_backend_error() -> None:
    core = make_core(link={"fault": {"kind": "raise", "probability": 1.0, "on": "both"}})
    with pytest.raises(RuntimeError, match="worker half raised"):
        run(core, rounds(2)[0])


def test_the_command_line_flag() -> None:
    import argparse

    from engine_core.cli import add_engine_config_flags, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_config_flags(parser)
    args = parser.parse_args(["--kv-offload-bytes", "8GiB"])
    assert engine_config_from_args(args).kv_offload_bytes == 8 << 30
    with pytest.raises(ValueError, match="kv_offload_bytes"):
        engine_config_from_args(parser.parse_args(["--kv-offload-bytes", "lots"]))


# -- bad input ----------------------------------------------------------------------------------


def test_more_host_memory_than_can_be_pinned_is_a_startup_error() -> None:
    with pytest.raises(ValueError, match=r"kv_offload_bytes \(--kv-offload-bytes\).*only 1\.0 GiB"):
        EngineCore(
            EngineConfig(
                backend="mock",
                tokenizer="byte",
                kv_offload_bytes="8GiB",
                backend_options={"kv_link": {"host_memory_bytes": 1 << 30}},
            )
        )


@pytest.mark.parametrize("value", [-1, "-3GiB", "lots", "8 parsecs", True, 1.5j])
def test_kv_offload_bytes_must_be_a_size(value: Any) -> None:
    with pytest.raises(ValueError, match="kv_offload_bytes"):
        EngineConfig(kv_offload_bytes=value)


def test_sizes_are_parsed() -> None:
    assert EngineConfig(kv_offload_bytes="8GiB").kv_offload_bytes == 8 << 30
    assert EngineConfig(kv_offload_bytes="512MB").kv_offload_bytes == 512 * 10**6
    assert EngineConfig(kv_offload_bytes=0).kv_connector_name is None
    assert EngineConfig(kv_offload_bytes="1k").kv_connector_name == "host"


def test_unknown_connector_and_prefix_caching_off_are_startup_errors() -> None:
    with pytest.raises(ValueError, match="unknown KV connector 'nope'"):
        EngineCore(EngineConfig(backend="mock", tokenizer="byte", kv_connector="nope"))
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        EngineCore(
            EngineConfig(
                backend="mock",
                tokenizer="byte",
                kv_offload_bytes=1 << 20,
                enable_prefix_caching=False,
            )
        )


def test_bad_kv_link_options_are_named() -> None:
    with pytest.raises(ValueError, match=r"kv_link.*fault.*kind"):
        EngineCore(
            EngineConfig(
                backend="mock",
                tokenizer="byte",
                backend_options={"kv_link": {"fault": {"kind": "explode"}}},
            )
        )
