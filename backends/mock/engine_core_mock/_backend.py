"""``MockBackend``: a deterministic CPU backend that holds real per-request state.

Token rules (see the package docstring): greedy counts up from the last token, random sampling
hashes (seed, token history), under a grammar bitmask the mock closes what the grammar lets it
close (EOS, then ``"``, ``]``, ``}``) and else takes the first allowed token that is not
whitespace (greedy) or draws one (closing tokens heavy, whitespace light), ``logit_bias``
bans, forces or (greedy) reweighs tokens, and stop ids are masked below ``min_tokens``. Like a
real backend it keeps each request's tokens, block table and ``num_computed_tokens`` from the
scheduler's diffs, and it checks them: a scheduler that breaks the contract gets a
``RuntimeError`` instead of silently wrong tokens. After such an error the backend's state is
undefined.

The latency model runs on a device timeline: a step launched by ``execute_model`` starts when
the previous one ends (or at once when the device is idle) and ends its modelled duration
later; the results wait for that absolute deadline (``sample_tokens``, or the handle of
``sample_tokens_async`` under async scheduling), so a host that launches the next step while
one runs keeps the modelled device busy, and timer overshoot never accumulates.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from engine_core._workers import WorkerGroup
from engine_core.abc import (
    AsyncModelRunnerOutput,
    Backend,
    CachedRequestData,
    KVCacheSpec,
    LayerSpec,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SpecSupport,
    StepCostModel,
    TokenLogprobs,
)
from engine_core.config import EngineConfig
from engine_core.kv_connector import (
    KVConnectorLayout,
    KVConnectorReport,
    KVConnectorWorker,
    load_kv_connector,
)
from engine_core.lora import LoRARequest, LoRASupport
from engine_core_mock._blocks import BlockLedger
from engine_core_mock._kv_link import MockHostWorker
from engine_core_mock._layout import group_kinds, layer_spec
from engine_core_mock._lora import MockLoRAs, parse_lora
from engine_core_mock._options import Fault, parse_options
from engine_core_mock._pd_link import MockPDWorker
from engine_core_mock._replies import Replies
from engine_core_mock._rule import TokenRule, grammar_rows
from engine_core_mock._sampling import synthetic_logprobs
from engine_core_mock._speculation import MockSpeculation
from engine_core_mock._state import RequestState, request_seed

__all__ = ["FAULT_EXIT_CODE", "MockBackend"]

FAULT_EXIT_CODE = 13
"""Exit status of the process when the ``exit`` fault fires."""


class _MockHandle(AsyncModelRunnerOutput):
    """A launched mock step: its results, known at launch, are released at its deadline."""

    __slots__ = ("_output", "_release", "device_time_s")

    def __init__(
        self,
        output: ModelRunnerOutput,
        release: Callable[[ModelRunnerOutput], None],
        device_time_s: float,
    ) -> None:
        self.device_time_s = device_time_s
        self._output = output
        self._release = release

    def get_output(self) -> ModelRunnerOutput:
        self._release(self._output)
        return self._output


class MockBackend(Backend):
    """A deterministic backend with a synthetic (or HF-config) KV geometry, a latency model and
    fault injection; see ``engine_core_mock`` for the options. ``sleep`` is the function the
    latency model waits with, ``clock`` the one its device timeline reads."""

    supports_async_scheduling = True

    def __init__(
        self,
        config: EngineConfig,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config)
        options = parse_options(config)
        self.geometry = options.geometry
        self.latency = options.latency
        fault = options.fault
        self.fault = (
            fault if fault is None or fault.rank in (None, config.data_parallel_rank) else None
        )
        self._replies = Replies(options.replies, config.tokenizer_name) if options.replies else None
        self._copy = options.copy
        self._kv_link = options.kv_link
        self._connector: KVConnectorWorker | None = None
        """The KV connector's worker half (``init_kv_connector``; None: no connector)."""
        # Without a latency model or a fault a step is a few microseconds of Python holding the
        # GIL: a worker thread would add its hand-off and no concurrency.
        self.step_in_thread = self.latency is not None or self.fault is not None
        self._sleep = sleep
        self._clock = clock
        self._device_free_at = 0.0
        """When the last launched step ends on the modelled device."""
        self._deadline: float | None = None
        """When the step launched by the last execute_model ends (None: no latency model)."""
        self._duration = 0.0
        """The modelled duration of the step launched by the last execute_model."""
        self._step_fault: Fault | None = None
        """The fault of the step launched by the last execute_model, fired when its results
        are waited for (a device fails while it runs a step, not when the step is launched)."""
        self._vocab_size = self.geometry.vocab_size
        self._block_size = config.block_size
        self._engine_seed = config.seed
        self._requests: dict[str, RequestState] = {}
        self._blocks: BlockLedger | None = None
        self._windowed = False
        """Whether a KV-cache group has a window (its reads are checked every step)."""
        self._batch: list[RequestState] | None = None
        self._batch_ids: list[str] = []
        self._rule = TokenRule(self._vocab_size, config.tokenizer_name)
        self.loras = MockLoRAs(
            parse_lora(config.backend_options.get("lora")), config.model, config.max_lora_rank
        )
        """The LoRA adapters loaded (``add_lora``)."""
        self.max_loras_in_step = 0
        """The most distinct adapters any step so far had (checks of the max_loras cap)."""
        self._max_loras = config.max_loras
        self._checked_lora_ids: tuple[int, ...] | None = None
        """The adapters of the last step that passed ``_check_loras`` (None: none since an
        adapter was removed)."""
        self._spec = MockSpeculation(options.spec, self._rule)
        self._num_draft_tokens = 0
        """Drafts per request the step launched by the last execute_model asks for."""
        self._draft_req_ids: set[str] | None = None
        self.num_steps = 0
        """Calls of :meth:`execute_model` so far."""
        self.is_sleeping = False
        self.is_profiling = False
        self.is_closed = False
        if options.load_s:
            self._sleep(options.load_s)
        self.tensor_parallel_size = options.tensor_parallel_size
        self._rank_memory = options.rank_memory_bytes
        self.workers: WorkerGroup | None = None
        """The pretend tensor-parallel workers (ranks 1..N-1), when N > 1."""
        if self.tensor_parallel_size > 1:
            self.workers = WorkerGroup(
                "engine_core_mock._worker", self.tensor_parallel_size, config
            )
            try:
                self.workers.wait_ready()
            except BaseException:
                self.workers.close()
                raise

    # -- startup --------------------------------------------------------------------------------

    def kv_cache_spec(self) -> KVCacheSpec | list[LayerSpec]:
        """One ``KVCacheSpec`` for the plain geometry; one spec per layer when the model has
        ``layer_types`` (backend options, or its ``config.json``)."""
        g = self.geometry
        tp = self.tensor_parallel_size
        # Per rank: KV heads split, or replicated when there are fewer than ranks.
        heads = g.num_kv_heads // tp if g.num_kv_heads % tp == 0 else g.num_kv_heads
        if g.layer_types is None:
            return KVCacheSpec(
                num_layers=g.num_layers,
                num_kv_heads=heads,
                head_size=g.head_size,
                dtype_bytes=g.dtype_bytes,
            )
        return [
            layer_spec(kind, heads, g.head_size, g.dtype_bytes, g.sliding_window, g.chunk_size)
            for kind in g.layer_types
        ]

    def available_kv_cache_memory(self) -> int:
        """``device_memory_bytes * kv_cache_memory_fraction`` minus the weights (the size of the
        model's ``*.safetensors`` files, or ``weight_bytes``)."""
        g = self.geometry
        device = g.device_memory_bytes if self._rank_memory is None else self._rank_memory[0]
        own = int(device * self.config.kv_cache_memory_fraction) - g.weight_bytes
        if self.workers is None:
            return own
        others = self.workers.call("available_kv_cache_memory")
        return min(own, *(int(v) for v in others if isinstance(v, int)))

    def initialize_kv_cache(
        self, num_blocks: int, kv_groups: Sequence[Sequence[int]] | None = None
    ) -> None:
        """``kv_groups``: the layers of each KV-cache group (with ``layer_types``); every
        block table the scheduler sends is then checked against what each group's layers
        read."""
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be an int > 0, got {num_blocks!r}")
        if self._requests:
            raise RuntimeError("initialize_kv_cache called while requests are live")
        groups = group_kinds(self.geometry, kv_groups)
        if self.workers is not None:
            self.workers.call("initialize_kv_cache", num_blocks)
        self._blocks = BlockLedger(num_blocks, self._block_size, self._holders, groups)
        self._windowed = any(g.span is not None for g in groups)

    def init_kv_connector(self, name: str, layout: KVConnectorLayout) -> None:
        """The ``"host"`` tier's worker half is the mock's modelled link and host pool
        (``backend_options["kv_link"]``); another connector brings its own worker half
        (``KVConnectorProvider.worker``), registered with the block ledger. Under pretend
        tensor parallelism the connector runs on rank 0 only (the workers model no KV)."""
        if self._blocks is None:
            raise RuntimeError("init_kv_connector called before initialize_kv_cache()")
        worker: KVConnectorWorker | None
        if name == "host":
            worker = MockHostWorker(self.config, layout, self._kv_link, self._clock)
        elif name == "pd":
            worker = MockPDWorker(self.config, layout, self._kv_link, self._clock)
        else:
            worker = load_kv_connector(name).worker(self.config, layout, "mock", 0)
            if worker is None:
                raise NotImplementedError(f"the mock has no worker half for KV connector {name!r}")
        worker.register_kv_caches(self._blocks)
        self._connector = worker

    def vocab_size(self) -> int:
        return self._vocab_size

    def lora_support(self) -> LoRASupport | None:
        return self.loras.support

    def add_lora(self, lora: LoRARequest) -> None:
        self.loras.add(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        self._checked_lora_ids = None  # the next step's adapters are checked again
        self.loras.remove(lora_int_id)

    def spec_support(self) -> SpecSupport | None:
        """Exact verification, and the ``"mock"`` drafter (``backend_options["spec"]``); none
        under pretend tensor parallelism, whose workers model one token per step."""
        if self.tensor_parallel_size > 1:
            return None
        return self._spec.support(self.latency)

    def step_cost_model(self) -> StepCostModel | None:
        """The latency model as the speculation policy's prior (None without one)."""
        return self._spec.cost_model(self.latency)

    def max_model_len(self) -> int | None:
        return self.geometry.max_model_len

    # -- introspection --------------------------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        """Blocks allocated by :meth:`initialize_kv_cache` (0 before)."""
        return self._blocks.num_blocks if self._blocks is not None else 0

    @property
    def live_request_ids(self) -> list[str]:
        """Requests whose state the backend holds, in arrival order."""
        return list(self._requests)

    def num_computed_tokens(self, req_id: str) -> int:
        """The backend's own count of computed tokens of a live request."""
        return self._requests[req_id].num_computed_tokens

    # -- stepping -------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        if self.is_closed:
            raise RuntimeError("execute_model called after close()")
        if self.is_sleeping:
            raise RuntimeError("execute_model called while the backend sleeps (call wake_up())")
        blocks = self._blocks
        if blocks is None:
            raise RuntimeError("execute_model called before initialize_kv_cache()")
        if self._batch is not None:
            raise RuntimeError("execute_model called twice without sample_tokens in between")
        self.num_steps += 1
        if self.workers is not None:
            self.workers.step(scheduler_output)
        fault = self.fault
        self._step_fault = fault if fault is not None and self.num_steps == fault.at_step else None
        for req_id in scheduler_output.finished_req_ids:
            self._drop(req_id)
        for req_id in scheduler_output.preempted_req_ids:
            self._drop(req_id)
        connector = self._connector
        if connector is not None:
            # Cancelled loads, saves, loads: before this step's forward pass writes any block.
            connector.start_step(scheduler_output.kv_connector_metadata)
        lora_ids = scheduler_output.lora_ids
        if lora_ids:
            self._check_loras(lora_ids)
        batch: list[RequestState] = []
        total = self._apply_cached(scheduler_output.cached, batch, blocks)
        total += self._add_new(scheduler_output.new_reqs, batch, blocks, lora_ids)
        if total != scheduler_output.total_num_scheduled_tokens:
            raise RuntimeError(
                f"total_num_scheduled_tokens is {scheduler_output.total_num_scheduled_tokens} "
                f"but the batch schedules {total} tokens"
            )
        self._num_draft_tokens = scheduler_output.num_draft_tokens
        self._draft_req_ids = (
            None if scheduler_output.draft_req_ids is None else set(scheduler_output.draft_req_ids)
        )
        if self.latency is not None and total:
            context = sum(r.num_computed_tokens for r in batch)
            start = max(self._clock(), self._device_free_at)
            self._duration = self.latency.duration(total, context)
            if lora_ids and self.loras.options.per_lora_s:
                in_step = {r.lora_int_id for r in batch} - {0}
                self._duration += self.loras.options.per_lora_s * len(in_step)
            if self._num_draft_tokens:
                self._duration += self._spec.draft_cost(
                    self._num_draft_tokens, batch, self._draft_req_ids
                )
            self._deadline = self._device_free_at = start + self._duration
        elif self.latency is not None:
            # A step of the connector only (no tokens): no forward pass.
            self._duration = 0.0
            self._deadline = None
        self._batch = batch
        self._batch_ids = scheduler_output.req_ids
        if connector is not None:
            connector.after_forward()

    def _check_loras(self, lora_ids: tuple[int, ...]) -> None:
        """The step's adapters: loaded, at most max_loras (the core's promises). The same
        adapters as the step before, with none removed since, passed already."""
        if lora_ids == self._checked_lora_ids:
            return
        if len(lora_ids) > self._max_loras:
            raise RuntimeError(
                f"the step lists {len(lora_ids)} LoRA adapters but max_loras is {self._max_loras}"
            )
        offsets = self.loras.offsets
        for lora_id in lora_ids:
            if lora_id not in offsets:
                raise RuntimeError(f"the step uses LoRA adapter {lora_id}, which is not loaded")
        if len(lora_ids) > self.max_loras_in_step:
            self.max_loras_in_step = len(lora_ids)
        self._checked_lora_ids = lora_ids

    def _inject(self, fault: Fault) -> None:
        if fault.kind == "raise":
            raise RuntimeError(f"mock fault injected: raise at step {fault.at_step}")
        if fault.kind == "exit":
            os._exit(FAULT_EXIT_CODE)
        if fault.kind == "freeze":
            # libc's sleep called through a PyDLL keeps the GIL: no thread of the process runs
            # Python again, its event loop included (no step timeout, no heartbeat).
            libc = ctypes.PyDLL(None)
            while True:
                libc.sleep(1 << 20)
        threading.Event().wait()  # hang: nothing ever sets this event

    def _drop(self, req_id: str) -> None:
        state = self._requests.pop(req_id, None)
        if state is not None and self._blocks is not None:
            self._blocks.release(state)

    def _apply_cached(
        self, cached: CachedRequestData, batch: list[RequestState], blocks: BlockLedger
    ) -> int:
        block_size = self._block_size
        total = 0
        windowed = self._windowed
        drafts_column = cached.spec_token_ids
        for index, (state, new_block_ids, computed, num) in enumerate(cached.diffs(self._requests)):
            req_id = state.req_id
            end = computed + num
            drafts = drafts_column[index] if drafts_column else []
            if num <= 0 or end > len(state.tokens) + len(drafts):
                raise RuntimeError(
                    f"request {req_id!r}: cannot schedule {num} tokens after {computed} computed "
                    f"ones; the backend knows {len(state.tokens)} tokens"
                    + (f" and {len(drafts)} drafts" if drafts else "")
                )
            if drafts and end != len(state.tokens) + len(drafts):
                raise RuntimeError(
                    f"request {req_id!r}: {len(drafts)} drafts must follow all its "
                    f"{len(state.tokens)} tokens, but {num} are scheduled after {computed}"
                )
            state.drafts = drafts
            if windowed:
                blocks.release_behind(state, computed)
            # NOTE: what a window group reads needs no check each step: every entry was
            # checked when it was appended (or, a hit, when the request arrived), and the
            # ledger's reference counts keep any other request from writing a block this one
            # still reads.
            if new_block_ids is not None:
                blocks.append(state, new_block_ids, computed)
            if end > len(state.block_ids) * block_size:
                raise RuntimeError(
                    f"request {req_id!r}: a block table of {len(state.block_ids)} blocks cannot "
                    f"hold {end} tokens (block_size {block_size})"
                )
            # A drafted request's blocks hold its prefix only up to what verification accepts.
            if not drafts and end // block_size != computed // block_size:
                blocks.record_written(state, computed, end)
            state.num_computed_tokens = end
            if state.num_prompt_logprobs is not None or drafts:
                state.step_start = computed
            batch.append(state)
            total += num
        return total

    def _add_new(
        self,
        new_reqs: list[NewRequestData],
        batch: list[RequestState],
        blocks: BlockLedger,
        scheduler_lora_ids: tuple[int, ...] = (),
    ) -> int:
        requests = self._requests
        block_size = self._block_size
        vocab_size = self._vocab_size
        total = 0
        for new in new_reqs:
            req_id = new.req_id
            if req_id in requests:
                raise RuntimeError(
                    f"new request {req_id!r} is already live in the backend (it was not listed "
                    "in finished_req_ids or preempted_req_ids)"
                )
            if not new.prompt_token_ids:
                raise RuntimeError(f"new request {req_id!r} has an empty prompt")
            reply = (
                self._replies.tokens_for(new.prompt_token_ids)
                if self._replies is not None
                else None
            )
            lora_id = new.lora_int_id
            if lora_id:
                offset = self.loras.offsets.get(lora_id)
                if offset is None or lora_id not in scheduler_lora_ids:
                    raise RuntimeError(
                        f"new request {req_id!r} runs LoRA adapter {lora_id}, which is "
                        + ("not loaded" if offset is None else "not in the step's lora_ids")
                    )
            else:
                offset = 0
            state = RequestState(
                new,
                request_seed(req_id, new.sampling_params.seed, self._engine_seed),
                reply,
                self._copy,
                offset,
            )
            tokens = state.tokens
            if min(tokens) < 0 or max(tokens) >= vocab_size:
                raise RuntimeError(
                    f"new request {req_id!r} has token ids outside the vocabulary "
                    f"(size {vocab_size})"
                )
            computed, num = new.num_computed_tokens, new.num_scheduled_tokens
            end = computed + num
            if computed < 0 or num <= 0 or end > len(tokens):
                raise RuntimeError(
                    f"new request {req_id!r}: cannot schedule {num} tokens after {computed} "
                    f"computed ones of {len(tokens)}"
                )
            blocks.append(state, new.block_ids, computed)
            if end > len(state.block_ids) * block_size:
                raise RuntimeError(
                    f"new request {req_id!r}: a block table of {len(state.block_ids)} blocks "
                    f"cannot hold {end} tokens (block_size {block_size})"
                )
            if self._windowed:
                blocks.check_reads(state, computed, end)
            requests[req_id] = state
            if end // block_size != computed // block_size:
                blocks.record_written(state, computed, end)
            state.num_computed_tokens = end
            batch.append(state)
            total += num
        return total

    def _holders(self, block_id: int) -> list[str]:
        return [
            r.req_id
            for r in self._requests.values()
            if any(block_id in table for table in (r.group_tables or [r.block_ids]))
        ]

    def _wait(self, deadline: float | None, fault: Fault | None) -> None:
        """Until the step's deadline; then its fault, if it has one."""
        if deadline is not None:
            remaining = deadline - self._clock()
            if remaining > 0:
                self._sleep(remaining)
        if fault is not None:
            self._inject(fault)

    def sample_tokens(self, grammar_bitmask: Any | None) -> ModelRunnerOutput:
        output = self._sample(grammar_bitmask)
        self._release(self._deadline, self._step_fault, self.num_steps, output)
        return output

    def sample_tokens_async(self, grammar_bitmask: Any | None) -> AsyncModelRunnerOutput:
        """The tokens are drawn at once (the mock's sampling is host work) and released at the
        step's deadline on the device timeline."""
        output = self._sample(grammar_bitmask)
        release = functools.partial(self._release, self._deadline, self._step_fault, self.num_steps)
        return _MockHandle(output, release, self._duration)

    def _release(
        self, deadline: float | None, fault: Fault | None, step: int, output: ModelRunnerOutput
    ) -> None:
        """Wait for a step's end on the device timeline (then its fault fires, if it has one).
        Under pretend tensor parallelism the workers get its sampled ids only now, as from a
        device broadcast at the end of the step: a worker that ran the next step without
        them would fail its checks. A worker that died meanwhile fails the step."""
        self._wait(deadline, fault)
        workers = self.workers
        if workers is not None:
            workers.raise_failure()
            workers.sampled(step, output.sampled_token_ids)

    def _sample(self, grammar_bitmask: Any | None) -> ModelRunnerOutput:
        batch = self._batch
        if batch is None:
            raise RuntimeError("sample_tokens called without a preceding execute_model")
        self._batch = None
        vocab_size = self._vocab_size
        rows = (
            grammar_rows(batch, grammar_bitmask, vocab_size)
            if grammar_bitmask is not None
            else None
        )
        sampled: list[list[int]] = []
        logprobs: list[list[TokenLogprobs] | None] | None = None
        prompt_logprobs: dict[str, list[TokenLogprobs | None]] | None = None
        for index, state in enumerate(batch):
            tokens = state.tokens
            if state.drafts:
                # Drafts may follow the last prompt token, computed in this same step.
                if state.num_prompt_logprobs is not None:
                    prompt_logprobs = self._add_prompt_logprobs(state, prompt_logprobs)
                assert self._blocks is not None
                new, new_logprobs = self._spec.verify(
                    state, rows.get(index) if rows is not None else None, self._blocks
                )
                sampled.append(new)
                if new_logprobs is not None:
                    if logprobs is None:
                        logprobs = [None] * len(batch)
                    logprobs[index] = new_logprobs
                continue
            if state.num_computed_tokens != len(tokens):  # a partial prefill chunk
                if state.num_prompt_logprobs is not None:
                    prompt_logprobs = self._add_prompt_logprobs(state, prompt_logprobs)
                sampled.append([])
                continue
            if state.plain:  # the hot path: greedy, nothing else asked
                centre = tokens[-1] + state.greedy_step
                if centre >= vocab_size:
                    centre %= vocab_size
                tokens.append(centre)
                sampled.append([centre])
                continue
            if state.num_prompt_logprobs is not None:
                prompt_logprobs = self._add_prompt_logprobs(state, prompt_logprobs)
            words = rows[index][0] if rows is not None and index in rows else None
            token, centre = self._rule.next_token(state, words)
            tokens.append(token)
            sampled.append([token])
            if state.num_logprobs is not None:
                if logprobs is None:
                    logprobs = [None] * len(batch)
                logprobs[index] = [
                    synthetic_logprobs(token, centre, state.num_logprobs, vocab_size)
                ]
        drafts = (
            self._spec.propose(batch, sampled, self._num_draft_tokens, self._draft_req_ids)
            if self._num_draft_tokens
            else None
        )
        report = self._connector_report(bool(batch))
        if report is not None:
            return ModelRunnerOutput(
                self._batch_ids, sampled, logprobs, prompt_logprobs, drafts, report
            )
        return ModelRunnerOutput(self._batch_ids, sampled, logprobs, prompt_logprobs, drafts)

    def _connector_report(self, any_tokens: bool) -> KVConnectorReport | None:
        """The connector's transfers that end by this step's end. A step of the connector
        only (no tokens) waits for the next one to end (at most 5 ms), as a device wait on
        its copy events would, so the engine does not spin."""
        connector = self._connector
        if connector is None:
            return None
        if isinstance(connector, (MockHostWorker, MockPDWorker)):
            at = self._deadline if any_tokens and self._deadline is not None else self._clock()
            if not any_tokens:
                next_end = connector.next_end()
                if next_end is not None and next_end > at:
                    wait = min(next_end - at, 0.005)
                    self._sleep(wait)
                    at = self._clock()
            return connector.finished_by(at)
        return connector.get_finished()

    def _add_prompt_logprobs(
        self,
        state: RequestState,
        found: dict[str, list[TokenLogprobs | None]] | None,
    ) -> dict[str, list[TokenLogprobs | None]] | None:
        """Prompt logprobs of the prompt positions computed this step."""
        num_top = state.num_prompt_logprobs
        assert num_top is not None
        end = min(state.num_computed_tokens, state.num_prompt_tokens)
        if state.step_start >= end:
            return found
        vocab_size = self._vocab_size
        tokens = state.tokens
        entries: list[TokenLogprobs | None] = [
            None
            if p == 0
            else synthetic_logprobs(
                tokens[p], (tokens[p - 1] + 1) % vocab_size, num_top, vocab_size
            )
            for p in range(state.step_start, end)
        ]
        if found is None:
            found = {}
        found[state.req_id] = entries
        return found

    # -- control --------------------------------------------------------------------------------

    def profile(self, action: Literal["start", "stop"]) -> None:
        if action not in ("start", "stop"):
            raise ValueError(f"action must be 'start' or 'stop', got {action!r}")
        if self.workers is not None:
            self.workers.call("profile", action)
        self.is_profiling = action == "start"

    def sleep(self, level: int = 1) -> None:
        """Stop serving until :meth:`wake_up`; the KV contents are discarded (cached prefixes
        must not be reused afterwards)."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if self.workers is not None:
            self.workers.call("sleep", level)
        self.is_sleeping = True
        if self._blocks is not None:
            self._blocks.discard_contents()

    def wake_up(self) -> None:
        if self.workers is not None:
            self.workers.call("wake_up")
        self.is_sleeping = False

    def close(self) -> None:
        self.is_closed = True
        if self._connector is not None:
            self._connector.close()
            self._connector = None
        if self.workers is not None:
            self.workers.close()
        self._requests.clear()
        self._batch = None
