"""The token-budget scheduler.

One idea: each step every request tries to make ``num_computed_tokens`` catch up with its
``num_tokens`` within one budget of tokens per step. Prefill chunks, decodes, prefix-cache hits and
resumed preemptions are all the same computation. Running requests are served first (in admission
order), then waiting ones are admitted while the budget, the sequence cap and the free blocks allow.
Under KV pressure the rules of ``admission`` (refusals, bypass, partial prefills) and the victim
policies of ``preemption`` apply. With speculative decoding a decoding request may also verify
drafts, which count in the budget and are rolled back when rejected (``drafts``: where they come
from and how many).

Pure, synchronous logic: no event loop, sockets or tensors.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from engine_core._core import admission
from engine_core._core.engine_io import EngineCoreOutputs, FinishedRequest
from engine_core._core.kv_cache_manager import GroupedKVCacheManager, KVCacheManager
from engine_core._core.kv_connector_core import ENDED, NO_ROOM, ConnectorCore
from engine_core._core.preemption import make_victim_policy
from engine_core._core.request import FINISH_REASONS, GrammarMatcher, Request, RequestStatus
from engine_core._core.request_queue import count_in, count_out, make_queue
from engine_core._core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core.abc import ModelRunnerOutput, TokenLogprobs

if TYPE_CHECKING:
    from engine_core._core.drafts import DraftPlanner
    from engine_core._core.kv_groups import KVLayout
    from engine_core.config import EngineConfig
    from engine_core.kv_connector import KVConnectorScheduler

__all__ = ["Scheduler", "SchedulerConfig"]

_PREEMPTED = RequestStatus.PREEMPTED
_RUNNING = RequestStatus.RUNNING
_WAITING_FOR_GRAMMAR = RequestStatus.WAITING_FOR_GRAMMAR
_PARKED = RequestStatus.WAITING_FOR_REMOTE_KVS
_STOPPED = RequestStatus.FINISHED_STOPPED
_ERROR = RequestStatus.FINISHED_ERROR

# A step's running entries: one flat list, five fields per scheduled running request, in batch
# order (built by Scheduler._schedule_running):
#
#   entries = [request, req_id, new_block_ids, computed, num_new,  request, req_id, ...]
#              |<---------- one entry: _ENTRY fields ---------->|
#
# new_block_ids: the ids of the blocks the request got this step (None: none); computed: its
# computed tokens before the step; num_new: its tokens this step.
#
# NOTE: flat, not a list of tuples: a tuple per running request per step, alive until the output
# is built, is work for the cyclic garbage collector (W2 of bench/bench_scheduler.py, 1024
# requests, ran 13-25% slower with them). CachedRequestData's columns are slices of it.
_ENTRY = 5


@dataclass(slots=True, kw_only=True)
class SchedulerConfig:
    """The knobs the scheduler reads (a subset of the resolved ``EngineConfig``)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    block_size: int = 16
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 0
    max_long_partial_prefills: int = 0
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    preemption_victim: str = "least_progress"
    max_bypass_steps: int = 64
    async_scheduling: bool | None = False
    """Schedule while the previous step is in flight (placeholders for its sampled tokens)."""
    kv_load_failure_policy: str = "recompute"
    """A KV connector's failed load: ``"recompute"`` or ``"fail"`` (``docs/kv_connector.md``)."""
    kv_lease_s: float = 30.0
    kv_max_parked_fraction: float = 0.5
    enable_lora: bool = False
    max_loras: int = 1
    """With LoRA: most distinct adapters among the running requests (so in any step)."""

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> SchedulerConfig:
        """The scheduler's knobs of a resolved engine config (see ``EngineConfig.resolved``).
        Raises ``ValueError`` if ``max_model_len`` or ``max_num_batched_tokens`` is unresolved
        (None)."""
        if config.max_model_len is None or config.max_num_batched_tokens is None:
            raise ValueError(
                "the EngineConfig is not resolved: max_model_len and max_num_batched_tokens "
                "must be set (EngineConfig.resolved() sets them)"
            )
        # Every knob has the same name in both configs.
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


