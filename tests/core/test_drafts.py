"""Speculative decoding in the core: the n-gram proposer, the output check, the policy and the
scheduler's accounting of drafts (budget, KV, rollback, preemption, stops)."""

from __future__ import annotations

import random
import statistics
import time

import pytest
from helpers.core import make_scheduler

from engine_core._core.drafts import DraftPlanner, check_verified
from engine_core._core.request import Request, RequestStatus
from engine_core._core.scheduler import Scheduler
from engine_core._core.spec_policy import CostModel, SpecPolicy
from engine_core.abc import ModelRunnerOutput, SpecSupport, StepCostModel
from engine_core.config import SpeculativeConfig
from engine_core.errors import BackendError
from engine_core.ngram import NgramIndex, NgramProposer
from engine_core.sampling_params import SamplingParams

BLOCK_SIZE = 16

# -- the n-gram proposer ---------------------------------------------------------------------------


def test_ngram_longest_match_wins_then_the_earliest() -> None:
    proposer = NgramProposer(2, 4)
    assert proposer.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    # [1, 2, 3] occurs at 4 and 7; [2, 3] earlier at 1 (a shorter match): the longest wins,
    # and of its occurrences the earliest.
    assert proposer.propose([9, 2, 3, 7, 1, 2, 3, 1, 2, 3, 4, 1, 2, 3], 2) == [1, 2]
    # Fewer near the end; none without a match, nor for k = 0 or a sequence too short.
    assert proposer.propose([5, 6, 5, 6], 4) == [5, 6]
    assert proposer.propose([5, 6, 7, 8], 4) == []
    assert proposer.propose([1, 2, 1, 2], 0) == []
    assert proposer.propose([1, 1], 2) == []
    assert NgramProposer(1, 1).propose([1, 2, 1], 2) == [2, 1]


def test_ngram_skips_matches_that_straddle_two_tokens() -> None:
    # Packed little-endian, 0x100 0x200 0 reads 00 01 00 00 00 02 00 00 00 00 00 00: the
    # bytes of [1, 2] start at byte 1, inside a token.
    tokens = [0x100, 0x200, 0, 7, 1, 2, 9, 1, 2]
    assert NgramProposer(2, 2).propose(tokens, 2) == [9, 1]
    assert NgramProposer(2, 2).propose([0x100, 0x200, 0, 7, 8, 1, 2], 2) == []


def test_ngram_index_follows_a_growing_sequence() -> None:
    rng = random.Random(1)
    proposer = NgramProposer(2, 4)
    index = NgramIndex()
    tokens: list[int] = []
    for _ in range(300):
        tokens.append(rng.randrange(6))
        assert proposer.propose(tokens, 3, index) == proposer.propose(tokens, 3)
    # A shorter sequence than the index saw is packed again.
    assert proposer.propose(tokens[:50], 3, index) == proposer.propose(tokens[:50], 3)
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramProposer(3, 2)


def test_ngram_proposing_at_2k_context_takes_microseconds() -> None:
    rng = random.Random(0)
    proposer = NgramProposer(2, 4)
    tokens = [rng.randrange(32_000) for _ in range(2048)]
    index = NgramIndex()
    proposer.propose(tokens, 5, index)
    times = []
    for _ in range(200):
        tokens.append(rng.randrange(32_000))
        start = time.perf_counter()
        proposer.propose(tokens, 5, index)
        times.append(time.perf_counter() - start)
    # About 5-10 us on a laptop core; a generous bound for a loaded machine.
    assert statistics.median(times) < 200e-6


# -- the output check ------------------------------------------------------------------------------


def test_check_verified_accepts_what_a_verifier_returns() -> None:
    assert check_verified("r", [5, 6, 7], [5, 6, 7, 8]) == 3  # all accepted, then the bonus
    assert check_verified("r", [5, 6, 7], [5, 9]) == 1
    assert check_verified("r", [5, 6, 7], [4]) == 0
    assert check_verified("r", [], [4]) == 0


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([], "returned 0 tokens for 2 drafts"),
        ([5, 6, 7, 8], "returned 4 tokens for 2 drafts"),
        ([4, 6], r"returned \[4, 6\] for drafts \[5, 6\]"),  # a wrong draft accepted
        ([5, 6], r"returned \[5, 6\] for drafts \[5, 6\]"),  # a right draft replaced by itself
        ([5], r"returned \[5\] for drafts \[5, 6\]"),
    ],
)
def test_check_verified_refuses_what_no_verifier_returns(tokens: list[int], message: str) -> None:
    with pytest.raises(BackendError, match=message):
        check_verified("r", [5, 6], tokens)


