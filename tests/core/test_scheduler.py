"""The scheduler: batching under a token budget, admission, preemption, stops, aborts, leaks.

vLLM's scheduler scenarios adapted to a pool without a null block (all blocks usable, ids from 0).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from helpers import every_field
from helpers.core import BLOCK_SIZE, make_scheduler
from helpers.core import make_request as _make_request

from engine_core._core.engine_io import EngineCoreOutputs, FinishedRequest
from engine_core._core.request import InvalidTransition, Request, RequestStatus
from engine_core._core.scheduler import Scheduler, SchedulerConfig
from engine_core._core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core.abc import ModelRunnerOutput, TokenLogprobs
from engine_core.config import EngineConfig
from engine_core.sampling_params import StructuredOutputsParams

EOS = 2
make_request = functools.partial(_make_request, eos_token_ids=(EOS,))


def add(scheduler: Scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)


def one_token_each(token: int = 7) -> Callable[[Request], list[int]]:
    """Sample ``token`` for every request whose prompt is complete after the step."""

    def sample(request: Request) -> list[int]:
        return [token] if request.num_computed_tokens >= request.num_tokens else []

    return sample


def runner_output(
    scheduler: Scheduler,
    output: SchedulerOutput,
    sample: Callable[[Request], list[int]] | dict[str, list[int]] | None = None,
) -> ModelRunnerOutput:
    """What a backend would return for ``output``: by default one token per request whose prompt
    is complete, else the given tokens per request id ([] for ids not given)."""
    sampled = []
    for request_id in output.req_ids:
        if isinstance(sample, dict):
            sampled.append(list(sample.get(request_id, [])))
        else:
            request = scheduler.requests.get(request_id)
            fn = sample or one_token_each()
            sampled.append(fn(request) if request is not None else [])
    return ModelRunnerOutput(output.req_ids, sampled)


def step(
    scheduler: Scheduler,
    sample: Callable[[Request], list[int]] | dict[str, list[int]] | None = None,
) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    output = scheduler.schedule()
    return output, scheduler.update_from_output(output, runner_output(scheduler, output, sample))


def num_scheduled(output: SchedulerOutput) -> dict[str, int]:
    counts = dict(zip(output.cached.req_ids, output.cached.num_scheduled_tokens, strict=True))
    counts.update((r.req_id, r.num_scheduled_tokens) for r in output.new_reqs)
    return counts


def assert_no_leak(scheduler: Scheduler) -> None:
    pool = scheduler.kv.pool
    assert scheduler.kv.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def running_ids(scheduler: Scheduler) -> list[str]:
    return [r.request_id for r in scheduler.running]


def waiting_ids(scheduler: Scheduler) -> list[str]:
    return [r.request_id for r in scheduler.waiting]


# -- batching -------------------------------------------------------------------------------------


def test_all_small_requests_in_one_step() -> None:
    """vLLM S11."""
    scheduler = make_scheduler()
    requests = [make_request(str(i), num_tokens=10) for i in range(10)]
    add(scheduler, *requests)
    output = scheduler.schedule()
    assert [r.req_id for r in output.new_reqs] == [str(i) for i in range(10)]
    assert all(r.num_scheduled_tokens == 10 for r in output.new_reqs)
    assert all(r.num_computed_tokens == 0 for r in output.new_reqs)
    assert output.cached.req_ids == []
    assert output.total_num_scheduled_tokens == 100
    assert output.finished_req_ids == []
    assert output.preempted_req_ids == []
    assert scheduler.num_waiting == 0
    assert running_ids(scheduler) == [str(i) for i in range(10)]
    assert all(r.num_computed_tokens == 10 for r in requests)
    assert all(r.status is RequestStatus.RUNNING for r in requests)


def test_new_then_cached_request_data() -> None:
    scheduler = make_scheduler()
    request = make_request("a", num_tokens=20, temperature=0.0)
    add(scheduler, request)
    output, _ = step(scheduler)
    (new,) = output.new_reqs
    assert new.req_id == "a"
    assert new.prompt_token_ids == request.prompt_token_ids
    assert new.sampling_params == request.sampling_params
    assert new.block_ids == [0, 1]
    assert new.num_computed_tokens == 0
    assert new.num_scheduled_tokens == 20
    assert new.output_token_ids == []
    assert new.eos_token_ids == [EOS]
    assert request.output_token_ids == [7]
    # Decode steps: one token each; the blocks 0 and 1 hold positions up to 31.
    for computed in range(20, 32):
        output, _ = step(scheduler)
        assert output.new_reqs == []
        assert output.cached.req_ids == ["a"]
        assert output.cached.num_computed_tokens == [computed]
        assert output.cached.num_scheduled_tokens == [1]
        assert output.cached.new_block_ids == [None]
    # Position 32 needs block 2.
    output, _ = step(scheduler)
    assert output.cached.num_computed_tokens == [32]
    assert output.cached.new_block_ids == [[2]]
    assert request.block_ids == [0, 1, 2]
    assert request.num_computed_tokens == 33


def test_long_prefill_threshold() -> None:
    """vLLM S12: budget 1024, threshold 400, three 800-token prompts."""
    scheduler = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    add(scheduler, *(make_request(str(i), num_tokens=800) for i in range(3)))
    output, outputs = step(scheduler)
    assert num_scheduled(output) == {"0": 400, "1": 400, "2": 224}
    assert [r.req_id for r in output.new_reqs] == ["0", "1", "2"]
    assert outputs.req_ids == []  # partial prefills produce nothing
    output, outputs = step(scheduler)
    assert output.new_reqs == []
    assert output.cached.req_ids == ["0", "1", "2"]
    assert output.cached.num_scheduled_tokens == [400, 400, 224]
    assert output.cached.num_computed_tokens == [400, 400, 224]
    assert outputs.req_ids == ["0", "1"]
    output, _ = step(scheduler)
    assert num_scheduled(output) == {"0": 1, "1": 1, "2": 352}
    assert output.total_num_scheduled_tokens == 354


@pytest.mark.parametrize("chunked", [True, False])
def test_chunked_prefill_order(chunked: bool) -> None:
    """vLLM S13: budget 1024, max_num_seqs 3; two 800-token then two 10-token requests."""
    scheduler = make_scheduler(
        max_num_batched_tokens=1024, max_num_seqs=3, enable_chunked_prefill=chunked
    )
    add(scheduler, *(make_request(f"long{i}", num_tokens=800) for i in range(2)))
    add(scheduler, *(make_request(f"short{i}", num_tokens=10) for i in range(2)))
    output = scheduler.schedule()
    if chunked:
        assert num_scheduled(output) == {"long0": 800, "long1": 224}
    else:
        # long1 does not fit the rest of the budget and stops the scan: no short request
        # overtakes it.
        assert num_scheduled(output) == {"long0": 800}
        assert waiting_ids(scheduler) == ["long1", "short0", "short1"]


def test_admission_needs_the_whole_prompt_in_free_blocks() -> None:
    # max_bypass_steps=0: nobody overtakes a request whose blocks are not free.
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=96, max_bypass_steps=0)
    holder = make_request("holder", num_tokens=64, max_tokens=1)  # 4 blocks
    big = make_request("big", num_tokens=80)  # 5 blocks; a first chunk of 32 tokens would fit in 2
    small = make_request("small", num_tokens=10)
    add(scheduler, holder, big, small)
    output, outputs = step(scheduler)
    assert num_scheduled(output) == {"holder": 64}
    assert waiting_ids(scheduler) == ["big", "small"]
    assert [f.req_id for f in outputs.finished] == ["holder"]
    output, _ = step(scheduler)
    assert num_scheduled(output) == {"big": 80, "small": 10}
    assert output.finished_req_ids == ["holder"]


def test_max_num_seqs_caps_running() -> None:
    scheduler = make_scheduler(max_num_seqs=3)
    add(scheduler, *(make_request(str(i), num_tokens=10) for i in range(5)))
    output, _ = step(scheduler)
    assert [r.req_id for r in output.new_reqs] == ["0", "1", "2"]
    assert scheduler.num_running == 3
    assert scheduler.num_waiting == 2
    output, _ = step(scheduler)
    assert output.new_reqs == []
    assert output.cached.req_ids == ["0", "1", "2"]


def test_prefix_hits_at_admission_and_statistics() -> None:
    scheduler = make_scheduler()
    shared = list(range(100, 148))
    first = make_request("a", prompt=shared + [1, 2])
    add(scheduler, first)
    output, outputs = step(scheduler)
    assert output.new_reqs[0].num_computed_tokens == 0
    assert outputs.num_cached_tokens == {"a": 0}
    second = make_request("b", prompt=shared + [3])
    add(scheduler, second)
    output, outputs = step(scheduler)
    (new,) = output.new_reqs
    assert new.num_computed_tokens == 48
    assert new.num_scheduled_tokens == 1
    assert new.block_ids[:3] == first.block_ids[:3]
    assert outputs.num_cached_tokens == {"b": 48}
    assert second.num_cached_tokens == 48
    stats = scheduler.kv.stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 50 + 49, 48)
    assert stats.hit_rate == 48 / 99


@pytest.mark.parametrize("hash_blocks", [False, True])
def test_prefix_caching_off_no_hits(hash_blocks: bool) -> None:
    scheduler = make_scheduler(enable_prefix_caching=False)
    shared = list(range(100, 148))
    add(scheduler, make_request("a", prompt=shared + [1], hash_blocks=hash_blocks))
    step(scheduler)
    add(scheduler, make_request("b", prompt=shared + [2], hash_blocks=hash_blocks))
    output, _ = step(scheduler)
    assert output.new_reqs[0].num_computed_tokens == 0
    assert output.new_reqs[0].num_scheduled_tokens == 49
    assert scheduler.kv.stats.hits == 0
    assert scheduler.kv.pool.cached == {}


# -- configuration ---------------------------------------------------------------------------------


def test_scheduler_config_from_engine_config_copies_every_knob() -> None:
    engine_config = every_field.instance(EngineConfig)  # resolved
    config = SchedulerConfig.from_engine_config(engine_config)
    copied = {name: getattr(config, name) for name in SchedulerConfig.__slots__}
    assert copied == {name: getattr(engine_config, name) for name in SchedulerConfig.__slots__}
    # Every knob differs from its default, so none was left at it.
    defaults = SchedulerConfig()
    assert all(copied[name] != getattr(defaults, name) for name in SchedulerConfig.__slots__)


def test_scheduler_config_needs_a_resolved_engine_config() -> None:
    message = (
        "the EngineConfig is not resolved: max_model_len and max_num_batched_tokens must be "
        "set (EngineConfig.resolved() sets them)"
    )
    resolved = EngineConfig().resolved(model_max_len=None)
    for unresolved in (
        EngineConfig(),
        msgspec.structs.replace(resolved, max_model_len=None),
        msgspec.structs.replace(resolved, max_num_batched_tokens=None),
    ):
        with pytest.raises(ValueError) as info:
            SchedulerConfig.from_engine_config(unresolved)
        assert str(info.value) == message
    config = SchedulerConfig.from_engine_config(resolved)
    assert (config.max_model_len, config.max_num_batched_tokens) == (
        resolved.max_model_len,
        resolved.max_num_batched_tokens,
    )


# -- priority ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "priorities,arrivals,expected",
    [
        ([2, 0, 1], [1, 2, 3], ["1", "2", "0"]),
        ([0, 0, 0], [3, 1, 2], ["1", "2", "0"]),
        ([2, 1, 1, 0], [1, 3, 2, 4], ["3", "2", "1", "0"]),
    ],
)
def test_priority_scheduling_order(
    priorities: list[int], arrivals: list[int], expected: list[str]
) -> None:
    """vLLM S17 orders."""
    scheduler = make_scheduler(scheduling_policy="priority")
    for i, (p, t) in enumerate(zip(priorities, arrivals, strict=True)):
        add(scheduler, make_request(str(i), num_tokens=10, priority=p, arrival_time=float(t)))
    output = scheduler.schedule()
    assert [r.req_id for r in output.new_reqs] == expected
    assert running_ids(scheduler) == expected


def test_priority_admission_respects_max_num_seqs() -> None:
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=2)
    for i, p in enumerate([3, 1, 2, 0]):
        add(scheduler, make_request(str(i), num_tokens=10, priority=p, arrival_time=float(i)))
    output = scheduler.schedule()
    assert [r.req_id for r in output.new_reqs] == ["3", "1"]
    assert waiting_ids(scheduler) == ["2", "0"]


# -- preemption -------------------------------------------------------------------------------------


def test_fcfs_preempts_the_latest_admitted() -> None:
    # max_bypass_steps=0: d may not overtake c below (tests/core/test_pressure.py: it may).
    scheduler = make_scheduler(
        num_blocks=7,
        enable_prefix_caching=False,
        max_bypass_steps=0,
        preemption_victim="last_admitted",
    )
    a = make_request("a", num_tokens=32, max_tokens=3, hash_blocks=False)  # 2 blocks
    b = make_request("b", num_tokens=32, max_tokens=3, hash_blocks=False)  # 2 blocks
    c = make_request("c", num_tokens=48, hash_blocks=False)  # 3 blocks
    add(scheduler, a, b, c)
    output, _ = step(scheduler)
    assert [r.block_ids for r in output.new_reqs] == [[0, 1], [2, 3], [4, 5, 6]]
    assert scheduler.kv.num_free_blocks == 0
    d = make_request("d", num_tokens=10, hash_blocks=False)  # 1 block
    add(scheduler, d)

    # a needs a third block: c (admitted last) is preempted, a and b take two of its blocks.
    output, _ = step(scheduler)
    assert output.cached.req_ids == ["a", "b"]
    assert output.cached.new_block_ids == [[4], [5]]
    assert output.preempted_req_ids == ["c"]
    # One block is free and d would fit, but nothing is admitted in a step that preempted.
    assert output.new_reqs == []
    assert scheduler.kv.num_free_blocks == 1
    assert c.status is RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.blocks == []
    assert c.num_preemptions == 1
    assert scheduler.num_preemptions == 1
    assert running_ids(scheduler) == ["a", "b"]
    assert waiting_ids(scheduler) == ["c", "d"]  # the preempted request is first again
    assert c.output_token_ids == [7]

    # c does not fit yet and d may not overtake it.
    output, outputs = step(scheduler)
    assert output.preempted_req_ids == []
    assert output.new_reqs == []
    assert sorted(f.req_id for f in outputs.finished) == ["a", "b"]

    # c resumes in full with its output so far and recomputes everything (caching is off).
    output, _ = step(scheduler)
    assert [r.req_id for r in output.new_reqs] == ["c", "d"]
    resumed = output.new_reqs[0]
    assert resumed.prompt_token_ids == c.prompt_token_ids
    assert resumed.output_token_ids == [7]
    assert resumed.num_computed_tokens == 0
    assert resumed.num_scheduled_tokens == 49
    assert len(resumed.block_ids) == 4
    assert output.finished_req_ids == ["a", "b"]
    assert c.num_cached_tokens == 0


def decode_two_in_four_blocks(a_tokens: int) -> tuple[Scheduler, Request, SchedulerOutput]:
    """Request a (``a_tokens`` tokens) and b (32 tokens) fill a pool of four blocks (no prefix
    caching) in their first step; the scheduler, a, and the second step's output."""
    scheduler = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    a = make_request("a", num_tokens=a_tokens, hash_blocks=False)
    add(scheduler, a, make_request("b", num_tokens=32, hash_blocks=False))
    step(scheduler)
    output, _ = step(scheduler)
    return scheduler, a, output