class Scheduler:
    """Decides each step which requests compute how many tokens, and applies the results."""

    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        spec: DraftPlanner | None = None,
        kv_layout: KVLayout | None = None,
        kv_connector: KVConnectorScheduler | None = None,
        *,
        connector_name: str = "connector",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.draft_planner = spec
        """Speculative decoding (None: off; nothing of it runs)."""
        """Requests of the step being scheduled that verify drafts."""
        self._grouped = kv_layout is not None and not kv_layout.is_one_full_group
        """Several KV-cache groups, or a window group: per-group tables (else the one plain
        table, which costs nothing new)."""
        self.kv: KVCacheManager
        if kv_layout is not None and self._grouped:
            self.kv = GroupedKVCacheManager(
                num_blocks,
                config.block_size,
                kv_layout,
                enable_caching=config.enable_prefix_caching,
                tokens_per_step=config.max_num_batched_tokens,
            )
        else:
            self.kv = KVCacheManager(
                num_blocks, config.block_size, enable_caching=config.enable_prefix_caching
            )
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        """Tokens computed again after a preemption (what preemption cost)."""
        self.victim_policy = make_victim_policy(
            config.preemption_victim, priority=config.scheduling_policy == "priority"
        )
        self._prefill_limits = bool(
            config.max_num_partial_prefills or config.max_long_partial_prefills
        )
        self._num_prefills = 0
        self._num_long_prefills = 0
        """This step's prefilling requests so far, and the long ones (with the limits on)."""
        reserve = admission.short_reserve_tokens(
            config.max_num_partial_prefills,
            config.max_long_partial_prefills,
            config.long_prefill_token_threshold,
        )
        self._short_reserve = (
            min(self.kv.blocks_for_tokens(reserve), self.kv.num_usable_blocks // 2)
            if reserve
            else 0
        )
        """Blocks a long prompt leaves free for short prefills when admitted (see
        ``admission.short_reserve_tokens``; at most half the cache; 0: none)."""
        self._promised = 0
        """Blocks that the prefills under way still need: admission leaves them free (a prompt
        admitted on blocks another one's next chunks need would preempt it)."""
        self._refused: list[FinishedRequest] = []
        """Requests ended in schedule() because they can never fit, until taken."""
        self.num_constrained = 0
        """Live requests with structured outputs (0: no step needs a grammar bitmask)."""
        self._priority = config.scheduling_policy == "priority"
        # Batch order of the last schedule(), zipped with the backend's output in update.
        self._scheduled: list[Request] = []
        self._async = bool(config.async_scheduling)
        # Async scheduling: the batch order of each step scheduled and not yet applied, oldest
        # first (at most two: the one in flight and the one just scheduled).
        self._unapplied: deque[list[Request]] = deque()
        # Reported to the backend with the next schedule().
        self._finished_req_ids: list[str] = []
        self._preempted_req_ids: list[str] = []
        self._max_loras = config.max_loras if config.enable_lora else 0
        """LoRA: most distinct adapters running (0: LoRA off; nothing of it runs)."""
        self.lora_ready: Container[int] = frozenset()
        """LoRA: the adapters whose ``Backend.add_lora`` returned (set by the engine core): a
        request of any other adapter waits in the queue."""
        self.lora_users: dict[int, int] = {}
        """LoRA: live requests (waiting or running) per adapter."""
        self.lora_running: dict[int, int] = {}
        """LoRA: running requests per adapter (at most ``max_loras`` keys)."""
        self._lora_ids: tuple[int, ...] | None = None
        """The running adapters, sorted (``SchedulerOutput.lora_ids``); None when the set
        changed since it was last built."""
        self.connector: ConnectorCore | None = None
        """The KV connector's hooks (None: no connector; nothing of it runs)."""
        if kv_connector is not None:
            self.connector = ConnectorCore(
                kv_connector,
                self.kv,
                block_size=config.block_size,
                failure_policy=config.kv_load_failure_policy,
                lease_s=config.kv_lease_s,
                max_parked_fraction=config.kv_max_parked_fraction,
                clock=clock,
                name=connector_name,
            )

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request (WAITING, or WAITING_FOR_GRAMMAR until its grammar is set and
        it moves to WAITING). Raises ``ValueError`` if a live request has the same id."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        status = request.status
        if not (
            status is RequestStatus.WAITING
            or (status is _WAITING_FOR_GRAMMAR and request.use_structured_output)
        ):
            expected = (
                "WAITING_FOR_GRAMMAR or WAITING" if request.use_structured_output else "WAITING"
            )
            raise ValueError(f"a new request must be {expected}, got {status.name}")
        self.requests[request.request_id] = request
        self.waiting.add(request)
        lora_id = request.lora_int_id
        if lora_id:
            if not self._max_loras:
                raise ValueError("a request names a LoRA adapter but LoRA is off")
            count_in(self.lora_users, lora_id)
        if request.use_structured_output:
            self.num_constrained += 1

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> list[Request]:
        """End live requests (an abort by default); unknown or finished ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        ended = []
        # Mutation testing: starting True (filtering without a running request ended) is an
        # equivalent mutant.
        any_running = False  # pragma: no mutate
        try:
            for request_id in list(request_ids):  # a copy: may be a view of self.requests
                request = self.requests.get(request_id)
                if request is None:
                    continue
                was_running = request.status == _RUNNING
                was_parked = request.status is _PARKED
                request.set_status(status)  # first: an invalid transition changes nothing
                if was_running:
                    any_running = True
                    if request.lora_int_id:
                        self._lora_stopped(request.lora_int_id)
                elif not was_parked:  # a parked request is in no queue
                    # Mutation testing: the queues count discarded requests without reading
                    # them (the finished status marks them), so the argument is not pinned.
                    self.waiting.discard(request)  # pragma: no mutate
                self._free(request)
                ended.append(request)
        finally:
            if any_running:
                self.running = [r for r in self.running if r.status is _RUNNING]
        return ended

    def _free(self, request: Request) -> dict[str, Any] | None:
        """Release a finished request (its blocks, its grammar); returns the KV connector's
        transfer parameters for it, if any."""
        params = None
        if self.connector is not None:
            # First: the connector may hold (pin) its blocks while it saves them.
            params = self.connector.request_finished(request)
        self.kv.free(request)
        if request.recompute_until and request.num_computed_tokens:
            # Admitted since its preemption (a queued request has computed nothing): it ended
            # before it had computed again all that its admission counted.
            self._forgive_recompute(request)
        del self.requests[request.request_id]
        self._finished_req_ids.append(request.request_id)
        if request.lora_int_id:
            count_out(self.lora_users, request.lora_int_id)
        if request.use_structured_output:
            self.num_constrained -= 1
            request.grammar = None
        return params

    def _lora_stopped(self, lora_id: int) -> None:
        """A running request of adapter ``lora_id`` stopped running."""
        count_out(self.lora_running, lora_id)
        if lora_id not in self.lora_running:
            self._lora_ids = None

    def _end_by_connector(self, request: Request) -> None:
        """End a request the KV connector failed (its error is already reported): it is in
        no queue and holds no parked load."""
        if request.status is _RUNNING and request.lora_int_id:
            self._lora_stopped(request.lora_int_id)
        request.set_status(_ERROR)
        self._free(request)

    @property
    def connector_needs_step(self) -> bool:
        """Whether the KV connector needs a step to run even with no tokens (transfers in
        flight, cancellations to send)."""
        connector = self.connector
        return connector is not None and connector.needs_step

    def take_connector_ended(self) -> list[FinishedRequest]:
        """Requests the KV connector ended since the last call (to report)."""
        connector = self.connector
        if connector is None or not connector.ended:
            return []
        ended, connector.ended = connector.ended, []
        return ended

    @property
    def scheduled(self) -> list[Request]:
        """The requests of the last :meth:`schedule`, in batch order (until its output is
        applied)."""
        return self._scheduled

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Queued requests, with those parked for a KV load."""
        connector = self.connector
        return len(self.waiting) + (len(connector.parked) if connector is not None else 0)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- scheduling -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch and advance ``num_computed_tokens`` optimistically.

        With async scheduling the previous step may still be in flight: a request that samples
        a token in it counts that token as a placeholder (``num_output_placeholders``), computed
        in this step like a known one; one that surely ends with it (its length cap) is left out.

        1. Running requests catch up, in admission order (:meth:`_schedule_running`); one whose
           blocks do not fit preempts the victim policy's choice, or itself, until they do (or
           ends with an error when it can never fit); with the partial-prefill limits a prefill
           past them waits a step.
        2. Waiting requests are admitted while the budget, ``max_num_seqs`` and the free blocks
           allow (:meth:`_schedule_waiting`), unless step 1 preempted: in queue order, those
           behind one whose blocks are not free going first for at most ``max_bypass_steps``
           steps; one that can never fit is refused (:meth:`take_refused`).
        3. The output is built once, in batch order: running requests, then admitted ones.

        NOTE: nothing is admitted in a step that preempted, even a waiting request that would
        fit (as vLLM does): the pool is short of blocks and the preempted requests are first in
        the queue.
        """
        max_tokens = self.config.max_num_batched_tokens
        if self.connector is not None and (self.connector.parked or self.connector.pins):
            self.connector.expire(self.waiting)
        entries: list[Any] = []
        budget, any_preempted = self._schedule_running(max_tokens, entries)
        new_reqs: list[NewRequestData] = []
        admitted: list[Request] = []
        if not any_preempted:
            budget = self._schedule_waiting(budget, new_reqs, admitted)
        output = self._make_output(entries, new_reqs, admitted, max_tokens - budget)
        if self.lora_running:
            lora_ids = self._lora_ids
            if lora_ids is None:
                lora_ids = self._lora_ids = tuple(sorted(self.lora_running))
            output.lora_ids = lora_ids
        return output

    def _schedule_running(self, budget: int, entries: list[Any]) -> tuple[int, bool]:
        """Let running requests catch up, in admission order, appending their entries; returns
        the budget left and whether anything was preempted."""
        threshold = self.config.long_prefill_token_threshold
        kv = self.kv
        allocate_slots = kv.allocate_slots
        grouped = self._grouped
        spec = self.draft_planner
        if spec is not None:
            spec.plan(self.running, budget)
        limits = self._prefill_limits
        if limits:
            self._num_prefills = self._num_long_prefills = 0
        promised = 0
        # Mutation testing: None is an equivalent start (only its truth is read).
        any_preempted = False  # pragma: no mutate
        # NOTE: preemption rebinds self.running to a new list instead of editing it, so this
        # loop walks the list it started with, and a victim still ahead in it is skipped by its
        # status: no index to fix up.
        # Mutation testing: `budget < 0`, `num_new >= threshold` and `num_new >= budget` below
        # are equivalent mutants (a budget of 0 leaves num_new 0; capping at an equal value).
        for request in self.running:
            if budget <= 0:
                break
            if request.status is not _RUNNING:
                continue  # preempted for a request before it
            computed = request.num_computed_tokens
            num_tokens = len(request.all_token_ids)
            placeholders = request.num_output_placeholders
            if placeholders:
                num_tokens += placeholders
                if (
                    num_tokens - request.num_prompt_tokens >= request.max_tokens
                    or num_tokens >= self.config.max_model_len
                ):
                    continue  # its step in flight ends it
            num_new = num_tokens - computed
            if limits and num_new > 1:
                if self._prefill_blocked(num_new):
                    continue  # the step's prefill slots are taken
                self._count_prefill(num_new)
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                continue
            num_slots = num_new
            if spec is not None and num_new == num_tokens - computed == 1:
                # Decoding: it verifies drafts, or its drafter writes KV ahead.
                num_new, num_slots = spec.tokens_for(request, self._draft_cap(request, budget))
            num_blocks_before = len(request.blocks)
            # NOTE: while/else: the else runs once the blocks fit, not after the break (the
            # request preempted itself: nothing fits; with priority, a later request may).
            while not allocate_slots(request, num_slots):
                if self._refuse_if_never_fits(request):
                    break  # it outgrew the cache: preempting others would not help
                victim = self._pick_victim(request)
                budget += self._preempt_running(victim, entries)
                any_preempted = True
                if victim is request:
                    break
            else:
                blocks = request.blocks
                if len(blocks) == num_blocks_before:
                    new_block_ids = None
                elif grouped:
                    new_block_ids = kv.table_ids(request, num_blocks_before)
                else:
                    new_block_ids = [b.block_id for b in blocks[num_blocks_before:]]
                entries += (request, request.request_id, new_block_ids, computed, num_new)
                request.num_computed_tokens = computed + num_new
                if computed + num_new < num_tokens:  # its prefill goes on: blocks it will need
                    promised += kv.blocks_to_finish(request, num_tokens)
                if self._async and computed + num_new == num_tokens:
                    request.num_output_placeholders = placeholders + 1
                if spec is not None and computed + num_new >= num_tokens:
                    spec.sampling(request)
                budget -= num_new
        self._promised = promised
        return budget, any_preempted

    def _draft_cap(self, request: Request, budget: int) -> int:
        """The most tokens a decoding request may compute this step with its drafts: never past
        ``max_tokens``, ``max_model_len``, the budget or the long-prefill threshold, even if
        every draft is accepted."""
        num_tokens = len(request.all_token_ids)
        config = self.config
        cap = min(
            request.max_tokens - (num_tokens - request.num_prompt_tokens),
            config.max_model_len - num_tokens,
            budget,
        )
        if config.long_prefill_token_threshold:
            cap = min(cap, config.long_prefill_token_threshold)
        return cap

    def _schedule_waiting(
        self, budget: int, new_reqs: list[NewRequestData], admitted: list[Request]
    ) -> int:
        """Admit waiting requests in queue order while the budget, ``max_num_seqs`` and the
        free blocks allow; returns the budget left. One whose blocks are not free is set aside
        and those behind it may go first (:meth:`_may_bypass`); one that can never fit is
        refused; with the partial-prefill limits a long prompt past them waits."""
        config = self.config
        threshold = config.long_prefill_token_threshold
        limits = self._prefill_limits
        kv = self.kv
        waiting = self.waiting
        running = self.running
        skipped: list[Request] = []
        blocked: list[tuple[Request, int]] = []
        # Tokens to compute of the smallest request whose blocks were not free this step (one
        # with as many cannot fit either: not tried), and how many allocations failed.
        smallest_blocked = -1
        num_failed = 0
        short_reserve = self._short_reserve
        max_loras = self._max_loras
        lora_running = self.lora_running
        # With max_loras adapters running: the queued requests of the others, which cannot run
        # in this step (the set of running adapters is fixed from then on). -1: not counted.
        capped = -1
        while budget > 0 and len(running) < config.max_num_seqs:
            if max_loras and len(lora_running) >= max_loras:
                if capped < 0:
                    capped = waiting.count_outside(lora_running)
                if capped >= len(waiting):
                    break  # every request left waits for an adapter slot: no need to look
            request = waiting.peek()
            if request is None:
                break
            lora_id = request.lora_int_id
            if request.status == _WAITING_FOR_GRAMMAR or request.num_output_placeholders:
                # Neither holds up the others: a grammar still compiling, or (async scheduling)
                # a request preempted while a step computes its next token, which it must have
                # before it resumes.
                skipped.append(waiting.pop())
                if capped > 0 and lora_id and lora_id not in lora_running:
                    capped -= 1
                continue
            if max_loras and lora_id:
                if lora_id not in self.lora_ready:
                    skipped.append(waiting.pop())  # its adapter is loading
                    if capped > 0 and lora_id not in lora_running:
                        capped -= 1
                    continue
                if lora_id not in lora_running and len(lora_running) >= max_loras:
                    # max_loras other adapters run: it waits for one of them to end. Those
                    # behind it of a running adapter go first, for at most max_bypass_steps.
                    # It and the capped requests right behind it are set aside in one go.
                    # NOTE: take_capped's test (request_queue._waits_for_a_slot) is the checks
                    # above that lead here: a new reason to skip a request belongs in both.
                    if request.num_bypassed_steps >= config.max_bypass_steps:
                        break
                    run = [waiting.pop()]
                    run += waiting.take_capped(
                        lora_running, self.lora_ready, config.max_bypass_steps
                    )
                    num_admitted = len(admitted)
                    blocked.extend((r, num_admitted) for r in run)
                    skipped += run
                    capped -= len(run)
                    continue
            connector = self.connector
            hits: Any
            if connector is not None and request.request_id in connector.loaded:
                # Its load was reported: it holds its blocks and its computed tokens.
                hits, num_hit_tokens = [], request.num_computed_tokens
            else:
                hits, num_hit_tokens = kv.get_computed_blocks(request)
                if 0 <= smallest_blocked <= len(request.all_token_ids) - num_hit_tokens:
                    # A smaller request's blocks were not free: its cannot be. Set aside
                    # untried (not overtaken: it could not go), unless it holds the queue.
                    if (
                        request.num_bypassed_steps >= config.max_bypass_steps
                        or len(skipped) >= admission.MAX_SET_ASIDE_PER_STEP
                    ):
                        break
                    skipped.append(waiting.pop())
                    continue
                if connector is not None:
                    outcome = connector.try_park(
                        request, hits, num_hit_tokens, keep_free=self._promised
                    )
                    if outcome == NO_ROOM:
                        if self._refuse_if_never_fits(request):
                            continue
                        if not running and connector.release_for(request, waiting):
                            smallest_blocked = -1  # blocks were given back: try them all again
                            continue
                        num_failed += 1
                        smallest_blocked = len(request.all_token_ids) - num_hit_tokens
                        if not self._may_bypass(request, blocked, len(admitted), num_failed):
                            break
                        skipped.append(waiting.pop())
                        continue
                    if outcome is not None:
                        waiting.pop()
                        if outcome == ENDED:
                            request.set_status(_ERROR)
                            self._free(request)
                        continue  # PARKED: it waits for its load, out of the queue
            num_new = len(request.all_token_ids) - num_hit_tokens
            keep_free = self._promised
            if (
                short_reserve
                and num_new > threshold
                and running
                and request.num_bypassed_steps < config.max_bypass_steps
            ):
                # A long prompt leaves the short prefill slots their blocks (not once it was
                # overtaken long enough, nor with nothing running: it would wait for nothing).
                keep_free += short_reserve
            if limits:
                why = self._prefill_blocked(num_new)
                if why == "all":
                    break
                if why == "long":
                    skipped.append(waiting.pop())  # shorter prompts behind it may go
                    continue
            # Mutation testing: `>=` in this test and the next is equivalent (capping at an
            # equal value).
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                if not config.enable_chunked_prefill:
                    break  # the prompt must go in whole; nobody overtakes it
                num_new = budget
            if not kv.allocate_slots(
                request, num_new, hits, full_sequence_must_fit=True, keep_free=keep_free
            ):
                if self._refuse_if_never_fits(request):
                    continue
                if (
                    connector is not None
                    and not running
                    and connector.release_for(request, waiting)
                ):
                    smallest_blocked = -1
                    continue  # a stuck parked load gave its blocks back: try again
                num_failed += 1
                smallest_blocked = len(request.all_token_ids) - num_hit_tokens
                if not self._may_bypass(request, blocked, len(admitted), num_failed):
                    break
                skipped.append(waiting.pop())
                continue
            waiting.pop()
            if connector is not None:
                connector.admitted(request)
            self._admit(request, num_hit_tokens, num_new, admitted, new_reqs)
            if request.num_computed_tokens < len(request.all_token_ids):
                self._promised += kv.blocks_to_finish(request, len(request.all_token_ids))
            budget -= num_new
        for request, num_admitted_before in blocked:
            if len(admitted) > num_admitted_before:
                request.num_bypassed_steps += 1
        if skipped:
            waiting.add_front_all(skipped)
        return budget

    def _admit(
        self,
        request: Request,
        num_hit_tokens: int,
        num_new: int,
        admitted: list[Request],
        new_reqs: list[NewRequestData],
    ) -> None:
        """Move a waiting request whose blocks were allocated into the running batch."""
        kv = self.kv
        request.set_status(_RUNNING)
        self.running.append(request)
        admitted.append(request)
        lora_id = request.lora_int_id
        if lora_id:
            if lora_id not in self.lora_running:
                self._lora_ids = None
            count_in(self.lora_running, lora_id)
        request.num_computed_tokens = num_hit_tokens + num_new
        request.num_bypassed_steps = 0
        if request.recompute_until > num_hit_tokens:  # after a preemption: computed again
            self.num_recomputed_tokens += request.recompute_until - num_hit_tokens
        if self._prefill_limits:
            self._count_prefill(len(request.all_token_ids) - num_hit_tokens)
        if self._async and request.num_computed_tokens == len(request.all_token_ids):
            request.num_output_placeholders = 1
        if self.draft_planner is not None and request.num_computed_tokens == len(
            request.all_token_ids
        ):
            self.draft_planner.sampling(request)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        kv.record_admission(request, num_hit_tokens)
        new_reqs.append(
            NewRequestData(
                request.request_id,
                request.prompt_token_ids,
                request.sampling_params,
                kv.table_ids(request),
                num_hit_tokens,
                num_new,
                request.output_token_ids,  # after a preemption or a resume elsewhere
                list(request.eos_token_ids),
                lora_id,
            )
        )

    # -- admission rules (see engine_core._core.admission) --------------------------------------

    def _may_bypass(
        self,
        request: Request,
        blocked: list[tuple[Request, int]],
        num_admitted: int,
        num_failed: int,
    ) -> bool:
        """Whether requests behind ``request``, whose blocks are not free, may be admitted
        before it in this step: not once it was overtaken in ``max_bypass_steps`` steps (it
        then goes first as soon as its blocks are free), nor once ``num_failed``, the step's
        failed allocations, passed a few, nor with no block free. Records it in ``blocked``
        when they may."""
        limit = self.config.max_bypass_steps
        if (
            request.num_bypassed_steps >= limit
            or num_failed > admission.MAX_BLOCKED_PER_STEP
            or self.kv.num_free_blocks == 0
        ):
            return False
        blocked.append((request, num_admitted))
        return True

    def _refuse_if_never_fits(self, request: Request) -> bool:
        """End ``request`` with finish_reason "error" if its tokens can never fit in the cache
        (it outgrew a cache that shrank, or never fitted); reported by :meth:`take_refused`."""
        problem = admission.never_fits(self.kv, request, self.config.max_model_len)
        if problem is None:
            return False
        if request.status is _RUNNING:
            self.running = [r for r in self.running if r is not request]
            if request.lora_int_id:
                self._lora_stopped(request.lora_int_id)
        else:
            self.waiting.discard(request)  # it stays in the queue, finished: skipped there
        request.error = problem
        request.set_status(_ERROR)
        self._free(request)
        self._refused.append(FinishedRequest(request.request_id, "error", None, problem))
        return True

    def take_refused(self) -> list[FinishedRequest]:
        """The requests :meth:`schedule` refused since the last call (they can never fit)."""
        refused, self._refused = self._refused, []
        return refused

    def _prefill_blocked(self, num_remaining: int) -> str | None:
        """Whether a request with ``num_remaining`` tokens to prefill must wait for a later
        step: ``"all"`` (``max_num_partial_prefills`` are prefilling), ``"long"`` (it is long
        and ``max_long_partial_prefills`` long ones are), or None."""
        config = self.config
        if 0 < config.max_num_partial_prefills <= self._num_prefills:
            return "all"
        if (
            0 < config.max_long_partial_prefills <= self._num_long_prefills
            and num_remaining > config.long_prefill_token_threshold
        ):
            return "long"
        return None

    def _count_prefill(self, num_remaining: int) -> None:
        self._num_prefills += 1
        if num_remaining > self.config.long_prefill_token_threshold:
            self._num_long_prefills += 1

    def _make_output(
        self,
        entries: list[Any],
        new_reqs: list[NewRequestData],
        admitted: list[Request],
        total: int,
    ) -> SchedulerOutput:
        """The step's output, from the running entries and the admitted requests; their batch
        order is kept for :meth:`update_from_output`."""
        cached = CachedRequestData(
            entries[1::_ENTRY], entries[2::_ENTRY], entries[3::_ENTRY], entries[4::_ENTRY]
        )
        running = entries[0::_ENTRY]
        self._scheduled = running + admitted
        spec = self.draft_planner
        drafts = spec.finish_plan(self._scheduled, running) if spec is not None else None
        meta = None
        connector = self.connector
        if connector is not None:
            meta = connector.build(
                self._scheduled,
                entries[3::_ENTRY] + [r.num_computed_tokens for r in new_reqs],
                self._end_by_connector,
            )
            if total == 0 and (meta is not None or connector.needs_step):
                # No tokens, but transfers to start or to hear of: a step of the connector only.
                if self._async:
                    self._unapplied.append(self._scheduled)
                return SchedulerOutput(new_reqs, cached, 0, kv_connector_metadata=meta)
        if self._async and total:
            self._unapplied.append(self._scheduled)
        if total == 0:
            # Nothing runs this step: the backend hears of the ended and preempted requests with
            # the next step that does.
            return SchedulerOutput(new_reqs, cached, 0)
        finished_ids, self._finished_req_ids = self._finished_req_ids, []
        preempted_ids, self._preempted_req_ids = self._preempted_req_ids, []
        if drafts is not None:
            if drafts.spec_token_ids:
                cached.spec_token_ids = drafts.spec_token_ids
            if drafts.draft_req_ids:
                return SchedulerOutput(
                    new_reqs,
                    cached,
                    total,
                    finished_ids,
                    preempted_ids,
                    drafts.num_draft_tokens,
                    drafts.draft_req_ids,
                    meta,
                )
        if meta is not None:
            return SchedulerOutput(
                new_reqs,
                cached,
                total,
                finished_ids,
                preempted_ids,
                drafts.num_draft_tokens if drafts is not None else 0,
                None,
                meta,
            )
        return SchedulerOutput(new_reqs, cached, total, finished_ids, preempted_ids)

    def _pick_victim(self, requester: Request) -> Request:
        """The running request to preempt for ``requester`` (``EngineConfig.preemption_victim``,
        see ``engine_core._core.preemption``)."""
        return self.victim_policy.pick(self.running, requester)

    def _preempt_running(self, victim: Request, entries: list[Any]) -> int:
        """Preempt a running request for the one :meth:`_schedule_running` is at, taking back
        the victim's entry in this step's batch if it has one; returns the tokens that gives
        back to the budget."""
        running = self.running
        # New lists, not edits: see _schedule_running.
        if victim is running[-1]:
            # NOTE: no entry to look for: the loop walks the running requests in order and is
            # at one still running, so it has not reached the last one yet (or is at it).
            self.running = running[:-1]
            num_returned = 0
        else:
            k = running.index(victim)
            self.running = running[:k] + running[k + 1 :]
            num_returned = self._unschedule(victim, entries)
        self._preempt(victim)
        self._preempted_req_ids.append(victim.request_id)
        return num_returned

    def _unschedule(self, victim: Request, entries: list[Any]) -> int:
        """Take back ``victim``'s entry in this step's batch, if it has one; returns its tokens."""
        try:
            k = entries[0::_ENTRY].index(victim) * _ENTRY
        except ValueError:
            return 0  # not scheduled in this step
        computed, num_new = entries[k + 3], entries[k + 4]
        del entries[k : k + _ENTRY]
        if victim.samples_in_flight:
            victim.num_output_placeholders -= 1  # the token it was to sample in this step
        victim.num_computed_tokens = computed  # its tokens of this step are not computed
        # The blocks it registered for this step's tokens will not be computed.
        self.kv.uncache_uncomputed(victim, computed)
        return num_new

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the KV, go back to the waiting queue at its place
        (ahead of later arrivals; by priority, then arrival). What it had computed is owed as
        recomputed tokens, counted when it is admitted again. With a KV connector that stores
        blocks, resuming is then a load."""
        if self.connector is not None:
            self.connector.request_preempted(request)
        self.kv.free(request)
        if self.draft_planner is not None:
            self.draft_planner.unscheduled(request)
        if request.lora_int_id:
            self._lora_stopped(request.lora_int_id)
        request.set_status(_PREEMPTED)
        self._forgive_recompute(request)
        request.recompute_until = max(request.recompute_until, request.num_computed_tokens)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.requeue(request)

    def _forgive_recompute(self, request: Request) -> None:
        """Take back the recomputed tokens counted at its admission that it did not compute
        (preempted again, or ended, before it caught up)."""
        owed = request.recompute_until - request.num_computed_tokens
        if owed > 0:
            self.num_recomputed_tokens -= owed

    # -- applying a step's results --------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens, check stop conditions, free finished requests.

        For each request of the batch, in batch order:

        1. skip it if it was aborted while the step ran, or got no token (a prefill chunk);
           roll back the positions of its rejected drafts (``DraftPlanner.verify_step``);
        2. append its tokens up to the first that ends it (stop rules: those of
           :meth:`Request.append_output_token`, and the grammar's: :meth:`_append_constrained`);
        3. report the tokens kept (with their logprobs, and the prefix-cache hits on its first);
        4. free it if it ended (:meth:`_finish`); else hand its tokens and a backend proposer's
           drafts to the draft planner.

        With async scheduling the step is the oldest one not yet applied; its tokens replace
        placeholders, and a request preempted since it was scheduled still gets its token.
        """
        sampled = runner_output.sampled_token_ids
        scheduled = self._batch_to_apply(len(sampled))
        if self.connector is not None:
            self.connector.apply_report(
                runner_output.kv_connector_report, self.waiting, self._end_by_connector
            )
        out = EngineCoreOutputs()
        out_ids, out_tokens = out.req_ids, out.new_token_ids
        logprobs = runner_output.logprobs
        spec = self.draft_planner
        backend_drafts = runner_output.draft_token_ids
        max_model_len = self.config.max_model_len
        # Mutation testing: starting True (filtering when nothing ended) is equivalent.
        any_finished = False  # pragma: no mutate
        for index, request in enumerate(scheduled):
            # 1. Skip what has nothing to apply; roll back the rejected drafts' positions
            #    (computed, but not the request's).
            if request.status is not _RUNNING and request.status is not _PREEMPTED:
                continue  # aborted while the step ran
            tokens = sampled[index]
            if not tokens:
                continue  # partial prefill chunk
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            if spec is not None:
                request.num_computed_tokens -= spec.verify_step(request, tokens)
            # 2. Append up to the first token that ends it.
            num_before = len(request.all_token_ids)
            grammar = request.grammar
            if grammar is None:
                # Mutation testing: tokens is not empty, so the loop always sets it.
                status = None  # pragma: no mutate
                for token in tokens:
                    status = request.append_output_token(token, max_model_len)
                    if status is not None:
                        break
            else:
                status = self._append_constrained(request, tokens, grammar)
            kept = len(request.all_token_ids) - num_before
            if kept != len(tokens):
                tokens = tokens[:kept]
            # 3. Report what was kept.
            request_id = request.request_id
            if kept:
                out_ids.append(request_id)
                out_tokens.append(tokens)
                if num_before == request.num_prompt_tokens:  # its first tokens
                    out.num_cached_tokens[request_id] = request.num_cached_tokens
                if logprobs is not None and logprobs[index]:
                    out.logprobs[request_id] = logprobs[index][:kept]  # type: ignore[index]
            # 4. Free it if it ended; else its drafts for the next step.
            if status is not None:
                self._finish(request, status, out)
                any_finished = True
            elif spec is not None:
                spec.after_tokens(
                    request, tokens, backend_drafts[index] if backend_drafts is not None else None
                )
        if runner_output.prompt_logprobs:
            self._add_prompt_logprobs(
                scheduled, scheduler_output, runner_output.prompt_logprobs, out
            )
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return out

    def _batch_to_apply(self, num_results: int) -> list[Request]:
        """The batch whose results arrived (``num_results`` of them): the step scheduled last,
        or with async scheduling the oldest one not yet applied."""
        if self._async:
            if not self._unapplied:
                raise RuntimeError("update_from_output without a step in flight")
            scheduled = self._unapplied.popleft()
        else:
            scheduled = self._scheduled
            self._scheduled = []
        if num_results != len(scheduled):
            raise RuntimeError(
                f"backend returned {num_results} results for a batch of {len(scheduled)}"
            )
        return scheduled

    def _finish(self, request: Request, status: RequestStatus, out: EngineCoreOutputs) -> None:
        """End a request that stopped in this step (a running one stays in ``self.running``
        until the caller filters it out; one preempted since leaves the queue) and report it."""
        if request.status is _PREEMPTED:
            self.waiting.discard(request)
        elif request.lora_int_id:
            self._lora_stopped(request.lora_int_id)
        request.set_status(status)
        params = self._free(request)
        spec = request.drafting
        out.finished.append(
            FinishedRequest(
                request.request_id,
                FINISH_REASONS[status],
                request.stop_reason,
                request.error,
                kv_transfer_params=params,
            )
            if spec is None
            else FinishedRequest(
                request.request_id,
                FINISH_REASONS[status],
                request.stop_reason,
                request.error,
                False,
                spec.num_drafts,
                spec.num_draft_tokens,
                spec.num_accepted_tokens,
                kv_transfer_params=params,
            )
        )

    def _append_constrained(
        self, request: Request, tokens: list[int], grammar: GrammarMatcher
    ) -> RequestStatus | None:
        """Append sampled tokens that the request's grammar accepts, one at a time, checking
        stops; returns the status it ends with, or None.

        The rules, in order, after each token:

        1. a token the grammar rejects is dropped and ends the request as an error;
        2. a stop token ends it as stopped (the rules of :meth:`Request.append_output_token`);
        3. a grammar that accepted its closing EOS ends it as stopped (also with ``ignore_eos``:
           a complete grammar allows only EOS), even on the token that reaches the length cap;
        4. the length cap (the rules of :meth:`Request.append_output_token`);
        5. a grammar complete before ``min_tokens``, whose EOS the backend then masks, ends it as
           an error (nothing could be sampled next).
        """
        max_model_len = self.config.max_model_len
        for token in tokens:
            if not grammar.accept_token(token):
                request.error = (
                    f"the backend sampled token {token}, which the structured_outputs grammar "
                    "does not allow here"
                )
                return _ERROR
            status = request.append_output_token(token, max_model_len)
            if status is _STOPPED or grammar.terminated:
                return _STOPPED
            if status is not None:
                return status
            num_output = len(request.all_token_ids) - request.num_prompt_tokens
            if (
                num_output < request.min_tokens
                and grammar.is_stopped()
                and grammar.eos_token_ids <= request.stop_token_ids
            ):
                request.error = (
                    f"the structured_outputs grammar is complete after {num_output} tokens, "
                    f"fewer than min_tokens ({request.min_tokens})"
                )
                return _ERROR
        return None

    @staticmethod
    def _add_prompt_logprobs(
        scheduled: list[Request],
        scheduler_output: SchedulerOutput,
        prompt_logprobs: dict[str, list[TokenLogprobs | None]],
        out: EngineCoreOutputs,
    ) -> None:
        """Forward prompt logprobs once per position: a request preempted during its prefill
        recomputes positions whose logprobs were already sent. The positions are those the
        step computed (with async scheduling a later step may already be scheduled)."""
        by_id = {r.request_id: r for r in scheduled if r.status != RequestStatus.FINISHED_ABORTED}
        cached = scheduler_output.cached
        # Mutation testing: the columns are built together (equal lengths), so dropping or
        # weakening `strict` is equivalent.
        ends = {
            req_id: computed + num
            for req_id, computed, num in zip(
                cached.req_ids,
                cached.num_computed_tokens,
                cached.num_scheduled_tokens,
                strict=True,  # pragma: no mutate
            )
        }
        for new in scheduler_output.new_reqs:
            ends[new.req_id] = new.num_computed_tokens + new.num_scheduled_tokens
        for request_id, entries in prompt_logprobs.items():
            request = by_id.get(request_id)
            # Mutation testing: every request of the batch is in `ends` (both come from the
            # same step), so `and` for the last `or` is equivalent; the test is a guard.
            if request is None or not entries or request_id not in ends:
                continue
            end = min(ends[request_id], request.num_prompt_tokens)
            start = end - len(entries)
            skip = request.num_prompt_logprobs_sent - start
            # Mutation testing: `skip >= 0` is equivalent (entries[0:]).
            if skip > 0:
                entries = entries[skip:]
            if entries:
                out.prompt_logprobs[request_id] = entries
                request.num_prompt_logprobs_sent = end

    # -- control --------------------------------------------------------------------------------

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget all cached prefixes. Fails (False) while requests hold blocks, unless
        ``reset_running_requests`` preempts them first (they resume from scratch, in order)."""
        if reset_running_requests:
            for request in reversed(self.running):  # add_front: they end up in order
                self._preempt(request)
            self._preempted_req_ids.extend(r.request_id for r in self.running)
            self.running = []
        if self.connector is not None:
            self.connector.reset()
        return self.kv.reset_prefix_cache()