# -- the policy ------------------------------------------------------------------------------------

A, B = 5e-3, 5e-5  # step 5 ms + 50 us per token
ALPHA = 0.71875  # a bucket's middle: the policy's gains are exact there


def policy(k_choices: list[int], **kwargs: object) -> SpecPolicy:
    return SpecPolicy(k_choices, CostModel(A, B), **kwargs)  # type: ignore[arg-type]


def test_one_draft_pays_below_the_break_even_batch() -> None:
    # k = 1 pays while B < (a / b) * alpha / (1 - alpha) = 255.6 (by 3 % at B = 200, which
    # clears the 2 % needed to change).
    assert policy([0, 1]).decide([ALPHA] * 200, 8)[0] == 1
    assert policy([0, 1]).decide([ALPHA] * 300, 8)[0] == 0


def test_speculation_switches_off_as_the_batch_grows_and_back_on() -> None:
    p = policy([0, 1, 2, 4])
    up = [p.decide([ALPHA] * n, 8)[0] for n in (1, 8, 32, 64, 128, 256, 512)]
    assert up[0] == 4 and up[-1] == 0
    assert up == sorted(up, reverse=True)
    down = [p.decide([ALPHA] * n, 8)[0] for n in (512, 256, 128, 64, 32, 8, 1)]
    assert down == sorted(down) and down[-1] == 4


def test_no_flapping_near_the_break_even() -> None:
    p = policy([0, 1])
    choices = {p.decide([ALPHA] * n, 8)[0] for n in [254, 257] * 20}
    assert len(choices) == 1


def test_requests_that_copy_get_drafts_when_the_others_do_not() -> None:
    # 32 requests whose drafts are nearly always right, 224 whose drafts never are.
    p = policy([0, 1, 2, 4])
    k, threshold = p.decide([0.97] * 32 + [0.0] * 224, 8)
    assert k > 0 and 0.0 < threshold <= 0.97
    assert p.predicted_speedup > 1.0
    assert policy([0, 1, 2, 4]).decide([0.0] * 256, 8)[0] == 0


def test_static_speculation_always_uses_the_most_drafts_the_budget_allows() -> None:
    p = policy([0, 1, 2, 4], dynamic=False)
    assert p.decide([0.0] * 512, 8) == (4, 0.0)
    assert p.decide([0.9], 3) == (2, 0.0)


def test_the_step_cost_is_fitted_to_measured_steps() -> None:
    cost = CostModel(A, B)  # the prior: 5 ms + 50 us per token
    rng = random.Random(2)
    for _ in range(400):  # the truth: 2 ms + 10 us per token, with noise
        tokens = rng.randrange(1, 300)
        cost.observe(tokens, (2e-3 + 1e-5 * tokens) * rng.uniform(0.97, 1.03))
    assert cost.step_s == pytest.approx(2e-3, rel=0.1)
    assert cost.per_token_s == pytest.approx(1e-5, rel=0.15)
    # Steps of one size say nothing of the slope: the fit keeps a cost.
    flat = CostModel(A, B)
    for _ in range(100):
        flat.observe(64, 1e-3)
    assert flat.step_s > 0 and flat.per_token_s >= 0


def test_acceptance_estimates_follow_what_was_observed() -> None:
    p = policy([0, 1, 2])
    mine = p.new_acceptance()
    assert p.estimate(mine) == pytest.approx(0.6)  # the prior
    for _ in range(30):
        p.observe(mine, 1, True)  # one right, then one wrong: alpha 0.5
    assert p.estimate(mine) == pytest.approx(0.5, abs=0.05)
    assert p.overall_estimate() == pytest.approx(0.5, abs=0.1)