def test_last_request_preempts_itself_when_nothing_fits() -> None:
    # a's next token fits its two blocks; b needs a third, none is free and b itself is the
    # latest admitted: b is preempted, a is not touched.
    scheduler, a, output = decode_two_in_four_blocks(a_tokens=31)
    assert output.cached.req_ids == ["a"]
    assert output.cached.new_block_ids == [None]
    assert output.preempted_req_ids == ["b"]
    assert a.block_ids == [0, 1]
    assert scheduler.kv.num_free_blocks == 2
    assert waiting_ids(scheduler) == ["b"]


def test_preemption_frees_blocks_for_the_request_in_need() -> None:
    # Both need a third block and none is free: a preempts b and takes b's first block.
    _, a, output = decode_two_in_four_blocks(a_tokens=32)
    assert output.cached.req_ids == ["a"]
    assert output.cached.new_block_ids == [[2]]
    assert output.preempted_req_ids == ["b"]
    assert a.block_ids == [0, 1, 2]


def test_priority_preempts_the_worst_priority() -> None:
    """vLLM S17 under block pressure: 5 blocks, 32-token prompts."""
    scheduler = make_scheduler(
        num_blocks=5, scheduling_policy="priority", enable_prefix_caching=False
    )
    lo = make_request("lo1", num_tokens=32, priority=5, arrival_time=1.0, hash_blocks=False)
    add(scheduler, lo)
    step(scheduler)
    hi = make_request("hi1", num_tokens=32, priority=0, arrival_time=2.0, hash_blocks=False)
    add(scheduler, hi)
    output, _ = step(scheduler)
    assert num_scheduled(output) == {"lo1": 1, "hi1": 32}
    assert scheduler.kv.num_free_blocks == 0
    # hi1 needs a third block: lo1 (scheduled earlier in the same step) is preempted and its
    # token goes back to the budget.
    output, _ = step(scheduler)
    assert num_scheduled(output) == {"hi1": 1}
    assert output.total_num_scheduled_tokens == 1
    assert output.preempted_req_ids == ["lo1"]
    assert lo.status is RequestStatus.PREEMPTED
    assert running_ids(scheduler) == ["hi1"]
    # Without cached prefixes lo1's blocks are all reused first, head first.
    assert hi.block_ids == [3, 4, 0]
    assert scheduler.kv.pool.free_queue.block_ids() == [1, 2]


