"""Async scheduling against synchronous scheduling on the mock, token for token.

The mock's tokens depend only on each request (its prompt, parameters and history), never on
the batch it ran in, so any workload must produce exactly the same outputs per request under
both modes: the same tokens (none emitted twice or skipped), finish reasons, logprobs and prompt
logprobs, whatever preemption, chunked prefill, prefix hits, priorities, aborts and grammars did
on the way. Aborts are tied to outputs ("after k tokens"), which both modes see alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core._core.engine_io import EngineCoreOutputs, EngineCoreRequest
from engine_core._engine.core import EngineCore
from engine_core.abc import AsyncModelRunnerOutput, ModelRunnerOutput
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams, StructuredOutputsParams

pytest.importorskip("llguidance")

EOS = 257


@dataclass
class Arrival:
    request: EngineCoreRequest
    at_step: int
    abort_after: int | None
    """Abort once the request has this many output tokens (None: never); at least one, so the
    prompt logprobs that come before it are the same in both modes."""


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish: tuple[str, Any, Any] | None = None
    logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs: list[Any] = field(default_factory=list)


PREFIXES = [list(b"shared prefix one"), list(b"another prefix"), []]


@st.composite
def arrivals(draw: st.DrawFn, index: int) -> Arrival:
    prefix = draw(st.sampled_from(PREFIXES))
    prompt = prefix + draw(st.lists(st.integers(0, 255), min_size=1, max_size=12))
    greedy = draw(st.booleans())
    params: dict[str, Any] = {
        "temperature": 0.0 if greedy else 0.8,
        "max_tokens": (max_tokens := draw(st.integers(1, 24))),
        "min_tokens": draw(st.integers(0, min(3, max_tokens))),
        "ignore_eos": draw(st.booleans()),
        "stop_token_ids": draw(st.lists(st.integers(0, 257), max_size=2)),
    }
    if not greedy:
        params["seed"] = draw(st.integers(0, 3))
    if draw(st.integers(0, 3)) == 0:
        params["logprobs"] = draw(st.integers(0, 3))
    if draw(st.integers(0, 5)) == 0:
        params["prompt_logprobs"] = draw(st.integers(0, 2))
    if draw(st.integers(0, 5)) == 0:
        choices = draw(st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3))
        params["structured_outputs"] = StructuredOutputsParams(choice=choices)
        # Stop tokens masked below min_tokens could mask every token the grammar allows.
        params["min_tokens"], params["stop_token_ids"] = 0, []
    request = EngineCoreRequest(
        f"r{index}",
        prompt,
        SamplingParams(**params),
        priority=draw(st.integers(0, 2)),
        eos_token_ids=[EOS],
    )
    abort_after = draw(st.one_of(st.none(), st.integers(1, 10)))
    return Arrival(request, draw(st.integers(0, 12)), abort_after)


WORKLOADS = st.integers(1, 10).flatmap(
    lambda n: st.tuples(*(arrivals(i) for i in range(n))).map(list)
)
CONFIGS = st.fixed_dictionaries(
    {
        "num_kv_blocks": st.integers(16, 40),  # few: preemption
        "max_num_batched_tokens": st.sampled_from([16, 24, 64]),  # chunked prefill
        "max_num_seqs": st.integers(2, 6),
        "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
        "enable_prefix_caching": st.booleans(),
        "long_prefill_token_threshold": st.sampled_from([0, 8]),
    }
)


def run_workload(
    config: dict[str, Any], workload: list[Arrival], *, async_scheduling: bool
) -> tuple[dict[str, Result], int]:
    """Step ``workload`` to its end; the results per request and the preemptions seen."""
    core = EngineCore(
        EngineConfig(
            backend="mock",
            tokenizer="byte",
            block_size=4,
            async_scheduling=async_scheduling,
            **{"max_model_len": 64, **config},
        )
    )
    assert core.async_scheduling is async_scheduling
    results = {a.request.request_id: Result() for a in workload}
    aborted: set[str] = set()
    try:
        step = 0
        pending = sorted(workload, key=lambda a: a.at_step)
        while pending or core.has_unfinished_requests():
            while pending and pending[0].at_step <= step:
                core.add_request(pending.pop(0).request)
            outputs = core.step()
            collect(outputs, results)
            for a in workload:
                rid = a.request.request_id
                if (
                    a.abort_after is not None
                    and rid not in aborted
                    and results[rid].finish is None
                    and len(results[rid].tokens) >= a.abort_after
                    and rid in core.scheduler.requests
                ):
                    aborted.add(rid)
                    core.abort_requests([rid])
                    results[rid].finish = ("abort", None, None)
            step += 1
            assert step < 2000, "the workload does not end"
        assert core.num_in_flight == 0
        kv = core.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks
        assert all(r.num_output_placeholders == 0 for r in core.scheduler.running)
        return results, core.scheduler.num_preemptions
    finally:
        core.close()


def collect(outputs: EngineCoreOutputs, results: dict[str, Result]) -> None:
    for rid, tokens in zip(outputs.req_ids, outputs.new_token_ids, strict=True):
        result = results[rid]
        assert result.finish is None, f"{rid} got tokens after it ended"
        result.tokens.extend(tokens)
        result.logprobs.extend(outputs.logprobs.get(rid, []))
    for rid, entries in outputs.prompt_logprobs.items():
        results[rid].prompt_logprobs.extend(entries)
    for finished in outputs.finished:
        result = results[finished.req_id]
        assert result.finish is None, f"{finished.req_id} ended twice"
        result.finish = (finished.finish_reason, finished.stop_reason, finished.error)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=CONFIGS, workload=WORKLOADS)
def test_async_scheduling_gives_the_outputs_of_synchronous_scheduling(
    config: dict[str, Any], workload: list[Arrival]
) -> None:
    sync, _ = run_workload(config, workload, async_scheduling=False)
    asynchronous, _ = run_workload(config, workload, async_scheduling=True)
    assert asynchronous == sync
    assert all(r.finish is not None for r in sync.values())


def test_a_request_preempted_with_a_token_in_flight_keeps_that_token() -> None:
    # Two requests grow past what 5 blocks of 4 hold: the later one is preempted while its
    # token of the step in flight is still unknown, and must resume with it.
    config = {"num_kv_blocks": 5, "max_model_len": 20, "max_num_seqs": 4}
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    workload = [
        Arrival(EngineCoreRequest(f"r{i}", [10 * i + 1, 10 * i + 2], params), 0, None)
        for i in range(2)
    ]
    sync, _ = run_workload(config, workload, async_scheduling=False)
    asynchronous, preemptions = run_workload(config, workload, async_scheduling=True)
    assert preemptions > 0
    assert asynchronous == sync
    assert sync["r0"].tokens == list(range(3, 12)) and sync["r1"].tokens == list(range(13, 22))


def test_none_turns_async_scheduling_on_where_the_backend_supports_it() -> None:
    latency = {"latency": {"step_s": 0.001}}
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte", backend_options=latency))
    try:
        assert core.async_scheduling and core.config.async_scheduling is True
    finally:
        core.close()
    # Without a latency model the mock's step is brief work holding the GIL: nothing to overlap.
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte"))
    try:
        assert not core.async_scheduling and core.config.async_scheduling is False
    finally:
        core.close()


def test_async_scheduling_true_fails_with_a_backend_that_lacks_it() -> None:
    from engine_core_mock import MockBackend

    class SyncOnly(MockBackend):
        supports_async_scheduling = False

    with pytest.raises(ValueError, match="async_scheduling=True but the SyncOnly backend"):
        EngineCore(
            EngineConfig(backend="mock", tokenizer="byte", async_scheduling=True),
            backend_cls=SyncOnly,
        )
    latency = {"latency": {"step_s": 0.001}}
    config = EngineConfig(backend="mock", tokenizer="byte", backend_options=latency)
    core = EngineCore(config, backend_cls=SyncOnly)
    try:
        assert not core.async_scheduling
    finally:
        core.close()


class _Unmeasured(AsyncModelRunnerOutput):
    """A handle that reports no device time."""

    def __init__(self, inner: AsyncModelRunnerOutput) -> None:
        self._inner = inner

    def get_output(self) -> ModelRunnerOutput:
        return self._inner.get_output()


def _three_steps(core: EngineCore) -> float:
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        core.add_request(EngineCoreRequest("r", [1, 2], params))
        while core.has_unfinished_requests():
            core.step()
        return core.get_stats().device_busy_s
    finally:
        core.close()


def test_device_busy_s_counts_the_time_a_step_is_in_flight() -> None:
    now = [0.0]
    for async_scheduling in (False, True):
        core = EngineCore(
            EngineConfig(backend="mock", tokenizer="byte", async_scheduling=async_scheduling),
            clock=lambda: now[0],
        )
        backend_execute = core.backend.execute_model

        def execute(output: Any, backend_execute: Any = backend_execute) -> None:
            now[0] += 1.0  # each launch takes a second of the fake clock
            backend_execute(output)

        core.backend.execute_model = execute  # type: ignore[method-assign]
        launch_sampling = core.backend.sample_tokens_async

        def unmeasured(bitmask: Any, launch_sampling: Any = launch_sampling) -> Any:
            return _Unmeasured(launch_sampling(bitmask))

        core.backend.sample_tokens_async = unmeasured  # type: ignore[method-assign]
        # Three steps: the synchronous core is busy for each launch; the asynchronous one,
        # whose handles report no device time here, from its first launch until the last
        # step's results arrived.
        assert _three_steps(core) == 3.0


def test_device_busy_s_sums_the_device_time_the_steps_report() -> None:
    # The mock reports each step's modelled duration: 3 steps of 2 ms, whatever the host did
    # around them (the fake clock would count 3 s of launches).
    now = [0.0]
    latency = {"latency": {"step_s": 0.002}}
    core = EngineCore(
        EngineConfig(backend="mock", tokenizer="byte", backend_options=latency),
        clock=lambda: now[0],
    )
    assert core.async_scheduling
    backend_execute = core.backend.execute_model

    def execute(output: Any) -> None:
        now[0] += 1.0
        backend_execute(output)

    core.backend.execute_model = execute  # type: ignore[method-assign]
    assert _three_steps(core) == pytest.approx(0.006)


def test_a_victim_scheduled_ahead_in_the_same_step_gives_back_its_placeholder() -> None:
    # Priority: "low" (admitted first) runs ahead of "high" in the batch; when "high" needs a
    # block that is not free, "low" is preempted after it was already scheduled in that step
    # (with the placeholder of the step in flight), and resumes with every token.
    config = {
        "num_kv_blocks": 6,
        "max_model_len": 24,
        "max_num_seqs": 4,
        "scheduling_policy": "priority",
        "enable_prefix_caching": False,
    }
    low = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    workload = [
        Arrival(EngineCoreRequest("low", [1, 2, 3], low, priority=2), 0, None),
        Arrival(EngineCoreRequest("high", [40, 41, 42, 43, 44], low, priority=0), 1, None),
    ]
    sync, _ = run_workload(config, workload, async_scheduling=False)
    asynchronous, preemptions = run_workload(config, workload, async_scheduling=True)
    assert preemptions > 0
    assert asynchronous == sync
    assert sync["low"].tokens == list(range(4, 18)) and sync["high"].tokens == list(range(45, 59))


def test_sleep_lets_a_step_in_flight_for_ended_requests_finish_first() -> None:
    latency = {"latency": {"step_s": 0.001}}
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte", backend_options=latency))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[6])
        core.add_request(EngineCoreRequest("r", [1, 2, 3], params))
        finished = []
        while not finished:
            finished = core.step().finished
        # "r" stopped on token 6 while its next step was already launched.
        assert core.num_in_flight == 1 and not core.scheduler.requests
        core.sleep()
        assert core.num_in_flight == 0 and core.backend.is_sleeping  # type: ignore[attr-defined]
        core.wake_up()
        core.add_request(EngineCoreRequest("r", [1, 2, 3], params))
        tokens = []
        while core.has_unfinished_requests():
            out = core.step()
            tokens += [t for ts in out.new_token_ids for t in ts]
        assert tokens == [4, 5, 6]
    finally:
        core.close()