def test_requests_alike_share_one_estimate_and_different_ones_keep_theirs() -> None:
    rng = random.Random(3)
    p = policy([0, 1, 2])
    alike = [p.new_acceptance() for _ in range(64)]
    for _ in range(30):  # every request's drafts right with probability 0.7
        for acceptance in alike:
            run = 0
            while run < 2 and rng.random() < 0.7:
                run += 1
            p.observe(acceptance, run, run < 2)
    estimates = p.shrunk(alike)
    # Luck spreads the measured rates; none of it is taken for a difference between them.
    assert max(estimates) - min(estimates) < 0.05
    assert statistics.mean(estimates) == pytest.approx(0.7, abs=0.05)
    copying, free = p.new_acceptance(), p.new_acceptance()
    for _ in range(20):
        p.observe(copying, 2, False)
        p.observe(free, 0, True)
    high, low = p.shrunk([copying, free])
    assert high > 0.8 and low < 0.3


def test_a_step_with_nobody_decoding_decides_from_the_requests_that_sample() -> None:
    scheduler = spec_scheduler(k=3, method="scripted", dynamic=True)
    add(scheduler, "r", COPY[:15])
    out = scheduler.schedule()  # nobody decodes yet: decided from r alone (a batch of 1)
    assert scheduler.draft_planner is not None and scheduler.draft_planner.k == 3
    assert out.num_draft_tokens == 4 and out.draft_req_ids == ["r"]


# -- the scheduler's accounting --------------------------------------------------------------------


def spec_scheduler(
    *,
    k: int = 3,
    min_n: int = 2,
    dynamic: bool = False,
    method: str = "ngram",
    lookahead_per_draft: int = 0,
    num_blocks: int = 100,
    cost: tuple[float, float] = (A, B),
    **config: object,
) -> Scheduler:
    """A scheduler (``make_scheduler``'s ``config``) whose drafts come from a scripted proposer
    of up to ``k`` drafts."""
    support = SpecSupport(
        proposers=["scripted"],
        lookahead_per_draft=lookahead_per_draft,
        cost_model=StepCostModel(step_s=cost[0], per_token_s=cost[1]),
    )
    spec = SpeculativeConfig(
        method=method, num_speculative_tokens=k, dynamic=dynamic, prompt_lookup_min=min_n
    )
    return make_scheduler(
        num_blocks=num_blocks,
        draft_planner=DraftPlanner(spec, support),
        **config,  # type: ignore[arg-type]
    )


def add(scheduler: Scheduler, request_id: str, prompt: list[int], **params: object) -> Request:
    params.setdefault("max_tokens", 50)
    request = Request(
        request_id,
        prompt,
        SamplingParams(**params),  # type: ignore[arg-type]
        block_size=BLOCK_SIZE,
        eos_token_ids=(2,),
    )
    scheduler.add_request(request)
    return request


COPY = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19] * 5  # n-gram drafts continue the cycle


def prefill(scheduler: Scheduler, token: int = 10) -> None:
    """Run the admission step, every request sampling ``token``."""
    out = scheduler.schedule()
    assert out.new_reqs and not out.cached.spec_token_ids
    scheduler.update_from_output(out, ModelRunnerOutput(out.req_ids, [[token]] * out.num_reqs))


def test_drafts_count_in_the_budget_and_the_step_lowers_k_to_serve_everyone() -> None:
    scheduler = spec_scheduler(k=3, min_n=1, max_num_batched_tokens=9)
    for i in range(3):
        add(scheduler, f"r{i}", COPY[:3])
    prefill(scheduler, 10)
    out = scheduler.schedule()
    # 9 tokens for three decoding requests: 2 drafts each (k lowered from 3), not 3 + 3 + 0.
    assert out.cached.num_scheduled_tokens == [3, 3, 3]
    assert out.cached.spec_token_ids == [[11, 12]] * 3
    assert out.total_num_scheduled_tokens == 9