def _three_running(policy: str) -> tuple[Scheduler, Request, Request, Request]:
    """Running in admission order [y, x, z]; x arrived first but was admitted after y."""
    scheduler = make_scheduler(
        num_blocks=8,
        scheduling_policy=policy,
        enable_prefix_caching=False,
        preemption_victim="last_admitted",
    )
    y = make_request("y", num_tokens=32, priority=1, arrival_time=2.0, hash_blocks=False)
    x = make_request("x", num_tokens=32, priority=1, arrival_time=1.0, hash_blocks=False)
    z = make_request("z", num_tokens=32, priority=0, arrival_time=3.0, hash_blocks=False)
    add(scheduler, y)
    step(scheduler)
    add(scheduler, x)
    step(scheduler)
    add(scheduler, z)
    step(scheduler)
    assert running_ids(scheduler) == ["y", "x", "z"]
    assert scheduler.kv.num_free_blocks == 0
    return scheduler, y, x, z


def test_priority_victim_is_worst_priority_then_latest_arrival() -> None:
    scheduler, y, x, z = _three_running("priority")
    # z needs a third block. Of the worst priority (1), y arrived last: it is preempted even
    # though it was admitted first and already scheduled in this step.
    output, _ = step(scheduler)
    assert output.cached.req_ids == ["x", "z"]
    assert output.cached.num_scheduled_tokens == [1, 1]
    assert output.total_num_scheduled_tokens == 2
    assert output.preempted_req_ids == ["y"]
    assert running_ids(scheduler) == ["x", "z"]
    assert y.status is RequestStatus.PREEMPTED
    assert z.block_ids == [6, 7, 0]
    assert x.block_ids == [3, 4, 5]


def test_fcfs_victim_on_the_same_layout_is_the_last_admitted() -> None:
    scheduler, y, x, z = _three_running("fcfs")
    output, _ = step(scheduler)
    assert output.cached.req_ids == ["y", "x"]
    assert output.preempted_req_ids == ["z"]
    assert z.status is RequestStatus.PREEMPTED
    assert waiting_ids(scheduler) == ["z"]


