"""Speculative decoding at the engine's edges: which backends may speculate, and how."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from engine_core_mock import MockBackend
from helpers.spec_backend import ScriptedSpecBackend

from engine_core._core.engine_io import EngineCoreRequest
from engine_core._engine.core import EngineCore
from engine_core.abc import CachedRequestData, SpecSupport, StepCostModel
from engine_core.config import EngineConfig, SpeculativeConfig
from engine_core.sampling_params import SamplingParams, StructuredOutputsParams
from engine_core.testing import check_spec_decode

COST = StepCostModel(step_s=5e-3, per_token_s=5e-5)


def _verifier(support: SpecSupport) -> type[MockBackend]:
    class Verifier(MockBackend):
        def spec_support(self) -> SpecSupport | None:
            return support

    return Verifier


def _config(**spec: object) -> EngineConfig:
    latency = {"latency": {"step_s": 0.001}}  # the mock would schedule asynchronously
    return EngineConfig(
        backend="mock",
        tokenizer="byte",
        backend_options=latency,
        speculative_config=SpeculativeConfig(**spec),  # type: ignore[arg-type]
    )


def test_a_backend_that_cannot_verify_is_refused_by_name() -> None:
    class NoSpec(MockBackend):
        def spec_support(self) -> SpecSupport | None:
            return None

    with pytest.raises(ValueError, match=r"the 'mock' backend \(NoSpec\) cannot verify drafts"):
        EngineCore(_config(), backend_cls=NoSpec)


def test_speculation_schedules_synchronously() -> None:
    core = EngineCore(_config(), backend_cls=_verifier(SpecSupport()))
    try:
        assert core.spec_support == SpecSupport()
        assert not core.async_scheduling and core.config.async_scheduling is False
    finally:
        core.close()


def test_a_method_the_backend_does_not_propose_is_refused() -> None:
    with pytest.raises(ValueError, match="'draft_model' is not offered .* it offers: ngram, mock"):
        EngineCore(
            _config(method="draft_model", model="/models/d"),
            backend_cls=_verifier(SpecSupport(proposers=["mock"])),
        )
    core = EngineCore(
        _config(method="mock"), backend_cls=_verifier(SpecSupport(proposers=["mock"]))
    )
    core.close()


def test_more_drafts_than_the_backend_verifies_are_refused() -> None:
    with pytest.raises(ValueError, match=r"num_speculative_tokens \(5\) exceeds .* \(4\)"):
        EngineCore(
            _config(num_speculative_tokens=5),
            backend_cls=_verifier(SpecSupport(max_num_draft_tokens=4)),
        )


def test_a_backend_without_a_step_cost_gets_one_measured() -> None:
    class Unpriced(MockBackend):
        def spec_support(self) -> SpecSupport | None:
            return SpecSupport()

    ticks = iter(range(10**6))
    # Each clock reading moves 1 ms: every step measures the same few ms.
    core = EngineCore(_config(), backend_cls=Unpriced, clock=lambda: next(ticks) * 1e-3)
    try:
        spec = core.scheduler.draft_planner
        assert spec is not None and spec.measures_cost
        before = (spec.policy.cost.step_s, spec.policy.cost.per_token_s)
        core.add_request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=20)))
        while core.has_unfinished_requests():
            core.step()
        assert (spec.policy.cost.step_s, spec.policy.cost.per_token_s) != before
    finally:
        core.close()
    priced = EngineCore(_config(), backend_cls=_verifier(SpecSupport(cost_model=COST)))
    try:
        assert (
            priced.scheduler.draft_planner is not None
            and not priced.scheduler.draft_planner.measures_cost
        )
    finally:
        priced.close()


def test_lookahead_is_proportional_to_the_drafts_asked_for() -> None:
    assert SpecSupport().lookahead_tokens(4) == 0
    assert SpecSupport(lookahead_per_draft=1).lookahead_tokens(4) == 4
    assert SpecSupport(lookahead_per_draft=1).lookahead_tokens(0) == 0


def test_cached_request_data_drafts_column() -> None:
    class State:
        def __init__(self, computed: int) -> None:
            self.num_computed_tokens = computed

    states = {"a": State(5), "b": State(7)}
    plain = CachedRequestData(["a", "b"], [None, None], [5, 7], [1, 1])
    assert plain.drafts_of(0) == plain.drafts_of(1) == []
    drafted = CachedRequestData(["a", "b"], [None, [3]], [5, 7], [3, 1], [[10, 11], []])
    assert drafted.drafts_of(0) == [10, 11] and drafted.drafts_of(1) == []
    assert [num for *_, num in drafted.diffs(states)] == [3, 1]
    ragged = CachedRequestData(["a", "b"], [None, None], [5, 7], [3, 1], [[10, 11]])
    with pytest.raises(RuntimeError, match="spec_token_ids has a different length"):
        list(ragged.diffs(states))


# -- speculation on and off, token for token -------------------------------------------------------


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish: tuple[str, Any] | None = None
    logprobs: list[Any] = field(default_factory=list)


def run_workload(
    spec: dict[str, Any] | None,
    requests: list[EngineCoreRequest],
    *,
    abort_after: dict[str, int] | None = None,
    options: dict[str, Any] | None = None,
    **config: Any,
) -> tuple[dict[str, Result], EngineCore]:
    """Every request to its end (aborts once a request has that many tokens, and keeps only
    that many: a step of speculation may bring several); the results and the engine
    (closed)."""
    engine_config = EngineConfig(
        backend="scripted",
        tokenizer="byte",
        backend_options=options or {},
        speculative_config=spec,  # type: ignore[arg-type]
        **config,
    )
    core = EngineCore(engine_config, backend_cls=ScriptedSpecBackend)
    results: dict[str, Result] = {r.request_id: Result() for r in requests}
    try:
        for request in requests:
            core.add_request(request)
        for _ in range(5000):
            if not core.has_unfinished_requests():
                break
            out = core.step()
            for req_id, tokens in zip(out.req_ids, out.new_token_ids, strict=True):
                result = results[req_id]
                result.tokens += tokens
                result.logprobs += out.logprobs.get(req_id, [])
                limit = (abort_after or {}).get(req_id)
                if limit is not None and len(result.tokens) >= limit and result.finish is None:
                    core.abort_requests([req_id])
                    result.finish = ("abort", None)
                    del result.tokens[limit:], result.logprobs[limit:]
            for fin in out.finished:
                results[fin.req_id].finish = (fin.finish_reason, fin.stop_reason)
        assert not core.has_unfinished_requests()
        kv = core.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
    finally:
        core.close()
    return results, core


def workload(seeded: bool, *, long_prompts: bool = False) -> list[EngineCoreRequest]:
    text = list(b"the quick brown fox jumps over the lazy dog; ") * (6 if long_prompts else 2)
    requests = []
    for i in range(10):
        params: dict[str, Any] = {
            "temperature": 0.8 if seeded and i % 2 else 0.0,
            "seed": 100 + i if seeded and i % 2 else None,
            "max_tokens": 20 + 7 * i,
            "min_tokens": i % 3,
        }
        if i % 3 == 1:
            params["stop_token_ids"] = [ord("o"), 200 + i]
        if i % 4 == 2:
            params["logprobs"] = 1
        prompt = text[i : i + 30 + 9 * i]
        requests.append(
            EngineCoreRequest(
                f"r{i}", prompt, SamplingParams(**params), priority=i % 3, arrival_time=i
            )
        )
    return requests


SPECS = [
    pytest.param({"method": "ngram", "dynamic": False}, {"copy": True}, id="ngram-static"),
    pytest.param({"method": "ngram"}, {"copy": True}, id="ngram-dynamic"),
    pytest.param({"method": "scripted", "dynamic": False}, {}, id="drafter-static"),
    pytest.param({"method": "scripted", "num_speculative_tokens": 6}, {}, id="drafter-dynamic"),
]

SETUPS = [
    pytest.param({}, id="plain"),
    pytest.param({"max_num_batched_tokens": 48, "max_num_seqs": 4}, id="chunked"),
    pytest.param({"num_kv_blocks": 14, "block_size": 16}, id="preemption"),
    pytest.param({"enable_prefix_caching": False, "scheduling_policy": "priority"}, id="priority"),
    pytest.param({"long_prefill_token_threshold": 8}, id="threshold"),
]


@pytest.mark.parametrize(("spec", "options"), SPECS)
@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_speculation_gives_the_tokens_of_decoding_without_it(
    spec: dict[str, Any], options: dict[str, Any], setup: dict[str, Any], seeded: bool
) -> None:
    requests = workload(seeded, long_prompts="num_kv_blocks" in setup)
    aborts = {"r3": 9, "r8": 1}
    off, _ = run_workload(None, requests, abort_after=aborts, options=options, **setup)
    on, core = run_workload(spec, requests, abort_after=aborts, options=options, **setup)
    assert on == off
    stats = core.scheduler.draft_planner.stats  # type: ignore[union-attr]
    assert stats.num_accepted_tokens > 0
    if "num_kv_blocks" in setup:
        assert core.scheduler.num_preemptions > 0


def test_a_pinned_k_of_0_is_the_path_without_speculation() -> None:
    # A token costs 100 times a step's fixed part: a draft pays only if it is right 99 % of
    # the time, and the drafts of this model are not.
    options = {"cost": [1e-3, 1e-1]}
    requests = workload(False)

    def steps(spec: dict[str, Any] | None) -> list[Any]:
        engine_config = EngineConfig(
            backend="scripted", tokenizer="byte", backend_options=options, speculative_config=spec
        )
        core = EngineCore(engine_config, backend_cls=ScriptedSpecBackend)
        for request in requests:
            core.add_request(request)
        while core.has_unfinished_requests():
            core.step()
        core.close()
        backend = core.backend
        assert isinstance(backend, ScriptedSpecBackend)
        return backend.steps

    off = steps(None)
    assert steps({"method": "ngram"}) == off  # n-gram probes run in the core alone
    # A backend drafter is asked for probes' drafts: the steps differ only by those fields.
    probed = steps({"method": "scripted"})
    assert any(s.num_draft_tokens for s in probed)
    assert [msgspec.structs.replace(s, num_draft_tokens=0, draft_req_ids=None) for s in probed] == (
        off
    )


@pytest.mark.parametrize(("spec", "options"), SPECS[::2])
def test_structured_outputs_with_speculation_are_those_without(
    spec: dict[str, Any], options: dict[str, Any]
) -> None:
    pytest.importorskip("llguidance")
    requests = []
    for i, pattern in enumerate([r"[a-z ]{10,60}\.", r"(fox|dog|the|quick| )+!", r"[a-e]{30}"]):
        params = SamplingParams(
            temperature=0.0 if i % 2 == 0 else 0.8,
            seed=i,
            max_tokens=50,
            structured_outputs=StructuredOutputsParams(regex=pattern),
        )
        prompt = list(b"the quick brown fox jumps over the lazy dog the quick brown fox ")
        requests.append(EngineCoreRequest(f"g{i}", prompt[i:], params))
    requests += workload(False)[:3]
    off, _ = run_workload(None, requests, options=options)
    on, core = run_workload(spec, requests, options=options)
    assert on == off
    assert all(off[f"g{i}"].finish is not None for i in range(3))
    backend = core.backend
    assert isinstance(backend, ScriptedSpecBackend)
    assert core.scheduler.draft_planner is not None
    assert core.scheduler.draft_planner.stats.num_accepted_tokens > 0
    if spec["method"] == "ngram":
        # Some step had more grammar rows than constrained requests: the prompt's n-grams
        # fit the grammars, so constrained requests verified drafts. (The scripted drafter's
        # drafts ignore the grammars: truncated to none, they leave one row each.)
        assert max(backend.bitmask_rows) > 3


# -- the conformance check -------------------------------------------------------------------------


def test_a_verifying_backend_passes_check_spec_decode() -> None:
    check_spec_decode(ScriptedSpecBackend)


def test_check_spec_decode_passes_a_backend_that_cannot_verify() -> None:
    check_spec_decode(ScriptedSpecBackend, EngineConfig(backend_options={"spec": False}))


class AcceptsEverything(ScriptedSpecBackend):
    """Accepts every draft, right or wrong (then samples after them)."""

    def sample_tokens(self, grammar_bitmask: Any | None) -> Any:
        out = super().sample_tokens(grammar_bitmask)
        cached = self.last.cached  # type: ignore[union-attr]
        for i in range(len(cached.req_ids)):
            drafts = cached.drafts_of(i)
            if drafts:
                state = self.states[cached.req_ids[i]]
                kept = out.sampled_token_ids[i]
                sequence = state.tokens[: len(state.tokens) - len(kept)] + drafts
                tokens = drafts + [self.next_token(state, sequence)]
                state.tokens = sequence + tokens[-1:]
                state.num_computed_tokens = len(state.tokens) - 1
                out.sampled_token_ids[i] = tokens
        return out


class ForgetsToRollBack(ScriptedSpecBackend):
    """Counts rejected drafts as computed."""

    def sample_tokens(self, grammar_bitmask: Any | None) -> Any:
        out = super().sample_tokens(grammar_bitmask)
        cached = self.last.cached  # type: ignore[union-attr]
        for i, req_id in enumerate(cached.req_ids):
            state = self.states.get(req_id)
            if state is not None and cached.drafts_of(i):
                state.num_computed_tokens = (
                    cached.num_computed_tokens[i] + cached.num_scheduled_tokens[i]
                )
        return out


class OneTokenTooMany(ScriptedSpecBackend):
    """Returns a token more than a verifier can for requests with drafts."""

    def sample_tokens(self, grammar_bitmask: Any | None) -> Any:
        out = super().sample_tokens(grammar_bitmask)
        cached = self.last.cached  # type: ignore[union-attr]
        for i in range(len(cached.req_ids)):
            if cached.drafts_of(i):
                out.sampled_token_ids[i] = [*cached.drafts_of(i), 1, 2]
        return out


def test_check_spec_decode_catches_a_wrong_draft_accepted() -> None:
    with pytest.raises(AssertionError, match="drafts all wrong, request 'a': got tokens"):
        check_spec_decode(AcceptsEverything)


def test_check_spec_decode_catches_what_no_verifier_returns() -> None:
    with pytest.raises(AssertionError, match=r"returned \d+ tokens for \d+ drafts"):
        check_spec_decode(OneTokenTooMany)


def test_check_spec_decode_catches_a_missing_rollback() -> None:
    with pytest.raises(RuntimeError, match="the scheduler says .* tokens are computed"):
        check_spec_decode(ForgetsToRollBack)
