"""Property-based test of the scheduler and KV cache bookkeeping.

Random sequences of add / abort / step / reset on a small block pool (so preemption happens),
under both policies, chunked prefill on and off, prefix caching on and off. A step is schedule +
update with one sampled token for every request whose prompt is complete after the step, and
with speculative decoding (n-gram drafts, static or dynamic) the drafts it accepted before that
token: the rejected drafts' KV stays behind as garbage, which no prefix hit may ever read.

An emulated backend follows the ``SchedulerOutput`` diffs (block tables, computed positions) and
records a fingerprint of the prefix written into every KV slot. A prefix-cache hit must point at
slots holding exactly the request's own prefix, so a block registered but never computed, or
reused while still cached, is caught here.
"""

from __future__ import annotations

import random
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core._core.drafts import DraftPlanner, SpecStats
from engine_core._core.request import Request, RequestStatus
from engine_core._core.scheduler import Scheduler, SchedulerConfig
from engine_core._core.scheduler_output import SchedulerOutput
from engine_core.abc import ModelRunnerOutput, SpecSupport, StepCostModel
from engine_core.config import EngineConfig, SpeculativeConfig
from engine_core.sampling_params import SamplingParams

BLOCK_SIZE = 16
MAX_MODEL_LEN = 128  # 8 blocks
EOS = 2
STOP = 3
VOCAB = [10, 11, 12, 13] * 4 + [EOS, STOP]


@dataclass
class Config:
    policy: Literal["fcfs", "priority"]
    chunked: bool
    caching: bool
    num_blocks: int
    max_num_seqs: int
    budget: int
    threshold: int


@dataclass
class Add:
    prompt_len: int
    prefix_id: int
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop: bool
    priority: int


@dataclass
class Abort:
    index: int


@dataclass
class Step:
    pass


@dataclass
class Reset:
    running_too: bool


@dataclass
class Held:
    """What the backend holds of one request."""

    req_id: str
    table: list[int]
    tokens: list[int] = field(default_factory=list)
    fingerprints: list[int] = field(default_factory=list)
    """Per position, a fingerprint of the tokens up to it."""
    num_computed_tokens: int = 0

    def append(self, token: int) -> None:
        self.fingerprints.append(hash((self.fingerprints[-1] if self.tokens else 0, token)))
        self.tokens.append(token)