def test_preempted_scheduled_request_leaves_no_uncomputed_block_in_the_cache() -> None:
    """A request preempted after it was scheduled in the same step never computes that step's
    tokens; blocks it had registered for them must not serve later prefix hits."""
    scheduler = make_scheduler(
        num_blocks=5, scheduling_policy="priority", long_prefill_token_threshold=20
    )
    prompt = list(range(100, 156))  # 56 tokens
    low = make_request("low", prompt=prompt, priority=1, arrival_time=1.0)
    add(scheduler, low)
    output, _ = step(scheduler)
    assert num_scheduled(output) == {"low": 20}
    high = make_request("high", num_tokens=16, priority=0, arrival_time=2.0, max_tokens=2)
    add(scheduler, high)
    output, _ = step(scheduler)
    assert num_scheduled(output) == {"low": 20, "high": 16}
    assert low.num_computed_tokens == 40  # blocks 0 and 1 are fully computed, block 2 is not
    # low is scheduled 40 -> 56, registering block 2 (tokens 32..47), then preempted for high.
    output, outputs = step(scheduler)
    assert output.preempted_req_ids == ["low"]
    assert num_scheduled(output) == {"high": 1}
    assert [f.req_id for f in outputs.finished] == ["high"]
    output, _ = step(scheduler)
    (resumed,) = output.new_reqs
    assert resumed.req_id == "low"
    assert resumed.num_computed_tokens == 32
    assert resumed.num_scheduled_tokens == 20


# -- stop conditions ------------------------------------------------------------------------------


def test_eos_stops_with_no_stop_reason() -> None:
    scheduler = make_scheduler()
    a = make_request("a", num_tokens=10)
    b = make_request("b", num_tokens=10)
    add(scheduler, a, b)
    _, outputs = step(scheduler, {"a": [EOS], "b": [10, 11]})
    assert outputs.req_ids == ["a", "b"]
    assert outputs.new_token_ids == [[EOS], [10, 11]]
    assert outputs.finished == [FinishedRequest("a", "stop", None)]
    assert a.status is RequestStatus.FINISHED_STOPPED
    assert a.output_token_ids == [EOS]
    assert a.blocks == []
    assert b.status is RequestStatus.RUNNING
    assert running_ids(scheduler) == ["b"]
    assert "a" not in scheduler.requests
    output = scheduler.schedule()
    assert output.finished_req_ids == ["a"]
    assert num_scheduled(output) == {"b": 2}


def test_ignore_eos_keeps_running() -> None:
    scheduler = make_scheduler()
    request = make_request("a", num_tokens=10, ignore_eos=True)
    add(scheduler, request)
    _, outputs = step(scheduler, {"a": [EOS, 10, 11]})
    assert outputs.finished == []
    assert outputs.new_token_ids == [[EOS, 10, 11]]
    assert request.status is RequestStatus.RUNNING
    assert request.output_token_ids == [EOS, 10, 11]


def test_stop_token_trims_the_rest() -> None:
    scheduler = make_scheduler()
    request = make_request("a", num_tokens=10, stop_token_ids=[42, 43])
    add(scheduler, request)
    _, outputs = step(scheduler, {"a": [10, 42, 12]})
    assert outputs.new_token_ids == [[10, 42]]
    assert outputs.finished == [FinishedRequest("a", "stop", 42)]
    assert request.output_token_ids == [10, 42]
    assert request.stop_reason == 42


def test_max_tokens_trims_the_rest() -> None:
    scheduler = make_scheduler()
    request = make_request("a", num_tokens=10, max_tokens=2)
    add(scheduler, request)
    _, outputs = step(scheduler, {"a": [10, 11, 12]})
    assert outputs.new_token_ids == [[10, 11]]
    assert outputs.finished == [FinishedRequest("a", "length", None)]
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_logprobs_are_trimmed_with_the_tokens() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", num_tokens=10, max_tokens=2, logprobs=1))
    output = scheduler.schedule()
    entries = [TokenLogprobs([t], [-0.5 * t], [1]) for t in (10, 11, 12)]
    result = scheduler.update_from_output(
        output, ModelRunnerOutput(["a"], [[10, 11, 12]], logprobs=[entries])
    )
    assert result.logprobs == {"a": entries[:2]}


def test_max_model_len_caps_length() -> None:
    scheduler = make_scheduler(max_model_len=40)
    request = make_request("a", num_tokens=38, max_tokens=100)
    add(scheduler, request)
    _, outputs = step(scheduler)
    assert outputs.finished == []
    _, outputs = step(scheduler)
    assert outputs.finished == [FinishedRequest("a", "length", None)]
    assert request.num_tokens == 40
    assert request.output_token_ids == [7, 7]


def test_stop_tokens_wait_for_min_tokens() -> None:
    """A stop token (EOS included) ends a request only once ``min_tokens`` tokens precede it."""
    scheduler = make_scheduler()
    stop = make_request("stop", num_tokens=10, min_tokens=2, stop_token_ids=[42])
    eos = make_request("eos", num_tokens=10, min_tokens=2)
    add(scheduler, stop, eos)
    _, outputs = step(scheduler, {"stop": [42], "eos": [EOS]})
    assert outputs.finished == []
    _, outputs = step(scheduler, {"stop": [42], "eos": [EOS]})
    assert outputs.finished == []
    _, outputs = step(scheduler, {"stop": [42], "eos": [EOS]})
    assert outputs.finished == [
        FinishedRequest("stop", "stop", 42),
        FinishedRequest("eos", "stop", None),
    ]
    assert stop.output_token_ids == [42, 42, 42]
    assert eos.output_token_ids == [EOS, EOS, EOS]


def test_min_tokens_within_one_multi_token_output() -> None:
    scheduler = make_scheduler()
    request = make_request("a", num_tokens=10, min_tokens=1, stop_token_ids=[42])
    add(scheduler, request)
    _, outputs = step(scheduler, {"a": [42, 42, 5]})
    assert outputs.new_token_ids == [[42, 42]]
    assert outputs.finished == [FinishedRequest("a", "stop", 42)]


# -- stop rules of constrained requests --------------------------------------------------------


class FakeGrammar:
    """A :class:`GrammarMatcher` that accepts any token but ``reject``; complete (only EOS
    allowed) after ``complete_after`` tokens, terminated once it accepts an EOS then."""

    def __init__(
        self, *, complete_after: int | None = None, reject: frozenset[int] = frozenset()
    ) -> None:
        self.eos_token_ids = frozenset({EOS})
        self.terminated = False
        self.complete_after = complete_after
        self.reject = reject
        self.num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        if token_id in self.reject:
            return False
        if self.is_stopped() and token_id in self.eos_token_ids:
            self.terminated = True
        self.num_accepted += 1
        return True

    def is_stopped(self) -> bool:
        return self.complete_after is not None and self.num_accepted >= self.complete_after