def test_kv_is_reserved_for_the_drafts_and_the_lookahead_then_rolled_back() -> None:
    scheduler = spec_scheduler(k=3, method="scripted", lookahead_per_draft=1)
    request = add(scheduler, "r", COPY[:15])
    out = scheduler.schedule()
    # The backend drafts for its next step (k + 1: the extra one scores the bonus token).
    assert out.num_draft_tokens == 4 and out.draft_req_ids == ["r"]
    scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[15]], draft_token_ids=[[16] * 4]))
    out = scheduler.schedule()
    assert out.cached.spec_token_ids == [[16, 16, 16]]
    assert out.cached.num_scheduled_tokens == [4]
    # 15 computed + 4 scheduled + 4 lookahead slots = 23 tokens: 2 blocks.
    assert len(request.blocks) == 2
    assert request.num_computed_tokens == 19
    scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[16, 7]], draft_token_ids=[[]]))
    assert request.num_computed_tokens == 17  # 2 drafts rejected
    assert request.all_token_ids[15:] == [15, 16, 7]
    assert request.num_computed_tokens == request.num_tokens - 1
    spec = scheduler.draft_planner
    assert spec is not None
    assert (spec.stats.num_drafts, spec.stats.num_draft_tokens) == (1, 3)
    assert spec.stats.num_accepted_tokens == 1
    assert spec.stats.accepted_per_pos == [1, 0, 0]
    assert spec.stats.drafted_per_pos == [1, 1, 1]
    scheduler.finish_requests("r")
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_a_probe_asks_a_backend_drafter_and_reserves_its_lookahead() -> None:
    # A token costs 100 times a step's fixed part: drafts never pay, so k stays 0.
    scheduler = spec_scheduler(
        k=3, method="scripted", dynamic=True, lookahead_per_draft=1, cost=(1e-3, 1e-1)
    )
    request = add(scheduler, "r", COPY[:12], max_tokens=200)
    prefill(scheduler, 12)
    for _ in range(40):
        out = scheduler.schedule()
        assert not out.cached.spec_token_ids  # nothing is verified
        if out.draft_req_ids:
            break
        scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[7]]))
    else:
        raise AssertionError("the request was never probed")
    assert out.draft_req_ids == ["r"] and out.num_draft_tokens == 3
    # Its slots cover the drafter's KV past the scheduled position: 3 more.
    assert len(request.blocks) * BLOCK_SIZE >= request.num_computed_tokens + 3
    scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[7]], draft_token_ids=[[7, 7, 8]]))
    spec = scheduler.draft_planner
    assert spec is not None and request.drafting is not None
    assert request.drafting.shadow == [7, 7, 8] and not request.drafting.probing
    # Scored against the tokens that follow: 7 and 7 right, 8 wrong (9 came).
    for token in (7, 7, 9):
        out = scheduler.schedule()
        scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[token]]))
    assert spec.stats.shadow_drafts == 3 and spec.stats.shadow_accepted == 2
    assert spec.stats.num_draft_tokens == 0


def test_a_drafters_drafts_are_used_only_where_they_continue_the_sequence() -> None:
    scheduler = spec_scheduler(k=3, method="scripted")
    request = add(scheduler, "r", COPY[:15])
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[15]], draft_token_ids=[[16] * 4]))
    # The token after 15 arrives without those drafts being verified (say the step verified
    # none): they continue a shorter sequence, and are not verified later.
    request.all_token_ids.append(16)
    request.num_computed_tokens += 1
    out = scheduler.schedule()
    assert not out.cached.spec_token_ids
    assert out.cached.num_scheduled_tokens == [1]


def test_only_verified_tokens_enter_the_prefix_cache() -> None:
    scheduler = spec_scheduler(k=3)
    request = add(scheduler, "r", COPY[:14])
    prefill(scheduler, 14)
    out = scheduler.schedule()
    assert out.cached.spec_token_ids == [[15, 16, 17]]  # positions 15-17 fill block 0... 1
    keys_before = len(scheduler.kv.pool.cached)
    scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[99]]))  # all rejected
    assert request.all_token_ids[-2:] == [14, 99]
    # Block 0 (tokens 0-15) is full of verified tokens only once 99 is computed: not yet cached.
    assert len(scheduler.kv.pool.cached) == keys_before == 0
    out = scheduler.schedule()
    assert len(scheduler.kv.pool.cached) == 1
    (key,) = scheduler.kv.pool.cached
    assert key == request.block_keys[0]