@dataclass
class Backend:
    """Follows the scheduler's diffs like a real backend and shadows the KV cache contents."""

    block_size: int
    rng: random.Random
    slots: dict[tuple[int, int], int] = field(default_factory=dict)
    """(block id, offset) -> fingerprint of the prefix whose KV the slot holds."""
    slot_tokens: dict[tuple[int, int], int] = field(default_factory=dict)
    requests: dict[str, Held] = field(default_factory=dict)

    def _fresh(self, block_ids: list[int]) -> None:
        """Blocks handed out anew: whatever they held is garbage from now on."""
        for block_id in block_ids:
            for offset in range(self.block_size):
                self.slots.pop((block_id, offset), None)
                self.slot_tokens.pop((block_id, offset), None)

    def _slot(self, held: Held, position: int) -> tuple[int, int]:
        assert position // self.block_size < len(held.table), (held.req_id, position, held.table)
        return held.table[position // self.block_size], position % self.block_size

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in output.finished_req_ids + output.preempted_req_ids:
            self.requests.pop(req_id, None)
        work: list[tuple[Held, int, int]] = []
        drafts_of: dict[str, list[int]] = {}
        # Raises for an id unknown here or computed tokens other than the backend's (so also
        # when a rollback of rejected drafts went wrong).
        for index, (held, new_blocks, computed, num) in enumerate(
            output.cached.diffs(self.requests)
        ):
            if new_blocks is not None:
                held.table.extend(new_blocks)
                self._fresh(new_blocks)
            drafts = output.cached.drafts_of(index)
            if drafts:
                assert num == 1 + len(drafts) and computed + 1 == len(held.tokens)
                drafts_of[held.req_id] = drafts
            work.append((held, computed, num))
        for new in output.new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id} sent twice"
            held = self.requests[new.req_id] = Held(new.req_id, list(new.block_ids))
            for token in new.prompt_token_ids + new.output_token_ids:
                held.append(token)
            # Prefix-cache hits are whole blocks; the blocks after them are new.
            assert new.num_computed_tokens % self.block_size == 0
            self._fresh(new.block_ids[new.num_computed_tokens // self.block_size :])
            work.append((held, new.num_computed_tokens, new.num_scheduled_tokens))
        # The whole batch's KV is written before anything is read (as a forward pass does per
        # layer), so a hit on a block another request fills in this same step is valid.
        for held, start, num in work:
            assert num > 0
            drafts = drafts_of.get(held.req_id, [])
            fps = held.fingerprints
            tokens = held.tokens
            if drafts:  # their KV is written as if they were the request's tokens
                fps, tokens = list(fps), tokens + drafts
                for draft in drafts:
                    fps.append(hash((fps[-1], draft)))
            assert start + num <= len(fps), (held.req_id, start, num, len(fps))
            for position in range(start, start + num):
                slot = self._slot(held, position)
                self.slots[slot] = fps[position]
                self.slot_tokens[slot] = tokens[position]
            held.num_computed_tokens = start + num
        for new in output.new_reqs:
            held = self.requests[new.req_id]
            for position in range(new.num_computed_tokens):
                assert self.slots.get(self._slot(held, position)) == held.fingerprints[position], (
                    f"{new.req_id}: prefix hit at position {position} reads KV of another prefix"
                )
        sampled = []
        for held, _, _ in work:
            drafts = drafts_of.get(held.req_id, [])
            if held.num_computed_tokens - len(drafts) >= len(held.tokens):
                # Each draft is right with probability 0.6; the first wrong one is replaced.
                tokens = []
                for draft in drafts:
                    if self.rng.random() >= 0.6:
                        tokens.append(self.rng.choice([t for t in VOCAB if t != draft]))
                        break
                    tokens.append(draft)
                else:
                    tokens.append(self.rng.choice(VOCAB))
                held.num_computed_tokens -= len(drafts) + 1 - len(tokens)  # the rollback
                for token in tokens:
                    held.append(token)
                sampled.append(tokens)
            else:
                sampled.append([])
        return ModelRunnerOutput(output.req_ids, sampled)


configs = st.builds(
    Config,
    policy=st.sampled_from(["fcfs", "priority"]),
    chunked=st.booleans(),
    caching=st.booleans(),
    num_blocks=st.integers(MAX_MODEL_LEN // BLOCK_SIZE, 16),
    max_num_seqs=st.integers(1, 6),
    budget=st.sampled_from([16, 40, 64, 128, 256]),
    threshold=st.sampled_from([0, 8, 20, 24, 50]),
)


@st.composite
def adds(draw: st.DrawFn) -> Add:
    max_tokens = draw(st.integers(1, 40))
    return Add(
        prompt_len=draw(st.one_of(st.integers(1, 100), st.integers(40, 100))),
        prefix_id=draw(st.integers(0, 2)),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, min(max_tokens, 4))),
        ignore_eos=draw(st.booleans()),
        stop=draw(st.booleans()),
        priority=draw(st.integers(0, 3)),
    )


operations = st.lists(
    st.one_of(
        adds(),
        adds(),
        st.just(Step()),
        st.just(Step()),
        st.just(Step()),
        st.builds(Abort, st.integers(0, 30)),
        st.builds(Reset, st.booleans()),
    ),
    min_size=10,
    max_size=50,
)


def prompt_for(op: Add, serial: int) -> list[int]:
    # Requests with the same prefix_id share their first 40 tokens (2.5 blocks), then differ.
    shared = [100 + 10 * op.prefix_id + i // 7 for i in range(40)]
    tail = [1000 + serial * 100 + i for i in range(op.prompt_len)]
    return (shared + tail)[: op.prompt_len]


def new_request(op: Add, serial: int, params: SamplingParams, config: Config) -> Request:
    """The request an ``Add`` makes, the ``serial``-th of the run."""
    return Request(
        f"r{serial}",
        prompt_for(op, serial),
        params,
        block_size=BLOCK_SIZE,
        arrival_time=float(serial),
        priority=op.priority,
        eos_token_ids=(EOS,),
        hash_blocks=config.caching,
    )


def scheduler_for(config: Config, spec: str | None = None) -> Scheduler:
    """A scheduler configured the way the engine does it: from a (valid) EngineConfig; with
    ``spec`` (``"static"``, ``"dynamic"``), n-gram speculative decoding of up to 3 drafts."""
    # Without chunked prefill, a whole prompt must fit one step.
    budget = config.budget if config.chunked else max(config.budget, MAX_MODEL_LEN)
    engine_config = EngineConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        enable_chunked_prefill=config.chunked,
        long_prefill_token_threshold=config.threshold,
        enable_prefix_caching=config.caching,
        scheduling_policy=config.policy,
    )
    decoder = None
    if spec is not None:
        # A step cost under which speculation pays for a few requests, not for many.
        support = SpecSupport(cost_model=StepCostModel(step_s=1e-3, per_token_s=1e-4))
        speculative = SpeculativeConfig(
            num_speculative_tokens=3, prompt_lookup_min=1, dynamic=spec == "dynamic"
        )
        decoder = DraftPlanner(speculative, support)
    return Scheduler(SchedulerConfig.from_engine_config(engine_config), config.num_blocks, decoder)


def check_cached_blocks(scheduler: Scheduler, backend: Backend) -> None:
    """Every block in the prefix cache holds, in every slot, KV computed since it was handed
    out, for exactly the tokens its key names (a key is parent digest + tokens [+ extras])."""
    for key, block in scheduler.kv.pool.cached.items():
        tokens = list(array("I", key[16 : 16 + 4 * BLOCK_SIZE]))
        written = [backend.slot_tokens.get((block.block_id, i)) for i in range(BLOCK_SIZE)]
        assert written == tokens, f"block {block.block_id} is cached but holds {written}"


def check_invariants(scheduler: Scheduler, config: Config, all_requests: list[Request]) -> None:
    pool = scheduler.kv.pool
    refs = [b.ref_cnt for b in pool.blocks]
    free = pool.free_queue.block_ids()
    # The free queue holds each unreferenced block once, and its count is its length.
    assert len(free) == pool.num_free_blocks == scheduler.kv.num_free_blocks
    assert sorted(free) == [b.block_id for b in pool.blocks if not b.ref_cnt]
    # Blocks holding no cached prefix are reused before any cached one.
    cached = [pool.blocks[i].key is not None for i in free]
    assert cached == sorted(cached)
    holders: Counter[int] = Counter()
    for request in scheduler.requests.values():
        holders.update(request.block_ids)
    assert all(refs[i] == holders[i] for i in range(pool.num_blocks))
    for key, block in pool.cached.items():
        assert block.key == key
    assert sum(1 for b in pool.blocks if b.key is not None) == len(pool.cached)

    running = [r.request_id for r in scheduler.running]
    waiting = [r.request_id for r in scheduler.waiting]
    assert len(set(running)) == len(running)
    assert not set(running) & set(waiting)
    assert set(running) | set(waiting) == set(scheduler.requests)
    assert len(waiting) == scheduler.num_waiting
    assert len(running) <= config.max_num_seqs
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING
        assert len(request.blocks) * BLOCK_SIZE >= request.num_computed_tokens
        assert request.num_computed_tokens <= request.num_tokens
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.blocks == []
        assert request.num_computed_tokens == 0
    for request in all_requests:
        if request.is_finished:
            assert request.blocks == []
            assert request.request_id not in scheduler.requests
            check_stop(request)


def check_stop(request: Request) -> None:
    """A finished request stopped at the first token that should have stopped it."""
    outputs = request.output_token_ids
    assert len(outputs) <= request.max_tokens
    assert request.num_tokens <= MAX_MODEL_LEN
    # Output k is preceded by k outputs; a stop token there stops only once k >= min_tokens.
    stopping = [
        k
        for k, token in enumerate(outputs)
        if token in request.stop_token_ids and k >= request.min_tokens
    ]
    if request.status is RequestStatus.FINISHED_STOPPED:
        assert stopping == [len(outputs) - 1]
        last = outputs[-1]
        assert request.stop_reason == (None if last in request.eos_token_ids else last)
    elif request.status is RequestStatus.FINISHED_LENGTH_CAPPED:
        assert stopping == []
        assert len(outputs) == request.max_tokens or request.num_tokens == MAX_MODEL_LEN
    else:
        assert request.status is RequestStatus.FINISHED_ABORTED
        assert stopping == []


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(config=configs, ops=operations, seed=st.integers(0, 2**16))
def test_random_operations_keep_the_books_straight(
    config: Config, ops: list[Add | Abort | Step | Reset], seed: int
) -> None:
    run_operations(config, ops, seed)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    config=configs,
    ops=operations,
    seed=st.integers(0, 2**16),
    spec=st.sampled_from(["static", "dynamic"]),
)
def test_random_operations_with_drafts_keep_the_books_straight(
    config: Config, ops: list[Add | Abort | Step | Reset], seed: int, spec: str
) -> None:
    stats = run_operations(config, ops, seed, spec)
    assert stats is not None
    assert stats.num_accepted_tokens <= stats.num_draft_tokens