def make_constrained(request_id: str, grammar: FakeGrammar, **params: Any) -> Request:
    request = make_request(
        request_id,
        num_tokens=10,
        structured_outputs=StructuredOutputsParams(choice=["x"]),
        **params,
    )
    request.grammar = grammar
    request.set_status(RequestStatus.WAITING)
    return request


@pytest.mark.parametrize(
    ("tokens", "params"),
    [
        ([10, EOS, 11], {}),
        ([10, EOS, 11], {"ignore_eos": True}),
        ([EOS, EOS, 11], {"min_tokens": 1}),
        ([10, 42, 11], {"stop_token_ids": [42]}),
        ([42, 42, 11], {"stop_token_ids": [42], "min_tokens": 1}),
        ([10, 11, 12, 13], {"max_tokens": 2}),
        ([10, 11, EOS], {"max_tokens": 2}),
        ([10, EOS, 11], {"max_tokens": 2}),
        ([10, 11, 12, 13], {"max_tokens": 100}),
    ],
)
def test_a_constrained_request_stops_like_a_plain_one(
    tokens: list[int], params: dict[str, Any]
) -> None:
    """With a grammar that allows everything and never completes, the stop rules (stop tokens,
    min_tokens, max_tokens, max_model_len) are those of a plain request."""
    scheduler = make_scheduler(max_model_len=13)
    plain = make_request("plain", num_tokens=10, **params)
    constrained = make_constrained("constrained", FakeGrammar(), **params)
    add(scheduler, plain, constrained)
    _, outputs = step(scheduler, {"plain": tokens, "constrained": tokens})
    assert outputs.new_token_ids[0] == outputs.new_token_ids[1]
    assert len(outputs.finished) in (0, 2)
    for finished in outputs.finished[1:]:
        assert msgspec.structs.replace(finished, req_id="plain") == outputs.finished[0]
    assert constrained.status is plain.status
    assert constrained.stop_reason == plain.stop_reason
    assert constrained.output_token_ids == plain.output_token_ids


def test_grammar_termination_beats_the_length_cap_on_the_same_token() -> None:
    scheduler = make_scheduler()
    request = make_constrained("a", FakeGrammar(complete_after=2), max_tokens=3, ignore_eos=True)
    add(scheduler, request)
    _, outputs = step(scheduler, {"a": [10, 11, EOS, 12]})
    assert outputs.new_token_ids == [[10, 11, EOS]]
    assert outputs.finished == [FinishedRequest("a", "stop", None)]
    assert scheduler.num_constrained == 0
    assert request.grammar is None


def test_a_stop_token_that_terminates_the_grammar_is_the_stop_reason() -> None:
    scheduler = make_scheduler()
    grammar = FakeGrammar(complete_after=1)
    grammar.eos_token_ids = frozenset({EOS, 42})
    request = make_constrained("a", grammar, stop_token_ids=[42])
    add(scheduler, request)
    _, outputs = step(scheduler, {"a": [10, 42, 11]})
    assert outputs.new_token_ids == [[10, 42]]
    assert outputs.finished == [FinishedRequest("a", "stop", 42)]


def test_a_token_the_grammar_rejects_is_dropped_and_ends_the_request() -> None:
    scheduler = make_scheduler()
    request = make_constrained("a", FakeGrammar(reject=frozenset({13})))
    add(scheduler, request)
    _, outputs = step(scheduler, {"a": [10, 13, 11]})
    assert outputs.new_token_ids == [[10]]
    assert request.status is RequestStatus.FINISHED_ERROR
    assert outputs.finished == [FinishedRequest("a", "error", None, request.error)]
    assert request.error is not None and "token 13" in request.error


def test_a_grammar_complete_before_min_tokens_ends_the_request() -> None:
    scheduler = make_scheduler()
    request = make_constrained("a", FakeGrammar(complete_after=2), min_tokens=4)
    add(scheduler, request)
    _, outputs = step(scheduler, {"a": [10, 11, 12]})
    assert outputs.new_token_ids == [[10, 11]]
    assert request.status is RequestStatus.FINISHED_ERROR
    assert request.error == (
        "the structured_outputs grammar is complete after 2 tokens, fewer than min_tokens (4)"
    )


def test_partial_prefill_emits_nothing_and_first_output_reports_cache_hits() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32)
    request = make_request("a", num_tokens=50)
    add(scheduler, request)
    _, outputs = step(scheduler)
    assert outputs.req_ids == [] and outputs.finished == []
    assert outputs.is_empty
    _, outputs = step(scheduler)
    assert outputs.req_ids == ["a"]
    assert outputs.num_cached_tokens == {"a": 0}
    _, outputs = step(scheduler)
    assert outputs.num_cached_tokens == {}


def test_wrong_number_of_results_is_an_error() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a"), make_request("b"))
    output = scheduler.schedule()
    with pytest.raises(RuntimeError, match="backend returned 1 results for a batch of 2"):
        scheduler.update_from_output(output, ModelRunnerOutput(["a"], [[1]]))


# -- aborts -----------------------------------------------------------------------------------------


def test_abort_waiting_request() -> None:
    scheduler = make_scheduler()
    a = make_request("a")
    b = make_request("b")
    add(scheduler, a, b)
    assert scheduler.finish_requests(["a"]) == [a]
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert a.finish_reason == "abort"
    assert scheduler.num_waiting == 1
    output = scheduler.schedule()
    assert [r.req_id for r in output.new_reqs] == ["b"]
    assert output.finished_req_ids == ["a"]
    assert_no_leak_after_abort_all(scheduler)


def assert_no_leak_after_abort_all(scheduler: Scheduler) -> None:
    scheduler.finish_requests(list(scheduler.requests))
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_running == 0
    assert scheduler.num_waiting == 0
    assert_no_leak(scheduler)


def test_abort_is_idempotent_and_ignores_unknown_ids() -> None:
    scheduler = make_scheduler()
    a = make_request("a")
    add(scheduler, a)
    step(scheduler)
    assert scheduler.finish_requests(["a"]) == [a]
    assert scheduler.finish_requests(["a"]) == []
    assert scheduler.finish_requests(["nope"]) == []
    assert scheduler.finish_requests("a") == []
    # A step that runs nothing holds the ended ids back for the next step that runs.
    output = scheduler.schedule()
    assert output.total_num_scheduled_tokens == 0 and output.finished_req_ids == []
    add(scheduler, make_request("b"))
    output = scheduler.schedule()
    assert output.finished_req_ids == ["a"]
    assert [r.req_id for r in output.new_reqs] == ["b"]
    scheduler.finish_requests(["b"])
    assert scheduler.schedule().finished_req_ids == []
    add(scheduler, make_request("c"))
    assert scheduler.schedule().finished_req_ids == ["b"]
    scheduler.finish_requests(["c"])
    assert_no_leak(scheduler)


