"""``EngineCore``: the scheduler and the backend, stepped together. No event loop, no sockets.

A step is: schedule -> ``execute_model`` -> grammar bitmask -> ``sample_tokens`` -> apply aborts
that arrived meanwhile -> ``update_from_output``. It has one path, in three parts:

1. :meth:`EngineCore.schedule` (the event loop's thread);
2. :meth:`EngineCore.launch_step`, the blocking part (the engine process runs it in a worker
   thread when the backend's step blocks, so requests and aborts keep arriving while the model
   runs): with sync scheduling it runs the step and returns it with its results; with async
   scheduling (a backend that supports it, ``EngineConfig.async_scheduling`` not False) it
   launches the new step and returns the one before it once its results are there, so one step
   stays in flight while the next is scheduled;
3. :meth:`EngineCore.complete_step` applies the aborts that arrived meanwhile, then the returned
   step's results, and (async) launches the newest step's sampling when its grammar bitmask
   needed those tokens.

:meth:`EngineCore.step` runs the three in a row (in-process callers). When the batch has
constrained requests and the backend's step blocks (``step_in_thread``), the grammar bitmask is
filled on a helper thread while ``execute_model`` runs, and handed to ``sample_tokens``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

import msgspec

from engine_core._core.admission import must_generate, refusal
from engine_core._core.drafts import DraftPlanner
from engine_core._core.engine_io import (
    DPEngineCoreOutputs,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineLoad,
    EngineStats,
    FinishedRequest,
    KVEvents,
    KVGroupStats,
    PauseMode,
)
from engine_core._core.kv_events import KVEventLog, snapshot
from engine_core._core.request import Request, RequestStatus
from engine_core._core.scheduler import Scheduler, SchedulerConfig
from engine_core._engine.lora_manager import LoRAManager
from engine_core._engine.startup import (
    kv_layout_of,
    resolve_async_scheduling,
    resolve_spec_support,
    setup_kv_connector,
    size_kv_cache,
)
from engine_core._plugins import load_backend, resolve_config
from engine_core._structured.manager import StructuredOutputManager
from engine_core.abc import (
    AsyncModelRunnerOutput,
    Backend,
    ModelRunnerOutput,
    SchedulerOutput,
)
from engine_core.config import EngineConfig
from engine_core.errors import EngineStalledError
from engine_core.lora import LoRAError, LoRARequest

__all__ = ["EngineCore"]

logger = logging.getLogger(__name__)


StepResults: TypeAlias = tuple[SchedulerOutput, ModelRunnerOutput]
"""A step that ran, with its results: what :meth:`EngineCore.complete_step` applies."""


_CONNECTOR_POLL_S = 0.001
"""How long a step of the KV connector only (no tokens) that heard of nothing waits before the
next one."""


class _InFlight:
    """A launched step (async scheduling): its batch, the constrained requests that sample in
    it (their bitmask rows, in batch order; None: no bitmask) and its results' handle (None
    until its sampling is launched)."""

    __slots__ = ("scheduler_output", "rows", "handle")

    def __init__(self, scheduler_output: SchedulerOutput, rows: list[Request] | None) -> None:
        self.scheduler_output = scheduler_output
        self.rows = rows
        self.handle: AsyncModelRunnerOutput | None = None


def _shown_options(options: dict[str, Any]) -> dict[str, Any]:
    """The backend options worth a startup log: scalars (a mock's scripted replies or a fault
    plan are left out)."""
    return {k: v for k, v in options.items() if isinstance(v, str | int | float | bool)}


class EngineCore:
    """The engine: owns the backend and the scheduler and steps them.

    A step runs whole with :meth:`step`, or in three parts for a caller that runs the blocking
    middle elsewhere: :meth:`schedule`, :meth:`launch_step`, :meth:`complete_step`.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        backend_cls: type[Backend] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        if backend_cls is None:
            # "auto" becomes the backend it picks (with the options it needs here), which the
            # engine then reports by name.
            _, config = resolve_config(config)
        cls = backend_cls if backend_cls is not None else load_backend(config.backend, config)
        backend = cls(config)
        try:
            lora_support = backend.lora_support() if config.enable_lora else None
            if config.enable_lora and lora_support is None:
                raise ValueError(
                    f"enable_lora=True but the {config.backend} backend does not serve LoRA "
                    "adapters (its lora_support() is None)"
                )
            self.spec_support = resolve_spec_support(config, backend)
            self.async_scheduling = resolve_async_scheduling(config, backend)
            config = msgspec.structs.replace(config, async_scheduling=self.async_scheduling)
            self.kv_layout = kv_layout_of(config, backend)
            self.num_kv_blocks, config = size_kv_cache(config, backend, self.kv_layout)
            if self.kv_layout.per_layer:
                backend.initialize_kv_cache(  # type: ignore[call-arg]
                    self.num_kv_blocks, self.kv_layout.kv_groups
                )
            else:
                backend.initialize_kv_cache(self.num_kv_blocks)
            connector = setup_kv_connector(config, backend, self.kv_layout, self.num_kv_blocks)
        except BaseException:
            backend.close()
            raise
        self.backend = backend
        self.config = config
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None
        self.max_model_len: int = config.max_model_len
        self.vocab_size = backend.vocab_size()
        self._backend_settings = _shown_options(backend.resolved_settings())
        spec = None
        if config.speculative_config is not None and self.spec_support is not None:
            spec = DraftPlanner(config.speculative_config, self.spec_support)
        self.scheduler = Scheduler(
            SchedulerConfig.from_engine_config(config),
            self.num_kv_blocks,
            spec,
            self.kv_layout,
            connector,
            connector_name=config.kv_connector_name or "connector",
            clock=clock,
        )
        self.lora: LoRAManager | None = None
        """LoRA adapters (None: LoRA off)."""
        if lora_support is not None:
            self.lora = LoRAManager(config, backend, lora_support, self.scheduler.lora_users)
            self.scheduler.lora_ready = self.lora.loaded
        self.num_steps = 0
        self._in_flight: deque[_InFlight] = deque()
        """Async scheduling: launched steps whose results were not applied, oldest first."""
        self._device_busy_s = 0.0
        self._busy_since = 0.0
        self._measured_busy_s = 0.0
        self._all_measured = True
        """Every async step so far reported its device time."""
        self._ended_outside_steps: list[FinishedRequest] = []
        """Requests rejected at arrival, failed grammars and engine-initiated aborts, reported
        with the next step's outputs."""
        self._pending_aborts: list[str] = []
        self.num_malformed_messages = 0
        """Input frames that could not be decoded (counted by the engine process)."""
        self._structured: StructuredOutputManager | None = None
        self._grammar_waker: Callable[[], None] | None = None
        self._closed = False
        self.pause_mode: PauseMode | None = None
        """None while generating; else the mode of the last :meth:`pause_generation`."""
        self._progress_at = clock()
        """When a step last computed a token, or the engine last had nothing to do."""
        self._stall_logged = False
        """Whether the stall going on now was logged (once per stall)."""
        self._kv_events: KVEventLog | None = None
        self._host_events: KVEventLog | None = None
        if config.data_parallel_size > 1:
            # The front end routes by what each engine caches: report it with every step.
            self._kv_events = self.scheduler.kv.pool.events = KVEventLog()
            connector_half = self.scheduler.connector
            if connector_half is not None and hasattr(connector_half.connector, "events"):
                # The host tier's residency too: the router counts it as a cheaper hit.
                self._host_events = KVEventLog()
                connector_half.connector.events = self._host_events

    # -- requests -------------------------------------------------------------------------------

    def validate_request(self, request: EngineCoreRequest) -> str | None:
        """Why this engine cannot serve ``request``, or None."""
        prompt = request.prompt_token_ids
        if not prompt:
            return "the prompt is empty"
        if len(prompt) >= self.max_model_len:
            return (
                f"the prompt has {len(prompt)} tokens but max_model_len is {self.max_model_len} "
                "(at least one token must be generated)"
            )
        vocab = self.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:  # in C: the list is only made to report
            bad = [t for t in prompt if not (0 <= t < vocab)]
            return f"token ids {bad[:5]} are outside the vocabulary (size {vocab})"
        bad_stop = [t for t in request.sampling_params.stop_token_ids or () if t >= vocab]
        if bad_stop:
            return f"stop_token_ids {bad_stop[:5]} are outside the vocabulary (size {vocab})"
        bad_bias = [t for t in request.sampling_params.logit_bias or () if t >= vocab]
        if bad_bias:
            return f"logit_bias token ids {bad_bias[:5]} are outside the vocabulary (size {vocab})"
        # What the cache can hold now (it may have shrunk since the engine started).
        params = request.sampling_params
        resumed = len(request.resume_output_token_ids)
        owed = must_generate(params, params.max_tokens or 1 << 62) - resumed
        return refusal(self.scheduler.kv, len(prompt) + resumed, max(owed, 1), self.max_model_len)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue ``request``. A request this engine cannot serve ends at the next step with
        finish_reason "error" and a message; a live duplicate id raises ``ValueError``."""
        if not isinstance(request.request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request.request_id).__name__}")
        if self.pause_mode in (PauseMode.ABORT, PauseMode.WAIT):
            self._ended_outside_steps.append(
                FinishedRequest(
                    request.request_id,
                    "error",
                    None,
                    f"the engine is paused (mode '{self.pause_mode}'); retry after it resumes",
                    retryable=True,
                )
            )
            return
        problem = self.validate_request(request)
        lora = request.lora_request
        if problem is None and lora is not None:
            if self.lora is None:
                problem = (
                    f"LoRA adapter {lora.lora_name!r}: LoRA is off (start the engine with "
                    "enable_lora=True, or --enable-lora)"
                )
            else:
                conflict = self.lora.identity_conflict(lora)
                if conflict is not None:
                    problem = f"LoRA adapter {lora.lora_name!r}: {conflict}"
        if problem is not None:
            if request.request_id in self.scheduler.requests:
                raise ValueError(f"request_id {request.request_id!r} is already in use")
            self._ended_outside_steps.append(
                FinishedRequest(request.request_id, "error", None, problem)
            )
            return
        if not self.scheduler.requests:
            self._progress_at = self.clock()  # idle until now: no stall before it
        prompt = request.prompt_token_ids
        resumed = request.resume_output_token_ids
        new = Request(
            request.request_id,
            prompt + resumed if resumed else prompt,
            request.sampling_params,
            block_size=self.config.block_size,
            arrival_time=request.arrival_time or self.clock(),
            priority=request.priority,
            eos_token_ids=tuple(request.eos_token_ids),
            cache_salt=request.cache_salt,
            hash_blocks=self.config.enable_prefix_caching,
            lora_request=lora,
        )
        if resumed:
            # Another engine generated these: they count as output, and are not sent again.
            new.num_prompt_tokens = len(prompt)
        if request.kv_transfer_params is not None:
            new.kv_transfer_params = request.kv_transfer_params
        self.scheduler.add_request(new)
        if lora is not None:
            assert self.lora is not None
            self.lora.request_arrived(lora)
        if new.use_structured_output:
            error = self.structured_output.add(new)
            if error is not None:
                self._fail(new, error)
            elif new.grammar is not None:
                new.set_status(RequestStatus.WAITING)

    def reject_request(self, request_id: str, error: str) -> bool:
        """End ``request_id``, which could not be accepted, with finish_reason "error" and
        ``error`` at the next step. Returns False (and reports nothing) when a live request has
        that id: the error must not end it."""
        if request_id in self.scheduler.requests:
            return False
        self._ended_outside_steps.append(FinishedRequest(request_id, "error", None, error))
        return True

    # -- structured outputs ---------------------------------------------------------------------

    @property
    def structured_output(self) -> StructuredOutputManager:
        """Grammar compilation, cache and bitmask; created with the first constrained request
        (plain serving never loads llguidance or the tokenizer)."""
        if self._structured is None:
            self._structured = StructuredOutputManager(
                self.config.tokenizer_name,
                self.vocab_size,
                clock=self.clock,
                compile_timeout_s=self.config.grammar_compile_timeout_s,
            )
            self._structured.on_compiled = self._grammar_waker
        return self._structured

    def set_grammar_waker(self, waker: Callable[[], None] | None) -> None:
        """Call ``waker`` (from a compile thread; it must not block) whenever a grammar
        compilation ends, so a loop idle but for pending grammars can wake up; the same for a
        LoRA adapter's load."""
        self._grammar_waker = waker
        if self.lora is not None:
            self.lora.waker = waker
        if self._structured is not None:
            self._structured.on_compiled = waker

    def grammar_wait_s(self) -> float | None:
        """How long an idle engine may sleep before a pending grammar times out (None: no
        grammar is pending, or a "keep" pause freezes them)."""
        structured = self._structured
        if structured is None or self.pause_mode is PauseMode.KEEP:
            return None
        return structured.seconds_to_deadline()

    def _update_grammars(self, structured: StructuredOutputManager) -> None:
        ready, failed = structured.poll()
        for request in ready:
            request.set_status(RequestStatus.WAITING)
        for request, error in failed:
            self._fail(request, error)

    # -- LoRA adapters --------------------------------------------------------------------------

    def poll_lora(self) -> None:
        """Take the adapter loads that ended (those that failed end their requests)."""
        lora = self.lora
        if lora is None or not (lora.loading or lora.wanted or lora.removing or lora.failed):
            return
        lora.poll()
        for lora_id, error in lora.take_failed():
            for request in [
                r for r in self.scheduler.requests.values() if r.lora_int_id == lora_id
            ]:
                self._fail(request, str(error))

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise LoRAError("(any)", "LoRA is off (start the engine with enable_lora=True)")
        return self.lora

    def add_lora_async(self, lora: LoRARequest | Any) -> concurrent.futures.Future[None]:
        """Start loading an adapter; a future that ends once it is loaded (or with the
        :class:`LoRAError` that stopped it). It completes in :meth:`poll_lora`."""
        if not isinstance(lora, LoRARequest):
            lora = msgspec.convert(lora, LoRARequest)
        if self.lora is None:
            raise LoRAError(lora.lora_name, "LoRA is off (start the engine with enable_lora=True)")
        return self.lora.add(lora)

    def add_lora(self, lora: LoRARequest | Any) -> bool:
        """Load an adapter and keep it (a control call); True once it is loaded. Raises
        :class:`LoRAError` naming it when it cannot be served."""
        future = self.add_lora_async(lora)
        while not future.done():
            assert self.lora is not None
            concurrent.futures.wait([f for _, f in self.lora.loading.values()], timeout=1.0)
            self.poll_lora()
        future.result()
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests in flight with it finish first. False when it is not
        loaded."""
        return self._lora_manager().remove(lora_int_id)

    def list_loras(self) -> list[int]:
        """The ids of the loaded adapters."""
        return self._lora_manager().list()

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep a loaded adapter until it is removed (never evicted)."""
        return self._lora_manager().pin(lora_int_id)

    def _fail(self, request: Request, error: str) -> None:
        """End a queued request with finish_reason "error", reported with the next outputs."""
        self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
        self._ended_outside_steps.append(FinishedRequest(request.request_id, "error", None, error))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End requests now; their blocks are freed at once. Unknown ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def defer_abort(self, request_id: str) -> None:
        """Abort ``request_id`` once the step now executing has ended, before its outputs are
        applied (the aborted request gets no more tokens)."""
        self._pending_aborts.append(request_id)

    def abort_all(self) -> None:
        """End every live request as aborted and report each one with finish_reason "abort" in
        the next outputs (unlike :meth:`abort_requests`, whose caller already knows)."""
        ended = self.scheduler.finish_requests(list(self.scheduler.requests))
        self._ended_outside_steps.extend(FinishedRequest(r.request_id, "abort") for r in ended)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._ended_outside_steps)
            or bool(self._in_flight)
            or self.scheduler.connector_needs_step
        )

    @property
    def num_in_flight(self) -> int:
        """Launched steps whose results were not applied yet (async scheduling)."""
        return len(self._in_flight)

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything: requests to run (and not frozen by a "keep" pause)
        or ended requests to report."""
        if self._ended_outside_steps or self._in_flight:
            return True
        scheduler = self.scheduler
        if scheduler.connector is not None and (
            scheduler.connector.ended or scheduler.connector_needs_step
        ):
            return True
        return self.pause_mode is not PauseMode.KEEP and scheduler.has_unfinished_requests()

    # -- stepping -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput | None:
        """First part of a step; None when there is nothing to run."""
        if self.pause_mode is PauseMode.KEEP or not (
            self.scheduler.requests or self.scheduler.connector_needs_step
        ):
            return None
        structured = self._structured
        if structured is not None and structured.num_pending:
            self._update_grammars(structured)
        if self.lora is not None:
            self.poll_lora()
        scheduler_output = self.scheduler.schedule()
        if (
            scheduler_output.total_num_scheduled_tokens == 0
            and scheduler_output.kv_connector_metadata is None
            and not self.scheduler.connector_needs_step
        ):
            self._note_no_progress()
            return None
        self._progress_at = self.clock()
        self._stall_logged = False
        return scheduler_output

    def launch_step(self, scheduler_output: SchedulerOutput | None) -> StepResults | None:
        """The blocking part of a step. Sync scheduling: run ``scheduler_output`` and return it
        with its results (None: no step). Async scheduling: launch ``scheduler_output`` (when
        given) and return the step launched before it with its results, or None while no older
        step is in flight; without a new step it waits for the oldest one (draining)."""
        if self.async_scheduling:
            done = self._execute_async(scheduler_output)
            if (
                done is not None
                and done[0].total_num_scheduled_tokens == 0
                and done[1].kv_connector_report is None
            ):
                time.sleep(_CONNECTOR_POLL_S)  # as below: a connector-only step heard nothing
            return done
        if scheduler_output is None:
            return None
        runner_output = self._execute(scheduler_output)
        if (
            scheduler_output.total_num_scheduled_tokens == 0
            and runner_output.kv_connector_report is None
        ):
            # A step of the KV connector only, and nothing arrived: do not spin on it.
            time.sleep(_CONNECTOR_POLL_S)
        return scheduler_output, runner_output

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Forward pass, grammar bitmask, sampling (sync scheduling). The bitmask
        is filled on a helper thread while ``execute_model`` runs when the backend's step
        blocks (``step_in_thread``); after it otherwise (a step that holds the GIL throughout
        leaves nothing to overlap)."""
        start = self.clock()
        try:
            return self._run_model(scheduler_output)
        finally:
            elapsed = self.clock() - start
            self._device_busy_s += elapsed
            spec = self.scheduler.draft_planner
            if spec is not None and scheduler_output.total_num_scheduled_tokens:
                spec.observe_step(scheduler_output.total_num_scheduled_tokens, elapsed)

    def _run_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        backend = self.backend
        matchers = None
        drafts = None
        if self.scheduler.num_constrained:
            if self.scheduler.draft_planner is None:
                matchers = StructuredOutputManager.bitmask_matchers(self.scheduler.scheduled)
            else:
                matchers, drafts = StructuredOutputManager.bitmask_matchers_with_drafts(
                    self.scheduler.scheduled
                )
        if not matchers:
            backend.execute_model(scheduler_output)
            return backend.sample_tokens(None)
        structured = self.structured_output
        if not backend.step_in_thread:
            backend.execute_model(scheduler_output)
            bitmask = (
                structured.fill_bitmask(matchers)
                if drafts is None
                else structured.fill_bitmask(matchers, drafts)
            )
            return backend.sample_tokens(bitmask)
        future = structured.submit_bitmask(matchers, drafts)
        try:
            backend.execute_model(scheduler_output)
        except BaseException:
            # Never leave the helper touching matchers after a failed step.
            concurrent.futures.wait((future,))
            raise
        return backend.sample_tokens(future.result())

    def _execute_async(self, scheduler_output: SchedulerOutput | None) -> StepResults | None:
        """:meth:`launch_step` with async scheduling. The new step's sampling is launched with
        it unless it needs a grammar bitmask and an older step is in flight: the bitmask then
        waits for the older step's tokens (:meth:`complete_step` launches it)."""
        in_flight = self._in_flight
        if scheduler_output is not None:
            scheduler = self.scheduler
            rows = None
            if scheduler.num_constrained:
                rows = [
                    r
                    for r in scheduler.scheduled
                    if r.use_structured_output and r.samples_in_flight
                ]
            step = _InFlight(scheduler_output, rows or None)
            if not in_flight:
                self._busy_since = self.clock()
            self.backend.execute_model(scheduler_output)
            in_flight.append(step)
            if step.rows is None or len(in_flight) == 1:
                self._launch_sampling(step)
        if not in_flight or (scheduler_output is not None and len(in_flight) == 1):
            return None
        oldest = in_flight[0]
        handle = oldest.handle
        assert handle is not None
        try:
            runner_output = handle.get_output()
            device_time_s = handle.device_time_s
            if device_time_s is None:
                self._all_measured = False
            else:
                self._measured_busy_s += device_time_s
        finally:
            in_flight.popleft()
            if not in_flight:
                self._device_busy_s += self.clock() - self._busy_since
        return oldest.scheduler_output, runner_output

    def _launch_sampling(self, step: _InFlight) -> None:
        bitmask: Any = None
        if step.rows is not None:
            bitmask = self.structured_output.fill_bitmask_rows(step.rows)
        step.handle = self.backend.sample_tokens_async(bitmask)

    def complete_step(self, done: StepResults | None) -> EngineCoreOutputs:
        """Last part of a step: the aborts deferred while it ran, then the results of ``done``
        (what :meth:`launch_step` returned), then, with async scheduling, the newest step's
        sampling if it waited for these tokens. With ``done`` None the outputs report only the
        requests that ended between steps."""
        outputs = self._apply(done)
        if self._in_flight and self._in_flight[-1].handle is None:
            self._launch_sampling(self._in_flight[-1])
        return outputs

    def outputs_between_steps(self) -> EngineCoreOutputs:
        """The outputs of what ended while no step ran (deferred aborts, requests rejected at
        arrival, failed grammars, engine-initiated aborts)."""
        return self.complete_step(None)

    def _apply(self, done: StepResults | None) -> EngineCoreOutputs:
        if self._pending_aborts:
            aborts, self._pending_aborts = self._pending_aborts, []
            self.abort_requests(aborts)
        if done is None:
            outputs = EngineCoreOutputs()
        else:
            outputs = self.scheduler.update_from_output(*done)
            self.num_steps += 1
            self._progress_at = self.clock()  # a long step is no stall
        if self.lora is not None and self.lora.removing:
            self.poll_lora()  # adapters removed while in use: gone once their requests end
        if self.scheduler._refused:  # requests that can never fit, refused by schedule()
            outputs.finished.extend(self.scheduler.take_refused())
        if self._ended_outside_steps:
            outputs.finished.extend(self._ended_outside_steps)
            self._ended_outside_steps = []
        if self.scheduler.connector is not None:
            outputs.finished.extend(self.scheduler.take_connector_ended())
        outputs.timestamp = self.clock()
        if self._kv_events is not None:
            # Data parallelism: the step's prefix-cache changes and the load after it.
            return DPEngineCoreOutputs(
                outputs.req_ids,
                outputs.new_token_ids,
                outputs.finished,
                outputs.logprobs,
                outputs.prompt_logprobs,
                outputs.num_cached_tokens,
                outputs.timestamp,
                self._drain_events(),
                self._load(),
            )
        return outputs

    def _drain_events(self) -> KVEvents | None:
        assert self._kv_events is not None
        events = self._kv_events.drain()
        host = self._host_events.drain() if self._host_events is not None else None
        if host is None or not (host.stored or host.removed):
            return events
        if events is None:
            return KVEvents(host_stored=host.stored, host_removed=host.removed)
        events.host_stored = host.stored
        events.host_removed = host.removed
        return events

    def _load(self) -> EngineLoad:
        scheduler = self.scheduler
        return EngineLoad(
            scheduler.num_waiting,
            scheduler.num_running,
            scheduler.kv.num_free_blocks,
            scheduler.kv.num_blocks,
        )

    def step(self) -> EngineCoreOutputs:
        """Run one whole step and return what it produced. When nothing can run but grammars
        are compiling, it first waits for one of them (at most until one times out)."""
        scheduler_output = self.schedule()
        if scheduler_output is None and not self._ended_outside_steps and not self._in_flight:
            wait_s = self.grammar_wait_s()
            if wait_s is not None:
                self.structured_output.wait(wait_s)
                scheduler_output = self.schedule()
            elif self.lora is not None and self.lora.loading:
                # Nothing runs until an adapter is loaded: wait for one.
                futures = [f for _, f in self.lora.loading.values()]
                concurrent.futures.wait(
                    futures, timeout=1.0, return_when=concurrent.futures.FIRST_COMPLETED
                )
                scheduler_output = self.schedule()
        return self.complete_step(self.launch_step(scheduler_output))

    # -- control --------------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        """What a client learns of this engine when it starts."""
        return EngineInfo(
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.config.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            backend=self.config.backend,
            backend_options=_shown_options(self.config.backend_options),
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens or 0,
            async_scheduling=self.async_scheduling,
            speculative_method=(
                self.config.speculative_config.method
                if self.config.speculative_config is not None and self.spec_support is not None
                else None
            ),
            kv_groups="" if self.kv_layout.is_one_full_group else self.kv_layout.describe(),
            backend_settings=self._backend_settings,
        )

    def get_stats(self) -> EngineStats:
        scheduler = self.scheduler
        kv = scheduler.kv
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            prefix_cache_hit_rate=kv.stats.hit_rate,
            num_preemptions=scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_recomputed_tokens=scheduler.num_recomputed_tokens,
            seconds_since_progress=self.seconds_since_progress,
            num_kv_blocks=kv.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_malformed_messages=self.num_malformed_messages,
            device_busy_s=self.device_busy_s,
            kv_groups=[
                KVGroupStats(kind=kind, window=span, blocks_in_use=used)
                for kind, span, used in kv.group_usage()
            ],
            **self._spec_stats(),
            **self._lora_stats(),
            **self._connector_stats(),
            **self._transfer_stats(),
        )

    def _lora_stats(self) -> dict[str, Any]:
        lora = self.lora
        if lora is None:
            return {}
        scheduler = self.scheduler
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for lora_id, users in scheduler.lora_users.items():
            name = lora.name_of(lora_id)
            num_running = scheduler.lora_running.get(lora_id, 0)
            running[name] = num_running
            waiting[name] = users - num_running
        return {
            "lora_running": running,
            "lora_waiting": waiting,
            "lora_loaded": sorted(lora.loaded[i].lora_name for i in lora.list()),
        }

    def _connector_stats(self) -> dict[str, Any]:
        connector = self.scheduler.connector
        if connector is None:
            return {}
        counters = connector.counters
        own = connector.stats()
        return {
            "kv_offload_hit_tokens": counters.external_tokens,
            "kv_offload_bytes_loaded": counters.bytes_loaded,
            "kv_offload_bytes_stored": counters.bytes_stored,
            "kv_offload_load_s": counters.load_s,
            "kv_offload_store_s": counters.store_s,
            "kv_offload_failed_blocks": counters.failed_blocks,
            "kv_offload_resident_blocks": int(own.get("resident_blocks", 0)),
            "kv_offload_capacity_blocks": int(own.get("capacity_blocks", 0)),
            "kv_offload_free_blocks": int(own.get("free_blocks", 0)),
            "kv_parked_requests": len(connector.parked),
            "kv_loads_cancelled": counters.loads_cancelled,
        }

    def _transfer_stats(self) -> dict[str, Any]:
        """Disaggregation: the engine's role and its ``"pd"`` connector's counters."""
        if self.config.engine_roles is None:
            return {}
        connector = self.scheduler.connector
        counters: dict[str, float] = {}
        if connector is not None and self.config.kv_connector_name == "pd":
            counters = {k: float(v) for k, v in connector.stats().items()}
            counters["pd_lease_expired"] = (
                counters.get("pd_lease_expired", 0.0) + connector.counters.lease_expired
            )
        return {"engine_role": self.config.engine_role, "kv_transfer": counters}

    def _spec_stats(self) -> dict[str, Any]:
        spec = self.scheduler.draft_planner
        if spec is None:
            return {}
        stats = spec.stats
        return {
            "spec_num_speculative_tokens": spec.k_max,
            "spec_num_drafts": stats.num_drafts,
            "spec_num_draft_tokens": stats.num_draft_tokens,
            "spec_num_accepted_tokens": stats.num_accepted_tokens,
            "spec_accepted_per_pos": list(stats.accepted_per_pos),
            "spec_drafted_per_pos": list(stats.drafted_per_pos),
            "spec_current_k": spec.k,
            "spec_steps_by_k": dict(stats.steps_by_k),
            "spec_shadow_drafts": stats.shadow_drafts,
            "spec_shadow_accepted": stats.shadow_accepted,
        }

    @property
    def device_busy_s(self) -> float:
        """Seconds so far during which the backend had a step in flight: under async scheduling
        the device time its steps reported, when all of them did."""
        if self.async_scheduling and self._all_measured:
            return self._measured_busy_s
        busy = self._device_busy_s
        if self._in_flight:
            busy += self.clock() - self._busy_since
        return busy

    def kv_cache_snapshot(self) -> list[bytes]:
        """The digests of every cached block (what the step events have reported so far), for
        a router that starts with an empty index."""
        return snapshot(self.scheduler.kv.pool.cached)

    # -- stalls --------------------------------------------------------------------------------

    @property
    def seconds_since_progress(self) -> float:
        """Seconds since a step last computed a token while requests were queued (0 while
        there are none, or while a "keep" pause freezes them)."""
        if not self.scheduler.requests or self.pause_mode is PauseMode.KEEP:
            return 0.0
        return max(0.0, self.clock() - self._progress_at)

    def stall_reason(self) -> str | None:
        """Why the engine is stalled (requests queued, no token computed for
        ``stall_timeout_s``), or None."""
        timeout = self.config.stall_timeout_s
        if timeout is None:
            return None
        idle = self.seconds_since_progress
        if idle < timeout:
            return None
        scheduler = self.scheduler
        return (
            f"no token computed for {idle:.0f} s (stall_timeout_s {timeout:g}) with "
            f"{scheduler.num_waiting} requests waiting and {scheduler.num_running} running; "
            f"{scheduler.kv.num_free_blocks} of {scheduler.kv.num_blocks} KV blocks free"
        )

    def stall_wait_s(self) -> float | None:
        """How long an engine that cannot run anything may sleep before its stall is due to be
        logged (None: no stall to come, or it was logged)."""
        timeout = self.config.stall_timeout_s
        if timeout is None or self._stall_logged or not self.scheduler.requests:
            return None
        return max(0.0, timeout - self.seconds_since_progress)

    def _note_no_progress(self) -> None:
        """A schedule that computes nothing: log the queue state once when it is a stall."""
        if self._stall_logged:
            return
        reason = self.stall_reason()
        if reason is None:
            return
        self._stall_logged = True
        logger.error("the engine is stalled: %s; queue: %s", reason, self._queue_state())

    def _queue_state(self) -> str:
        """The waiting and running requests, briefly (the first few of each)."""

        def brief(requests: Iterable[Request]) -> str:
            shown = []
            for i, r in enumerate(requests):
                if i == 8:
                    shown.append("...")
                    break
                shown.append(
                    f"{r.request_id}({r.status.name.lower()}, {len(r.all_token_ids)} tokens, "
                    f"{r.num_computed_tokens} computed, {r.num_bypassed_steps} bypassed)"
                )
            return ", ".join(shown) or "none"

        scheduler = self.scheduler
        return f"waiting: {brief(scheduler.waiting)}; running: {brief(scheduler.running)}"

    def check_health(self) -> None:
        """Answering at all is the health check (a dead engine core cannot); a stalled one
        raises :class:`EngineStalledError` with the reason."""
        reason = self.stall_reason()
        if reason is not None:
            if not self._stall_logged:
                self._stall_logged = True
                logger.error("the engine is stalled: %s; queue: %s", reason, self._queue_state())
            raise EngineStalledError(f"the engine is stalled: {reason}")

    def pause_generation(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """Stop generating. ``"abort"``: in-flight requests end as aborted; ``"wait"``: they run
        to completion; ``"keep"``: they freeze in place until :meth:`resume_generation`. In the
        "abort" and "wait" modes new requests are rejected with a retryable error until then; in
        "keep" mode they queue. Pausing again changes the mode."""
        self.pause_mode = PauseMode.parse(mode)
        if self.pause_mode is PauseMode.ABORT:
            self.abort_all()

    def resume_generation(self) -> None:
        """Undo :meth:`pause_generation` (no-op when not paused)."""
        self.pause_mode = None

    def is_paused(self) -> bool:
        return self.pause_mode is not None

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def profile(self, action: str) -> None:
        if action not in ("start", "stop"):
            raise ValueError(f"action must be 'start' or 'stop', got {action!r}")
        self.backend.profile(action)  # type: ignore[arg-type]

    def sleep(self, level: int = 1) -> None:
        """Let the backend release device memory. The KV cache's contents are gone afterwards,
        so the prefix cache is reset; refused (``RuntimeError``) while requests are in flight."""
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError(
                "cannot sleep while requests are in flight; pause generation or let them finish"
            )
        # A step launched for requests that ended meanwhile (async scheduling) ends first; its
        # results are all discarded, so nothing is left to report.
        while self._in_flight:
            done = self._execute_async(None)
            if done is not None:
                self.scheduler.update_from_output(*done)
        self.backend.sleep(level)
        self.scheduler.reset_prefix_cache()

    def wake_up(self) -> None:
        self.backend.wake_up()

    def close(self) -> None:
        """Abort everything and close the backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.abort_requests(list(self.scheduler.requests))
        if self._structured is not None:
            self._structured.close()
        if self.lora is not None:
            self.lora.close()
        self.backend.close()
        connector = self.scheduler.connector
        if connector is not None:
            connector.close()