def run_operations(
    config: Config, ops: list[Add | Abort | Step | Reset], seed: int, spec: str | None = None
) -> SpecStats | None:
    """Apply ``ops``, then run everything to its end, checking the books all along; returns
    the speculative counters (None without ``spec``)."""
    scheduler = scheduler_for(config, spec)
    budget = scheduler.config.max_num_batched_tokens
    backend = Backend(BLOCK_SIZE, random.Random(seed))
    all_requests: list[Request] = []

    def do_step() -> None:
        running_before = {r.request_id for r in scheduler.running}
        output = scheduler.schedule()
        counts = list(output.cached.num_scheduled_tokens)
        counts += [r.num_scheduled_tokens for r in output.new_reqs]
        assert sum(counts) == output.total_num_scheduled_tokens <= budget
        assert all(n > 0 for n in counts)
        if config.threshold:
            assert all(n <= config.threshold for n in counts)
        assert len(set(output.req_ids)) == len(output.req_ids)
        # A step that preempted admits nobody (ids preempted by a reset, or reported late
        # because the steps that preempted them ran nothing, were not running before it).
        if set(output.preempted_req_ids) & running_before:
            assert output.new_reqs == []
        scheduler.update_from_output(output, backend.execute(output))
        check_cached_blocks(scheduler, backend)

    for op in ops:
        if isinstance(op, Add):
            serial = len(all_requests)
            params = SamplingParams(
                max_tokens=op.max_tokens,
                min_tokens=op.min_tokens,
                ignore_eos=op.ignore_eos,
                stop_token_ids=[STOP] if op.stop else None,
            )
            request = new_request(op, serial, params, config)
            scheduler.add_request(request)
            all_requests.append(request)
        elif isinstance(op, Abort):
            if all_requests:
                scheduler.finish_requests([all_requests[op.index % len(all_requests)].request_id])
        elif isinstance(op, Reset):
            held = any(b.ref_cnt for b in scheduler.kv.pool.blocks) and not op.running_too
            assert scheduler.reset_prefix_cache(op.running_too) is not held
            if not held:
                assert scheduler.kv.pool.cached == {}
                assert scheduler.running == []
        else:
            do_step()
        check_invariants(scheduler, config, all_requests)

    # Everything left finishes on its own (no livelock), then the pool is whole again.
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        do_step()
        check_invariants(scheduler, config, all_requests)
    assert not scheduler.has_unfinished_requests()
    assert all(request.is_finished for request in all_requests)
    pool = scheduler.kv.pool
    assert scheduler.kv.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    return scheduler.draft_planner.stats if scheduler.draft_planner is not None else None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, ops=operations, seed=st.integers(0, 2**16))
