"""A hypothesis state machine of the scheduler under KV pressure.

Tiny caches (a few blocks), random prompts sharing prefixes (prefix hits), max_tokens,
priorities, aborts, preemption (the cache is too small for what is queued), a cache that
shrinks and grows back, both victim policies, head-of-line bypass on and off, partial-prefill
limits, async scheduling and speculative decoding on and off. It asserts that every request
finishes or is refused, that the scheduler never idles while it has work it could run, and that
no block leaks.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine_core._core.drafts import DraftPlanner
from engine_core._core.request import Request, RequestStatus
from engine_core._core.scheduler import Scheduler, SchedulerConfig
from engine_core._core.scheduler_output import SchedulerOutput
from engine_core.abc import ModelRunnerOutput, SpecSupport, StepCostModel
from engine_core.config import EngineConfig, SpeculativeConfig
from engine_core.sampling_params import SamplingParams

BLOCK_SIZE = 16
MAX_MODEL_LEN = 96  # 6 blocks
EOS = 2
VOCAB = [10, 11, 12, 13, 14, EOS]


@dataclass(frozen=True)
class Setup:
    num_blocks: int
    policy: str
    victim: str
    bypass: int
    partial: tuple[int, int]
    budget: int
    max_num_seqs: int
    mode: str  # "sync", "async" or "spec"
    caching: bool


setups = st.builds(
    Setup,
    num_blocks=st.integers(MAX_MODEL_LEN // BLOCK_SIZE, 10),
    policy=st.sampled_from(["fcfs", "priority"]),
    victim=st.sampled_from(["last_admitted", "least_progress"]),
    bypass=st.sampled_from([0, 1, 3, 64]),
    partial=st.sampled_from([(0, 0), (1, 1), (2, 1), (3, 0)]),
    budget=st.sampled_from([16, 48, 128]),
    max_num_seqs=st.integers(1, 5),
    mode=st.sampled_from(["sync", "async", "spec"]),
    caching=st.booleans(),
)


def make(setup: Setup) -> Scheduler:
    engine_config = EngineConfig(
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=max(setup.budget, setup.max_num_seqs),
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=setup.caching,
        scheduling_policy=setup.policy,  # type: ignore[arg-type]
        preemption_victim=setup.victim,
        max_bypass_steps=setup.bypass,
        max_num_partial_prefills=setup.partial[0],
        max_long_partial_prefills=setup.partial[1],
        long_prefill_token_threshold=24 if setup.partial[1] else 0,
        async_scheduling=setup.mode == "async",
    ).resolved(model_max_len=None)
    planner = None
    if setup.mode == "spec":
        support = SpecSupport(cost_model=StepCostModel(step_s=1e-3, per_token_s=1e-4))
        speculative = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1)
        planner = DraftPlanner(speculative, support)
    config = SchedulerConfig.from_engine_config(engine_config)
    return Scheduler(config, setup.num_blocks, planner)


class PressureMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(0)
        self.added: dict[str, Request] = {}
        self.ended: set[str] = set()
        self.in_flight: deque[tuple[SchedulerOutput, list[bool], list[list[int]]]] = deque()
        self.idle_steps = 0
        self.bypassed = False

    @initialize(setup=setups, seed=st.integers(0, 1000))
    def start(self, setup: Setup, seed: int) -> None:
        self.setup = setup
        self.scheduler = make(setup)
        self.rng.seed(seed)

    # -- rules ------------------------------------------------------------------------------------

    @rule(
        length=st.integers(1, 90),
        prefix=st.integers(0, 2),
        max_tokens=st.integers(1, 30),
        priority=st.integers(0, 2),
        ignore_eos=st.booleans(),
    )
    def add(
        self, length: int, prefix: int, max_tokens: int, priority: int, ignore_eos: bool
    ) -> None:
        serial = len(self.added)
        shared = [20 + prefix * 5 + i % 5 for i in range(32)]
        prompt = (shared + [100 + serial * 100 + i for i in range(length)])[:length]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        request = Request(
            f"r{serial}",
            prompt,
            params,
            block_size=BLOCK_SIZE,
            arrival_time=float(serial),
            priority=priority,
            eos_token_ids=(EOS,),
            hash_blocks=self.setup.caching,
        )
        self.scheduler.add_request(request)
        self.added[request.request_id] = request

    @rule(lengths=st.lists(st.integers(1, 90), min_size=2, max_size=5), priority=st.integers(0, 2))
    def burst(self, lengths: list[int], priority: int) -> None:
        """Long and short prompts at once: a long one at the head, short ones behind it."""
        for length in lengths:
            self.add(length, length % 3, 1 + length % 7, priority, False)

    @rule(index=st.integers(0, 50))
    def abort(self, index: int) -> None:
        if self.added:
            request_id = f"r{index % len(self.added)}"
            for request in self.scheduler.finish_requests(request_id):
                self.ended.add(request.request_id)

    @rule()
    def step(self) -> None:
        self._step()

    @rule(num=st.integers(1, 3))
    def shrink(self, num: int) -> None:
        self.scheduler.kv.reserve_blocks(num)

    @precondition(lambda self: self.scheduler.kv.num_reserved_blocks)
    @rule()
    def grow_back(self) -> None:
        self.scheduler.kv.release_reserved_blocks()

    @rule()
    def reset_running(self) -> None:
        if not self.in_flight:
            self.scheduler.reset_prefix_cache(reset_running_requests=True)

    # -- stepping -----------------------------------------------------------------------------------

    def _step(self) -> None:
        scheduler = self.scheduler
        output = scheduler.schedule()
        for refused in scheduler.take_refused():
            assert refused.finish_reason == "error" and "KV-cache blocks" in (refused.error or "")
            self.ended.add(refused.req_id)
        self.bypassed = self.bypassed or any(r.num_bypassed_steps for r in scheduler.waiting)
        total = output.total_num_scheduled_tokens
        if total:
            self.in_flight.append((output, *self._samples(output)))
            self.idle_steps = 0
        elif not self.in_flight and scheduler.requests:
            self.idle_steps += 1
            # Work queued, nothing in flight, nothing scheduled: at most one such step (the one
            # in which a request preempted itself), never a stall.
            assert self.idle_steps <= 1, self._state()
        keep = 1 if self.setup.mode == "async" and total else 0
        while len(self.in_flight) > keep:
            self._apply(*self.in_flight.popleft())

    def _samples(self, output: SchedulerOutput) -> tuple[list[bool], list[list[int]]]:
        """Per request of the batch, whether it samples in this step, and its drafts."""
        flags: list[bool] = []
        drafts: list[list[int]] = []
        num_cached = len(output.cached.req_ids)
        for index, request in enumerate(self.scheduler.scheduled):
            own = list(output.cached.drafts_of(index) or ()) if index < num_cached else []
            if self.setup.mode == "async":
                flags.append(request.samples_in_flight)
            else:
                flags.append(request.num_computed_tokens - len(own) >= len(request.all_token_ids))
            drafts.append(own)
        return flags, drafts

    def _apply(self, output: SchedulerOutput, flags: list[bool], drafts: list[list[int]]) -> None:
        """The step's results: the drafts a verifier accepts, then a token that differs from
        the next draft (a random token otherwise)."""
        sampled = []
        for sample, own in zip(flags, drafts, strict=True):
            if not sample:
                sampled.append([])
                continue
            accepted = self.rng.randint(0, len(own))
            rest = [t for t in VOCAB if accepted == len(own) or t != own[accepted]]
            sampled.append(own[:accepted] + [self.rng.choice(rest)])
        outputs = self.scheduler.update_from_output(
            output, ModelRunnerOutput(output.req_ids, sampled)
        )
        for finished in outputs.finished:
            self.ended.add(finished.req_id)

    def _state(self) -> str:
        s = self.scheduler
        return (
            f"running {[(r.request_id, r.num_computed_tokens) for r in s.running]}, waiting "
            f"{[(r.request_id, r.status.name, r.num_tokens) for r in s.waiting]}, free "
            f"{s.kv.num_free_blocks}/{s.kv.num_usable_blocks}"
        )

    # -- invariants ---------------------------------------------------------------------------------

    @invariant()
    def books(self) -> None:
        scheduler = self.scheduler
        assert len(scheduler.running) <= self.setup.max_num_seqs
        assert set(scheduler.requests) | self.ended >= set(self.added)
        assert not set(scheduler.requests) & self.ended
        assert scheduler.num_recomputed_tokens >= 0
        for request in scheduler.running:
            assert request.status is RequestStatus.RUNNING

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        scheduler = self.scheduler
        for _ in range(3000):  # everything left finishes or is refused: no livelock
            if not scheduler.requests and not self.in_flight:
                break
            self._step()
        assert not scheduler.requests, self._state()
        assert self.ended == set(self.added)
        event(f"preempted: {bool(scheduler.num_preemptions)}")
        event(
            f"refused: {any(r.status is RequestStatus.FINISHED_ERROR for r in self.added.values())}"
        )
        event(f"bypassed: {self.bypassed}")
        assert all(r.status.is_finished for r in self.added.values())
        scheduler.kv.release_reserved_blocks()
        pool = scheduler.kv.pool
        assert scheduler.kv.num_free_blocks == pool.num_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)


PressureMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
test_scheduler_under_kv_pressure = PressureMachine.TestCase