def test_abort_accepts_a_single_id_and_a_live_view() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("ab"), make_request("c"), make_request("d"))
    step(scheduler)
    assert [r.request_id for r in scheduler.finish_requests("ab")] == ["ab"]
    ended = scheduler.finish_requests(scheduler.requests.keys())
    assert [r.request_id for r in ended] == ["c", "d"]
    assert_no_leak(scheduler)


def test_abort_running_request_between_schedule_and_update() -> None:
    scheduler = make_scheduler()
    a = make_request("a", num_tokens=40)
    b = make_request("b", num_tokens=10)
    add(scheduler, a, b)
    output = scheduler.schedule()
    assert scheduler.kv.num_free_blocks == 1000 - 4
    runner = runner_output(scheduler, output)
    scheduler.finish_requests(["a"])
    # Freed at once, not after the step.
    assert scheduler.kv.num_free_blocks == 1000 - 1
    assert a.blocks == []
    outputs = scheduler.update_from_output(output, runner)
    assert outputs.req_ids == ["b"]
    assert outputs.finished == []
    assert a.output_token_ids == []
    assert running_ids(scheduler) == ["b"]
    assert scheduler.schedule().finished_req_ids == ["a"]


def test_finish_with_a_non_finished_status_is_rejected() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a"))
    with pytest.raises(ValueError, match="status must be a finished status"):
        scheduler.finish_requests(["a"], RequestStatus.RUNNING)


def test_invalid_finish_changes_nothing_for_the_offending_request() -> None:
    scheduler = make_scheduler()
    running = make_request("running")
    add(scheduler, running)
    step(scheduler)
    waiting = make_request("waiting")
    add(scheduler, waiting)
    with pytest.raises(InvalidTransition, match="WAITING -> FINISHED_STOPPED"):
        scheduler.finish_requests(["running", "waiting"], RequestStatus.FINISHED_STOPPED)
    # The request before the offending one did end, and left the running list.
    assert running.status is RequestStatus.FINISHED_STOPPED
    assert scheduler.running == []
    assert waiting.status is RequestStatus.WAITING
    assert scheduler.num_waiting == 1
    output = scheduler.schedule()
    assert [r.req_id for r in output.new_reqs] == ["waiting"]
    assert output.cached.req_ids == []
    assert output.finished_req_ids == ["running"]


def test_error_finish_of_a_waiting_request() -> None:
    scheduler = make_scheduler()
    a = make_request("a")
    add(scheduler, a)
    assert scheduler.finish_requests(["a"], RequestStatus.FINISHED_ERROR) == [a]
    assert a.finish_reason == "error"
    assert scheduler.num_waiting == 0


# -- ids, control -----------------------------------------------------------------------------------


def test_duplicate_live_request_id_raises() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", max_tokens=1))
    with pytest.raises(ValueError, match="request_id 'a' is already in use"):
        scheduler.add_request(make_request("a"))
    step(scheduler)  # a finishes
    add(scheduler, make_request("a"))  # the id is free again
    assert scheduler.num_waiting == 1


def test_add_rejects_a_request_that_is_not_waiting() -> None:
    scheduler = make_scheduler()
    request = make_request("a")
    request.status = RequestStatus.RUNNING
    with pytest.raises(ValueError, match="must be WAITING, got RUNNING"):
        scheduler.add_request(request)
    # A structured-output request may also wait for its grammar, but not run yet.
    constrained = make_constrained("c", FakeGrammar())
    constrained.status = RequestStatus.RUNNING
    with pytest.raises(ValueError) as info:
        scheduler.add_request(constrained)
    assert str(info.value) == "a new request must be WAITING_FOR_GRAMMAR or WAITING, got RUNNING"
    assert not scheduler.has_unfinished_requests() and scheduler.num_constrained == 0


def test_reset_prefix_cache() -> None:
    """vLLM S9 (scheduler level)."""
    scheduler = make_scheduler()
    requests = [make_request(str(i), num_tokens=20) for i in range(10)]
    add(scheduler, *requests)
    step(scheduler)
    assert scheduler.kv.pool.cached != {}
    assert scheduler.reset_prefix_cache() is False
    assert scheduler.num_running == 10
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
    assert scheduler.running == []
    assert waiting_ids(scheduler) == [str(i) for i in range(10)]
    assert all(r.status is RequestStatus.PREEMPTED for r in requests)
    assert scheduler.kv.pool.cached == {}
    assert_no_leak(scheduler)
    output = scheduler.schedule()
    assert output.preempted_req_ids == [str(i) for i in range(10)]
    assert [r.req_id for r in output.new_reqs] == [str(i) for i in range(10)]
    assert all(r.num_computed_tokens == 0 for r in output.new_reqs)
    assert all(r.output_token_ids == [7] for r in output.new_reqs)
    assert all(r.num_scheduled_tokens == 21 for r in output.new_reqs)


def test_reset_prefix_cache_when_idle() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", num_tokens=40, max_tokens=1))
    step(scheduler)
    assert scheduler.kv.pool.cached != {}
    assert scheduler.reset_prefix_cache() is True
    assert scheduler.kv.pool.cached == {}


def test_memory_leak() -> None:
    """vLLM S18: 5 requests x 10 tokens x max_tokens 10 run to completion."""
    scheduler = make_scheduler()
    add(scheduler, *(make_request(str(i), num_tokens=10, max_tokens=10) for i in range(5)))
    num_steps = 0
    while scheduler.has_unfinished_requests():
        step(scheduler)
        num_steps += 1
    assert num_steps == 10
    assert scheduler.requests == {}
    assert scheduler.num_waiting == 0
    assert scheduler.running == []
    assert_no_leak(scheduler)
    # The last step's ended ids reach the backend with the next step that runs.
    assert scheduler.schedule().finished_req_ids == []
    add(scheduler, make_request("next", num_tokens=10))
    assert scheduler.schedule().finished_req_ids == [str(i) for i in range(5)]
    scheduler.finish_requests(["next"])
    assert_no_leak(scheduler)