def test_abort_everything_frees_every_block(
    config: Config, ops: list[Add | Abort | Step | Reset], seed: int
) -> None:
    scheduler = scheduler_for(config)
    backend = Backend(BLOCK_SIZE, random.Random(seed))
    all_requests: list[Request] = []
    for op in ops:
        if isinstance(op, Add):
            serial = len(all_requests)
            params = SamplingParams(max_tokens=op.max_tokens, ignore_eos=op.ignore_eos)
            request = new_request(op, serial, params, config)
            scheduler.add_request(request)
            all_requests.append(request)
        elif isinstance(op, Step):
            output = scheduler.schedule()
            runner = backend.execute(output)
            victim = all_requests[-1] if len(all_requests) % 3 == 0 and all_requests else None
            if victim is not None:
                # An abort that lands while the step runs: no tokens, blocks freed at once.
                scheduler.finish_requests([victim.request_id])
                assert victim.blocks == []
            outputs = scheduler.update_from_output(output, runner)
            if victim is not None:
                assert victim.request_id not in outputs.req_ids
            check_cached_blocks(scheduler, backend)
        check_invariants(scheduler, config, all_requests)
    scheduler.finish_requests(list(scheduler.requests))
    check_invariants(scheduler, config, all_requests)
    assert not scheduler.has_unfinished_requests()
    pool = scheduler.kv.pool
    assert scheduler.kv.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.free_queue.num_free_blocks == len(list(pool.free_queue)) == pool.num_blocks
