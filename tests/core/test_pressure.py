"""The scheduler under KV pressure: requests that never fit are refused, no head-of-line blocking
(with a starvation bound), the preemption victim policies and what preemption costs, the
partial-prefill limits, and a request queue that admission cannot stall."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pytest
from helpers.core import make_request as _make_request
from helpers.core import make_scheduler

from engine_core._core import admission
from engine_core._core.kv_groups import plan_kv_layout
from engine_core._core.preemption import VictimPolicyError, make_victim_policy
from engine_core._core.request import Request, RequestStatus
from engine_core._core.scheduler import Scheduler, SchedulerConfig
from engine_core._core.scheduler_output import SchedulerOutput
from engine_core.abc import (
    FullAttentionSpec,
    ModelRunnerOutput,
    PreemptionVictimPolicy,
    SlidingWindowSpec,
)
from engine_core.config import EngineConfig

EOS = 2
make_request = functools.partial(_make_request, eos_token_ids=(EOS,))


def add(scheduler: Scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)


def step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    """schedule + update, one token for every request whose prompt is complete."""
    output = scheduler.schedule()
    sampled = []
    for request_id in output.req_ids:
        request = scheduler.requests.get(request_id)
        done = request is not None and request.num_computed_tokens >= request.num_tokens
        sampled.append([token] if done else [])
    scheduler.update_from_output(output, ModelRunnerOutput(output.req_ids, sampled))
    return output


def scheduled(output: SchedulerOutput) -> dict[str, int]:
    counts = dict(zip(output.cached.req_ids, output.cached.num_scheduled_tokens, strict=True))
    counts.update((r.req_id, r.num_scheduled_tokens) for r in output.new_reqs)
    return counts


def waiting_ids(scheduler: Scheduler) -> list[str]:
    return [r.request_id for r in scheduler.waiting]


# -- 1. a request that can never fit is refused at once -------------------------------------------


def test_a_waiting_request_that_outgrew_a_shrunk_cache_is_refused_naming_both_figures() -> None:
    scheduler = make_scheduler(num_blocks=10)
    assert scheduler.kv.reserve_blocks(6) == 6  # pinned, parked, or a cache that shrank
    big = make_request("big", num_tokens=80)  # 5 blocks (+1 for its token: 81 positions)
    small = make_request("small", num_tokens=10)
    add(scheduler, big, small)
    output = scheduler.schedule()
    assert scheduled(output) == {"small": 10}  # refused in the same step, not queued
    (refused,) = scheduler.take_refused()
    assert (refused.req_id, refused.finish_reason) == ("big", "error")
    assert refused.error is not None
    assert "needs 5 KV-cache blocks" in refused.error
    assert "at most 4 blocks" in refused.error and "6 of them pinned or parked" in refused.error
    assert big.status is RequestStatus.FINISHED_ERROR
    assert "big" not in scheduler.requests and waiting_ids(scheduler) == []
    scheduler.kv.release_reserved_blocks()
    assert scheduler.kv.num_usable_blocks == 10


def test_a_running_request_that_outgrows_the_cache_ends_with_an_error_not_a_stall() -> None:
    scheduler = make_scheduler(num_blocks=4)
    grower = make_request("grower", num_tokens=60, ignore_eos=True, max_tokens=100)
    add(scheduler, grower)
    step(scheduler)  # 60 positions: 4 blocks; its 65th position needs a fifth
    for _ in range(4):
        step(scheduler)
    assert grower.num_tokens == 65
    output = scheduler.schedule()
    assert output.total_num_scheduled_tokens == 0
    (refused,) = scheduler.take_refused()
    assert refused.req_id == "grower" and refused.finish_reason == "error"
    # ignore_eos and no stop token: it must generate all its max_tokens (160 positions).
    assert "needs 10 KV-cache blocks" in (refused.error or "")
    assert "at most 4 blocks" in (refused.error or "")
    assert scheduler.running == [] and scheduler.kv.num_free_blocks == 4
    assert scheduler.num_preemptions == 0  # it did not preempt itself into the queue forever


def test_the_need_is_per_kv_cache_group() -> None:
    spec = dict(num_kv_heads=2, head_size=8, dtype_bytes=2)
    layout = plan_kv_layout([FullAttentionSpec(**spec), SlidingWindowSpec(window=32, **spec)], 16)
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=1024)
    scheduler = Scheduler(config, 12, kv_layout=layout)
    add(scheduler, make_request("r", num_tokens=160))  # full: 10 blocks, window: at most 7
    scheduler.schedule()
    (refused,) = scheduler.take_refused()
    assert "(full_attention: 10, sliding_attention(32): " in (refused.error or "")
    assert "at most 12 blocks" in (refused.error or "")


def test_admission_stuck_at_max_num_seqs_is_not_counted_with_deferred_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    compiling = [make_request(f"g{i}", num_tokens=10) for i in range(3)]
    for request in compiling:  # waiting for their grammar: they hold no seat
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        request.use_structured_output = True
    plain = [make_request(f"p{i}", num_tokens=10, max_tokens=1) for i in range(3)]
    add(scheduler, *compiling, *plain)
    assert scheduled(step(scheduler)) == {"p0": 10, "p1": 10}
    # Both ended in that step: the next step admits the third at once.
    assert scheduled(step(scheduler)) == {"p2": 10}


# -- 2. no head-of-line blocking, with a starvation bound -----------------------------------------


def test_requests_behind_one_whose_blocks_are_not_free_go_first_and_it_then_goes_first() -> None:
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=96)
    holder = make_request("holder", num_tokens=64, max_tokens=3)  # 4 blocks
    big = make_request("big", num_tokens=80)  # 5 blocks + 1
    small = make_request("small", num_tokens=10, max_tokens=3)
    add(scheduler, holder, big, small)
    assert scheduled(step(scheduler)) == {"holder": 64, "small": 10}
    assert waiting_ids(scheduler) == ["big"] and big.num_bypassed_steps == 1
    late = make_request("late", num_tokens=10)
    add(scheduler, late)
    step(scheduler)
    step(scheduler)  # holder and small end
    output = step(scheduler)
    assert [r.req_id for r in output.new_reqs][0] == "big"  # first once its blocks are free
    assert big.num_bypassed_steps == 0


def test_a_request_overtaken_in_max_bypass_steps_steps_is_overtaken_no_more() -> None:
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=200, max_bypass_steps=2)
    holder = make_request("holder", num_tokens=64, max_tokens=50)  # 4 blocks for 50 steps
    big = make_request("big", num_tokens=80)
    add(scheduler, holder, big)
    step(scheduler)
    admitted = []
    for i in range(5):
        add(scheduler, make_request(f"s{i}", num_tokens=10, max_tokens=1))
        admitted += [r.req_id for r in step(scheduler).new_reqs]
    assert admitted == ["s0", "s1"]  # two steps overtook big, then it holds the queue
    assert big.num_bypassed_steps == 2
    assert waiting_ids(scheduler) == ["big", "s2", "s3", "s4"]
    while holder.status is RequestStatus.RUNNING:
        step(scheduler)
    assert [r.req_id for r in step(scheduler).new_reqs][0] == "big"


def test_a_queue_front_of_long_prompts_does_not_hide_a_short_one_behind_them() -> None:
    # More long prompts than a step tries to allocate: those no shorter than one that failed
    # are set aside untried, so the short request behind them is reached and admitted.
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=32, max_num_batched_tokens=512)
    holder = make_request("holder", num_tokens=64, max_tokens=50)  # 4 blocks
    longs = [make_request(f"long{i}", num_tokens=80 + i) for i in range(12)]  # 6 blocks each
    small = make_request("small", num_tokens=10, max_tokens=3)
    add(scheduler, holder, *longs, small)
    assert len(longs) > admission.MAX_BLOCKED_PER_STEP
    assert scheduled(step(scheduler)) == {"holder": 64, "small": 10}
    assert longs[0].num_bypassed_steps == 1  # tried; the others, no shorter, were not
    assert all(r.num_bypassed_steps == 0 for r in longs[1:])
    assert waiting_ids(scheduler) == [r.request_id for r in longs]


def test_a_step_stops_trying_after_a_few_failed_allocations_of_ever_smaller_requests() -> None:
    # Each request is smaller than the one before, so each is tried and fails: the step stops
    # after MAX_BLOCKED_PER_STEP of them and does not reach the short one behind.
    scheduler = make_scheduler(num_blocks=40, max_num_seqs=32, max_num_batched_tokens=2048)
    holder = make_request("holder", num_tokens=36 * 16, max_tokens=50)  # 36 of 40 blocks
    n = admission.MAX_BLOCKED_PER_STEP + 1
    shrinking = [make_request(f"r{i}", num_tokens=(20 - i) * 16) for i in range(n)]
    small = make_request("small", num_tokens=10, max_tokens=3)
    add(scheduler, holder)
    step(scheduler)
    add(scheduler, *shrinking, small)
    assert scheduled(step(scheduler)) == {"holder": 1}
    assert "small" in waiting_ids(scheduler)


def test_max_bypass_steps_zero_keeps_the_queue_strict() -> None:
    scheduler = make_scheduler(num_blocks=8, max_bypass_steps=0)
    add(
        scheduler,
        make_request("holder", num_tokens=64, max_tokens=3),
        make_request("big", num_tokens=80),
        make_request("small", num_tokens=10),
    )
    assert scheduled(step(scheduler)) == {"holder": 64}


def test_under_priority_the_queue_order_is_kept_while_bypassing() -> None:
    scheduler = make_scheduler(num_blocks=8, scheduling_policy="priority")
    holder = make_request("holder", num_tokens=64, max_tokens=3, priority=0)
    add(scheduler, holder)
    step(scheduler)
    add(
        scheduler,
        make_request("low", num_tokens=10, priority=5, arrival_time=1.0),
        make_request("big", num_tokens=80, priority=1, arrival_time=2.0),
        make_request("mid2", num_tokens=10, priority=2, arrival_time=4.0),
        make_request("mid1", num_tokens=10, priority=2, arrival_time=3.0),
    )
    output = step(scheduler)
    assert [r.req_id for r in output.new_reqs] == ["mid1", "mid2", "low"]
    assert waiting_ids(scheduler) == ["big"]


# -- 3. the victim policy, a preempted request's place, recomputed tokens ------------------------


def test_last_admitted_preempts_the_latest_admitted_and_least_progress_the_least_work() -> None:
    a, b, c = (make_request(name) for name in "abc")
    a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens = 50, 10, 30
    for r in (a, b, c):
        r.status = RequestStatus.RUNNING
    assert make_victim_policy("least_progress").pick([a, b, c], a) is b
    assert make_victim_policy("last_admitted").pick([a, b, c], a) is c
    b.num_computed_tokens = 30
    assert make_victim_policy("least_progress").pick([a, b, c], a) is c  # a tie: the latest
    b.priority = 0
    a.priority = c.priority = 1
    a.arrival_time, c.arrival_time = 2.0, 1.0
    # priority: the worst priority first, then the least progress, or the latest arrival.
    assert make_victim_policy("least_progress", priority=True).pick([a, b, c], a) is c
    assert make_victim_policy("last_admitted", priority=True).pick([a, b, c], a) is a


def test_least_progress_preempts_a_request_ahead_of_the_one_in_need() -> None:
    scheduler = make_scheduler(num_blocks=6, enable_prefix_caching=False,
                               preemption_victim="least_progress")  # fmt: skip
    early = make_request("early", num_tokens=17, ignore_eos=True, hash_blocks=False)
    add(scheduler, early)
    step(scheduler)  # early: 17 computed (2 blocks)
    late = make_request("late", num_tokens=63, ignore_eos=True, hash_blocks=False)
    add(scheduler, late)
    step(scheduler)  # late: 4 blocks, 63 computed; 6 in use
    step(scheduler)  # late's 64th position fills its 4th block
    # early has the fewer computed tokens: it is the victim though late was admitted last.
    while not scheduler.num_preemptions:
        step(scheduler)
    assert early.status is RequestStatus.PREEMPTED and late.status is RequestStatus.RUNNING


def test_recomputed_tokens_count_what_a_preempted_request_computes_again() -> None:
    scheduler = make_scheduler(
        num_blocks=7, enable_prefix_caching=False, preemption_victim="last_admitted"
    )
    a = make_request("a", num_tokens=32, max_tokens=3, hash_blocks=False)
    b = make_request("b", num_tokens=32, max_tokens=3, hash_blocks=False)
    c = make_request("c", num_tokens=48, hash_blocks=False)
    add(scheduler, a, b, c)
    step(scheduler)
    step(scheduler)  # a needs a third block: c (48 computed) is preempted
    assert c.status is RequestStatus.PREEMPTED
    assert scheduler.num_recomputed_tokens == 0  # owed, not yet computed again
    while c.status is not RequestStatus.RUNNING:
        step(scheduler)
    assert scheduler.num_recomputed_tokens == 48


def test_recomputed_tokens_not_computed_are_taken_back() -> None:
    scheduler = make_scheduler(num_blocks=20, enable_prefix_caching=False,
                               max_num_batched_tokens=32)  # fmt: skip
    r = make_request("r", num_tokens=100, hash_blocks=False)
    add(scheduler, r)
    for _ in range(3):
        step(scheduler)  # 96 computed
    scheduler.reset_prefix_cache(reset_running_requests=True)  # preempts it
    step(scheduler)  # admitted again: 96 counted, 32 computed again
    assert scheduler.num_recomputed_tokens == 96
    scheduler.finish_requests("r")  # aborted before it caught up
    assert scheduler.num_recomputed_tokens == 32
    # Aborted while queued after a preemption: nothing was counted, nothing is taken back.
    q = make_request("q", num_tokens=40, hash_blocks=False)
    add(scheduler, q)
    step(scheduler)
    scheduler.reset_prefix_cache(reset_running_requests=True)
    scheduler.finish_requests("q")
    assert scheduler.num_recomputed_tokens == 32


def test_a_preempted_request_keeps_its_place_by_arrival() -> None:
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=256)
    holder = make_request("holder", num_tokens=64, max_tokens=1, arrival_time=0.0)
    big = make_request("big", num_tokens=80, arrival_time=1.0)
    small = make_request("small", num_tokens=10, ignore_eos=True, arrival_time=2.0)
    add(scheduler, holder, big, small)
    step(scheduler)  # small overtakes big
    assert small.status is RequestStatus.RUNNING
    scheduler.reset_prefix_cache(reset_running_requests=True)  # small preempted
    assert waiting_ids(scheduler) == ["big", "small"]  # behind big, which arrived first


# -- 4. partial prefills ----------------------------------------------------------------------------


def test_max_num_partial_prefills_caps_the_prefills_of_a_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=1000, max_num_partial_prefills=2)
    add(scheduler, *(make_request(f"r{i}", num_tokens=100) for i in range(3)))
    assert scheduled(step(scheduler)) == {"r0": 100, "r1": 100}
    assert scheduled(step(scheduler)) == {"r0": 1, "r1": 1, "r2": 100}  # decodes are no prefill


def test_max_long_partial_prefills_lets_short_prompts_past_long_ones() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=1000,
        long_prefill_token_threshold=200,
        max_num_partial_prefills=3,
        max_long_partial_prefills=1,
    )
    long1 = make_request("long1", num_tokens=1000)
    long2 = make_request("long2", num_tokens=1000)
    short = make_request("short", num_tokens=50)
    add(scheduler, long1, long2, short)
    assert scheduled(step(scheduler)) == {"long1": 200, "short": 50}
    assert waiting_ids(scheduler) == ["long2"]
    for _ in range(4):
        step(scheduler)  # long1's prefill ends
    assert "long2" in scheduled(step(scheduler))


def test_a_long_prompt_leaves_the_short_prefill_slots_their_blocks() -> None:
    # Limits (3, 1, threshold 64): two short slots of 64 tokens = 8 blocks kept free from long
    # prompts while others run, until the long one was overtaken max_bypass_steps steps.
    assert admission.short_reserve_tokens(3, 1, 64) == 128
    assert admission.short_reserve_tokens(0, 1, 64) == 64
    assert admission.short_reserve_tokens(3, 3, 64) == admission.short_reserve_tokens(3, 0, 64) == 0
    limits = {
        "long_prefill_token_threshold": 64,
        "max_num_partial_prefills": 3,
        "max_long_partial_prefills": 1,
        "max_num_batched_tokens": 512,
        "max_bypass_steps": 2,
    }
    scheduler = make_scheduler(num_blocks=40, **limits)
    holder = make_request("holder", num_tokens=60, max_tokens=50)  # 4 blocks, runs on
    add(scheduler, holder)
    step(scheduler)
    doc = make_request("doc", num_tokens=30 * 16)  # 31 of the 36 free blocks: fits, less 8
    add(scheduler, doc, make_request("s1", num_tokens=10, max_tokens=20))
    assert scheduled(step(scheduler)) == {"holder": 1, "s1": 10}
    assert doc.num_bypassed_steps == 1
    add(scheduler, make_request("s2", num_tokens=10, max_tokens=20))
    assert set(scheduled(step(scheduler))) == {"holder", "s1", "s2"}
    # Overtaken max_bypass_steps steps: it goes first, reserve or not.
    add(scheduler, make_request("s3", num_tokens=10, max_tokens=20))
    output = step(scheduler)
    assert [r.req_id for r in output.new_reqs] == ["doc", "s3"]
    assert scheduled(output)["doc"] == 64

    # Without the limits the same prompt goes at once.
    scheduler = make_scheduler(num_blocks=40, max_num_batched_tokens=512)
    add(scheduler, make_request("holder", num_tokens=60, max_tokens=50))
    step(scheduler)
    add(scheduler, make_request("doc", num_tokens=30 * 16))
    assert "doc" in scheduled(step(scheduler))

    # With nothing running it never waits for the reserve (nothing would free blocks).
    scheduler = make_scheduler(num_blocks=40, **limits)
    add(scheduler, make_request("doc", num_tokens=36 * 16))  # 37 blocks: 37 + 8 > 40
    assert scheduled(step(scheduler)) == {"doc": 64}


def test_partial_prefill_limits_in_engine_config_resolve_vllms_threshold() -> None:
    config = EngineConfig(max_num_partial_prefills=4, max_long_partial_prefills=1)
    assert config.resolved(model_max_len=10_000).long_prefill_token_threshold == 400
    assert EngineConfig().resolved(model_max_len=10_000).long_prefill_token_threshold == 0


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("preemption_victim", "biggest"),
        ("preemption_victim", "module:"),
        ("max_num_partial_prefills", -1),
        ("max_long_partial_prefills", -2),
        ("max_bypass_steps", -1),
        ("stall_timeout_s", 0),
        ("stall_timeout_s", -5.0),
    ],
)
def test_bad_values_are_config_errors_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_more_long_partial_prefills_than_partial_prefills_is_an_error() -> None:
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        EngineConfig(max_num_partial_prefills=1, max_long_partial_prefills=2)


class _Raises(PreemptionVictimPolicy):
    def pick(self, running: Sequence[Request], requester: Request) -> Request:
        raise KeyError("broken")


class _Stranger(PreemptionVictimPolicy):
    def pick(self, running: Sequence[Request], requester: Request) -> Request:
        return make_request("stranger")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (f"{__name__}:_Raises", "raised KeyError"),
        (f"{__name__}:_Stranger", "chose stranger, which is not a running request"),
    ],
)
def test_a_custom_policy_that_raises_or_chooses_wrongly_fails_the_step(
    name: str, message: str
) -> None:
    scheduler = make_scheduler(num_blocks=4, preemption_victim=name)
    a = make_request("a", num_tokens=32, ignore_eos=True)
    b = make_request("b", num_tokens=31, ignore_eos=True)
    add(scheduler, a, b)
    with pytest.raises(VictimPolicyError, match=message):
        for _ in range(5):
            step(scheduler)


def test_a_custom_policy_path_that_is_not_a_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="preemption_victim 'os:getcwd' is not a"):
        make_victim_policy("os:getcwd")
    with pytest.raises(ValueError, match="cannot be loaded"):
        make_victim_policy("no_such_module_here:Policy")