def test_wire_types_round_trip() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", num_tokens=20, temperature=0.5, stop=["x"]))
    first, _ = step(scheduler)
    add(scheduler, make_request("b", num_tokens=5))
    second = scheduler.schedule()
    for output in (first, second):
        data = msgspec.msgpack.encode(output)
        assert msgspec.msgpack.decode(data, type=SchedulerOutput) == output
    assert second.cached == CachedRequestData(["a"], [None], [20], [1])
    assert isinstance(second.new_reqs[0], NewRequestData)
    outputs = scheduler.update_from_output(second, runner_output(scheduler, second))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(outputs), type=EngineCoreOutputs) == (
        outputs
    )


def test_prompt_logprobs_reach_the_front_end_once_per_position_across_a_preemption() -> None:
    """A request preempted in the middle of its prefill recomputes positions whose prompt
    logprobs were already delivered; the scheduler forwards each position once."""
    scheduler = make_scheduler(max_num_batched_tokens=32, num_blocks=100)
    a = make_request("a", num_tokens=48, prompt_logprobs=1)
    add(scheduler, a)
    delivered: list[int] = []

    def entries(output: SchedulerOutput) -> ModelRunnerOutput:
        counts = num_scheduled(output)
        start = a.num_computed_tokens - counts["a"]  # schedule() advanced it already
        end = min(a.num_computed_tokens, a.num_prompt_tokens)
        lps = [TokenLogprobs([p], [-float(p)], [1]) for p in range(start, end)]
        mro = runner_output(scheduler, output)
        mro.prompt_logprobs = {"a": lps}
        return mro

    output = scheduler.schedule()
    assert num_scheduled(output) == {"a": 32}
    out = scheduler.update_from_output(output, entries(output))
    delivered += [e.token_ids[0] for e in out.prompt_logprobs["a"]]
    scheduler.reset_prefix_cache(reset_running_requests=True)  # preempts "a"
    while a.num_computed_tokens < a.num_prompt_tokens or not a.output_token_ids:
        output = scheduler.schedule()
        out = scheduler.update_from_output(output, entries(output))
        delivered += [e.token_ids[0] for e in out.prompt_logprobs.get("a", [])]
    assert delivered == list(range(48))
    assert a.num_preemptions == 1


@pytest.mark.parametrize("first_chunk", [20, 1])
def test_prompt_logprobs_after_a_preemption_that_overlaps_part_of_what_was_sent(
    first_chunk: int,
) -> None:
    """The first chunk and the chunk recomputed after the preemption (32 positions) end at
    different positions: the second forwards only the positions after the first's."""
    scheduler = make_scheduler(max_num_batched_tokens=32, num_blocks=100)
    b = make_request("b", num_tokens=32 - first_chunk)
    a = make_request("a", num_tokens=48, prompt_logprobs=1)
    add(scheduler, b, a)

    def with_prompt_logprobs(output: SchedulerOutput) -> ModelRunnerOutput:
        mro = runner_output(scheduler, output)
        if "a" in num_scheduled(output):
            start = a.num_computed_tokens - num_scheduled(output)["a"]
            end = min(a.num_computed_tokens, a.num_prompt_tokens)
            mro.prompt_logprobs = {
                "a": [TokenLogprobs([p], [-float(p)], [1]) for p in range(start, end)]
            }
        return mro

    def delivered(out: EngineCoreOutputs) -> list[int]:
        return [e.token_ids[0] for e in out.prompt_logprobs.get("a", [])]

    output = scheduler.schedule()
    assert num_scheduled(output) == {"b": 32 - first_chunk, "a": first_chunk}
    out = scheduler.update_from_output(output, with_prompt_logprobs(output))
    assert delivered(out) == list(range(first_chunk))
    scheduler.reset_prefix_cache(reset_running_requests=True)  # preempts both
    scheduler.finish_requests("b")
    output = scheduler.schedule()
    assert num_scheduled(output) == {"a": 32}
    out = scheduler.update_from_output(output, with_prompt_logprobs(output))
    assert delivered(out) == list(range(first_chunk, 32))
    assert a.num_prompt_logprobs_sent == 32
    output = scheduler.schedule()
    out = scheduler.update_from_output(output, with_prompt_logprobs(output))
    assert delivered(out) == list(range(32, 48))
    assert out.req_ids == ["a"]


def test_prompt_logprobs_of_a_request_aborted_during_its_step_are_dropped_alone() -> None:
    scheduler = make_scheduler()
    a = make_request("a", num_tokens=3, prompt_logprobs=1)
    b = make_request("b", num_tokens=3, prompt_logprobs=1)
    add(scheduler, a, b)
    output = scheduler.schedule()
    mro = runner_output(scheduler, output)
    lps = {rid: [TokenLogprobs([p], [-1.0], [1]) for p in range(3)] for rid in ("a", "b")}
    mro.prompt_logprobs = lps
    scheduler.finish_requests("a")
    out = scheduler.update_from_output(output, mro)
    assert out.prompt_logprobs == {"b": lps["b"]}
    assert out.req_ids == ["b"]
    assert b.num_prompt_logprobs_sent == 3


@pytest.mark.parametrize("order", [["nope", "a", "b"], ["done", "a", "b"], ["a", "a", "b"]])
def test_an_unknown_or_finished_id_does_not_stop_the_aborts_after_it(order: list[str]) -> None:
    scheduler = make_scheduler()
    done = make_request("done", num_tokens=10, max_tokens=1)
    a = make_request("a")
    b = make_request("b")
    add(scheduler, done, a)
    step(scheduler)  # done finishes, a runs
    assert done.status is RequestStatus.FINISHED_LENGTH_CAPPED
    add(scheduler, b)  # b waits
    assert scheduler.finish_requests(order) == [a, b]
    assert a.status is b.status is RequestStatus.FINISHED_ABORTED
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_running == scheduler.num_waiting == 0
    assert_no_leak(scheduler)


def test_a_constrained_request_is_capped_at_max_tokens() -> None:
    scheduler = make_scheduler()
    grammar = FakeGrammar()
    request = make_constrained("a", grammar, max_tokens=3)
    add(scheduler, request)
    _, outputs = step(scheduler, {"a": [10, 11]})
    assert outputs.finished == []
    _, outputs = step(scheduler, {"a": [12, 13, 14]})
    assert outputs.new_token_ids == [[12]]
    assert outputs.finished == [FinishedRequest("a", "length", None)]
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert grammar.num_accepted == 3
    assert scheduler.num_constrained == 0