def test_drafts_never_run_past_max_tokens_or_max_model_len() -> None:
    scheduler = spec_scheduler(k=3, max_model_len=40)
    add(scheduler, "short", COPY[:20], max_tokens=3)
    add(scheduler, "long", COPY[:37], max_tokens=50)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(out.req_ids, [[10], [17]]))
    out = scheduler.schedule()
    # short has 1 output of 3: 1 + 1 drafts; long has 38 tokens of 40: 1 + 1 drafts.
    assert out.cached.num_scheduled_tokens == [2, 2]
    assert out.cached.spec_token_ids == [[11], [18]]


def test_a_stop_among_accepted_tokens_ends_the_request_there() -> None:
    scheduler = spec_scheduler(k=3)
    request = add(scheduler, "r", COPY[:14], stop_token_ids=[15])
    prefill(scheduler, 14)
    out = scheduler.schedule()
    assert out.cached.spec_token_ids == [[15, 16, 17]]
    outputs = scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[15, 16, 17, 18]]))
    assert outputs.new_token_ids == [[15]]  # nothing after the stop token
    assert outputs.finished[0].finish_reason == "stop" and outputs.finished[0].stop_reason == 15
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_max_tokens_among_accepted_tokens_ends_the_request_there() -> None:
    scheduler = spec_scheduler(k=3)
    add(scheduler, "r", COPY[:14], max_tokens=3, min_tokens=0)
    prefill(scheduler, 14)
    out = scheduler.schedule()
    assert out.cached.spec_token_ids == [[15]]  # 1 output of 3: one draft at most
    outputs = scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[15, 16]]))
    assert outputs.new_token_ids == [[15, 16]]
    assert outputs.finished[0].finish_reason == "length"


def test_a_preempted_request_drops_its_drafts_and_resumes_without_them() -> None:
    scheduler = spec_scheduler(k=3, num_blocks=3)
    first = add(scheduler, "a", COPY[:15])
    second = add(scheduler, "b", COPY[:15])
    prefill(scheduler, 15)
    # a needs a second block for its drafts (15 + 4 > 16), b too: only 1 is free, so b goes.
    out = scheduler.schedule()
    assert out.cached.req_ids == ["a"] and out.preempted_req_ids == ["b"]
    assert out.cached.spec_token_ids == [[16, 17, 18]]
    assert second.status is RequestStatus.PREEMPTED
    assert second.drafting is not None and second.drafting.scheduled == []
    scheduler.update_from_output(out, ModelRunnerOutput(["a"], [[16, 17, 18, 19]]))
    scheduler.finish_requests("a")
    out = scheduler.schedule()
    assert [r.req_id for r in out.new_reqs] == ["b"] and not out.cached.spec_token_ids
    assert first.is_finished


def test_a_backend_returning_what_no_verifier_could_is_an_error() -> None:
    scheduler = spec_scheduler(k=3)
    add(scheduler, "r", COPY[:14])
    prefill(scheduler, 14)
    out = scheduler.schedule()
    with pytest.raises(BackendError, match=r"returned \[15, 99, 17\] for drafts \[15, 16, 17\]"):
        scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[15, 99, 17]]))


def test_two_tokens_without_drafts_are_an_error() -> None:
    scheduler = spec_scheduler(k=3)
    add(scheduler, "r", [1, 2, 3])
    out = scheduler.schedule()
    with pytest.raises(BackendError, match="returned 2 tokens for a step without drafts"):
        scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[4, 5]]))


def test_an_abort_while_the_step_runs_leaves_nothing_behind() -> None:
    scheduler = spec_scheduler(k=3)
    add(scheduler, "r", COPY[:14])
    prefill(scheduler, 14)
    out = scheduler.schedule()
    assert out.cached.spec_token_ids
    scheduler.finish_requests("r")
    outputs = scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[15, 16, 17, 18]]))
    assert outputs.req_ids == []
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