def test_priority_preemption_does_not_skip_the_later_running_requests() -> None:
    """Running [a, b, c]: a needs a block and preempts b (worst priority), which the step has
    not reached; c, after b, is still scheduled."""
    scheduler = make_scheduler(
        num_blocks=6, scheduling_policy="priority", enable_prefix_caching=False
    )
    a = make_request("a", num_tokens=30, priority=0, arrival_time=1.0, hash_blocks=False)
    b = make_request("b", num_tokens=20, priority=2, arrival_time=2.0, hash_blocks=False)
    c = make_request("c", num_tokens=20, priority=1, arrival_time=3.0, hash_blocks=False)
    for request in (a, b, c):
        add(scheduler, request)
        step(scheduler)
    assert running_ids(scheduler) == ["a", "b", "c"]
    assert scheduler.kv.num_free_blocks == 0
    output, _ = step(scheduler)
    assert output.preempted_req_ids == ["b"]
    assert num_scheduled(output) == {"a": 1, "c": 1}
    assert output.total_num_scheduled_tokens == 2
    assert output.cached.req_ids == ["a", "c"]
    assert running_ids(scheduler) == ["a", "c"]
    assert waiting_ids(scheduler) == ["b"]


def test_the_last_token_of_the_budget_is_used() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=11, long_prefill_token_threshold=10)
    add(scheduler, make_request("a", num_tokens=30), make_request("b", num_tokens=5))
    # a takes 10 (the threshold); b is admitted with the one token left.
    output = scheduler.schedule()
    assert num_scheduled(output) == {"a": 10, "b": 1}
    assert output.total_num_scheduled_tokens == 11
    scheduler.update_from_output(output, runner_output(scheduler, output))
    # Both running: b gets the last token after a's 10.
    output = scheduler.schedule()
    assert num_scheduled(output) == {"a": 10, "b": 1}
    assert output.cached.req_ids == ["a", "b"]


def test_the_preemption_counters_count_every_preemption() -> None:
    scheduler = make_scheduler()
    a = make_request("a")
    b = make_request("b")
    add(scheduler, a, b)
    for round_ in (1, 2, 3):
        step(scheduler)
        assert running_ids(scheduler) == ["a", "b"]
        scheduler.reset_prefix_cache(reset_running_requests=True)
        assert scheduler.num_preemptions == 2 * round_
        assert a.num_preemptions == b.num_preemptions == round_
        assert waiting_ids(scheduler) == ["a", "b"]


def test_the_first_running_request_may_take_the_whole_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    add(
        scheduler,
        make_request("a", num_tokens=3),
        make_request("b", num_tokens=3),
        make_request("c", num_tokens=3),
    )
    step(scheduler)
    # a got ten tokens in one step (as a speculating backend may return): catching up takes
    # the whole next budget, and b and c wait a step.
    step(scheduler, {"a": [7] * 10, "b": [7], "c": [7]})
    output, _ = step(scheduler)
    assert num_scheduled(output) == {"a": 10}
    assert scheduler.scheduled == []
    output, _ = step(scheduler)
    assert num_scheduled(output) == {"a": 1, "b": 1, "c": 1}


def test_priority_ties_preempt_the_latest_admitted() -> None:
    scheduler = make_scheduler(
        num_blocks=4, scheduling_policy="priority", enable_prefix_caching=False
    )
    first = make_request("z", num_tokens=30, priority=1, arrival_time=1.0, hash_blocks=False)
    second = make_request("a", num_tokens=31, priority=1, arrival_time=1.0, hash_blocks=False)
    add(scheduler, first)
    step(scheduler)
    add(scheduler, second)
    step(scheduler)
    step(scheduler)
    assert running_ids(scheduler) == ["z", "a"]
    assert scheduler.kv.num_free_blocks == 0
    # z needs a third block; a, admitted last, goes (whatever the ids' order).
    output, _ = step(scheduler)
    assert output.preempted_req_ids == ["a"]
    assert second.status is RequestStatus.PREEMPTED


def test_a_new_scheduler_has_scheduled_nothing() -> None:
    scheduler = make_scheduler()
    assert scheduler.scheduled == []
    assert (scheduler.num_running, scheduler.num_waiting, scheduler.num_preemptions) == (0, 0, 0)


def test_a_running_request_with_nothing_to_compute_is_left_out_of_the_step() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", num_tokens=5), make_request("b", num_tokens=5))
    # The backend returned no token for a (its prompt is done): a has nothing to compute.
    step(scheduler, {"b": [7]})
    output, _ = step(scheduler)
    assert num_scheduled(output) == {"b": 1}
    assert running_ids(scheduler) == ["a", "b"]


def test_nothing_is_admitted_in_a_step_that_preempted_even_a_request_ahead_of_the_victim() -> None:
    """With priorities the victim may go back behind a waiting request that would fit; that
    request still waits for the next step."""
    scheduler = make_scheduler(
        num_blocks=4, scheduling_policy="priority", enable_prefix_caching=False
    )
    a = make_request("a", num_tokens=30, priority=0, arrival_time=1.0, hash_blocks=False)
    b = make_request("b", num_tokens=31, priority=2, arrival_time=2.0, hash_blocks=False)
    w = make_request("w", num_tokens=5, priority=1, arrival_time=3.0, hash_blocks=False)
    add(scheduler, a)
    step(scheduler)
    add(scheduler, b)
    step(scheduler)
    add(scheduler, w)
    output, _ = step(scheduler)  # the pool is full: w waits
    assert output.new_reqs == [] and scheduler.kv.num_free_blocks == 0
    output, _ = step(scheduler)  # a needs a third block: b goes
    assert output.preempted_req_ids == ["b"]
    assert scheduler.kv.num_free_blocks == 1
    assert output.new_reqs == []
    assert waiting_ids(scheduler) == ["w", "b"]
    output, _ = step(scheduler)
    assert [r.req_id for r in output.new_reqs] == ["w"]


def test_num_cached_tokens_is_that_of_the_first_admission() -> None:
    scheduler = make_scheduler(num_blocks=4)
    a = make_request("a", num_tokens=32, max_tokens=2)
    b = make_request("b", num_tokens=32)
    add(scheduler, a, b)
    step(scheduler)
    assert b.num_cached_tokens == 0
    output, outputs = step(scheduler)  # a needs a third block: b goes, a finishes
    assert output.preempted_req_ids == ["b"]
    assert [f.req_id for f in outputs.finished] == ["a"]
    # b's first block is still cached: it resumes with a hit but was first admitted without.
    output, _ = step(scheduler)
    (resumed,) = output.new_reqs
    assert resumed.num_computed_tokens == 16
    assert b.num_cached_tokens == 0


def test_async_results_without_a_step_in_flight_are_refused() -> None:
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=BLOCK_SIZE,
        async_scheduling=True,
    )
    scheduler = Scheduler(config, 100)
    output = SchedulerOutput([], CachedRequestData(), 0)
    with pytest.raises(RuntimeError, match="^update_from_output without a step in flight$"):
        scheduler.update_from_output(output, ModelRunnerOutput([], []))
