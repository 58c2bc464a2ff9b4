"""``AsyncLLM``: the streaming front end, under asyncio or trio.

One task group, entered by ``async with``, owns the output handler (which reads the engine
core's per-step outputs, runs the :class:`OutputProcessor` over them in bounded chunks and pushes
into per-request collectors) and nothing outlives the block. The engine core runs in its own
process by default (``multiprocess=True``), or in this one (``multiprocess=False``), stepped by
the output handler.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from engine_core._core.engine_io import EngineCoreOutputs, EngineInfo, EngineStats, FinishedRequest
from engine_core._core.tokenizer import (
    PromptInput,
    Tokenizer,
    load_served_tokenizer,
    parse_prompt,
)
from engine_core._engine.client import EngineCoreClient, make_client_async
from engine_core._frontend.collector import RequestOutputCollector
from engine_core._frontend.output_processor import OutputProcessor
from engine_core._frontend.request_checks import check_lora_id, check_lora_request, check_request
from engine_core.config import EngineConfig
from engine_core.errors import (
    EngineClosedError,
    EngineDeadError,
    EngineError,
    RetryableRequestError,
)
from engine_core.lora import LoRARequest
from engine_core.outputs import RequestOutput
from engine_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_core._engine.dp.client import DPClient

__all__ = ["AsyncLLM"]

logger = logging.getLogger(__name__)

OUTPUT_CHUNK_SIZE = 128
"""Requests processed at most between two looks at the clock of the output handler."""
OUTPUT_YIELD_INTERVAL_S = 0.01
"""While engine outputs are already waiting, the output handler goes on processing them for up
to this long before it lets other tasks run. Consumers that fall behind the engine then take
several steps merged into one output instead of one output per step (far less work per token
for a server streaming them), and the event loop still runs every task within this interval."""


def split_outputs(outputs: EngineCoreOutputs, size: int) -> list[EngineCoreOutputs]:
    """``outputs`` in chunks of at most ``size`` requests; each finished entry travels with its
    request's tokens (those without tokens go with the last chunk)."""
    num = len(outputs.req_ids)
    if num <= size:
        return [outputs]
    finished_by_id = {f.req_id: f for f in outputs.finished}
    chunks = []
    for start in range(0, num, size):
        ids = outputs.req_ids[start : start + size]
        finished: list[FinishedRequest] = []
        if finished_by_id:
            for rid in ids:
                entry = finished_by_id.pop(rid, None)
                if entry is not None:
                    finished.append(entry)
        chunks.append(
            EngineCoreOutputs(
                ids,
                outputs.new_token_ids[start : start + size],
                finished,
                outputs.logprobs,
                outputs.prompt_logprobs,
                outputs.num_cached_tokens,
                outputs.timestamp,
            )
        )
    chunks[-1].finished.extend(finished_by_id.values())
    return chunks


class AsyncLLM:
    """Serve many concurrent streaming requests.

    ``async with AsyncLLM(**config_fields) as engine:`` (or :meth:`from_config`) starts the
    engine; leaving the block aborts what is in flight (those streams end with finish_reason
    "abort") and stops it.

    With ``max_queued_requests`` set, at most ``max_num_seqs + max_queued_requests`` sequences
    (a request counts its ``n`` completions) are in flight; :meth:`generate` rejects one more
    with :class:`RetryableRequestError` before sending anything.
    """

    def __init__(self, **config_fields: Any) -> None:
        self.config = EngineConfig.from_kwargs(**config_fields)
        self._init_state()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        engine = cls.__new__(cls)
        engine.config = config
        engine._init_state()
        return engine

    def _init_state(self) -> None:
        self._client: EngineCoreClient | None = None
        self._processor: OutputProcessor | None = None
        self._lifetime: contextlib.AbstractAsyncContextManager[AsyncLLM] | None = None
        self._dead: EngineDeadError | None = None
        self._closed = False
        self._ids = itertools.count()
        self._prefix = os.urandom(4).hex()
        self._num_in_flight = 0
        """Sequences (``n`` per request) of the requests that are in flight."""
        self.tokenizer: Tokenizer | None = None
        self._data_parallel_client = False
        """Use the data-parallel client even for one engine (to measure its overhead)."""

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncLLM:
        if self._lifetime is not None or self._closed:
            raise RuntimeError("an AsyncLLM can be entered once")
        self._lifetime = self._run()
        return await self._lifetime.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._lifetime is not None
        return await self._lifetime.__aexit__(exc_type, exc, tb)

    @contextlib.asynccontextmanager
    async def _run(self) -> AsyncIterator[AsyncLLM]:
        config = self.config
        self.tokenizer = await anyio.to_thread.run_sync(
            load_served_tokenizer, config.model, config.tokenizer
        )
        client = await make_client_async(
            config, multiprocess=True, data_parallel=self._data_parallel_client
        )
        self._client = client
        processor = self._processor = OutputProcessor(
            self.tokenizer, max_model_len=client.info.max_model_len
        )
        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(self._output_handler)
                try:
                    yield self
                finally:
                    self._closed = True
                    # In-flight streams end with finish_reason "abort".
                    for request_id in processor.request_ids():
                        processor.abort_request(request_id)
                    task_group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await client.shutdown_async()

    @property
    def info(self) -> EngineInfo:
        """What the engine core reported at startup (blocks, block size, max_model_len...)."""
        return self._started()[0].info

    @property
    def data_parallel(self) -> DPClient | None:
        """The data-parallel client (its ``metrics``, ``engine_status()``), or None with one
        engine."""
        from engine_core._engine.dp.client import DPClient

        return self._client if isinstance(self._client, DPClient) else None

    @property
    def dead_error(self) -> EngineDeadError | None:
        """What the engine core died of, once it died (every call raises it from then on);
        None while it runs."""
        return self._dead

    def _started(self) -> tuple[EngineCoreClient, OutputProcessor]:
        if self._client is None or self._processor is None:
            raise RuntimeError("use the AsyncLLM inside 'async with'")
        if self._dead is not None:
            raise EngineDeadError(str(self._dead)) from self._dead.__cause__
        if self._closed:
            raise EngineClosedError("the engine was closed")
        return self._client, self._processor

    # -- requests -------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of one request. Leaving the loop early, cancelling the consumer or
        closing the engine aborts the request in the engine. ``data_parallel_rank`` pins the
        request to that engine of a data-parallel deployment; ``lora_request`` runs it with a
        LoRA adapter (``enable_lora``; loaded on first use)."""
        client, processor = self._started()
        assert self.tokenizer is not None
        params = sampling_params if sampling_params is not None else SamplingParams()
        # Before any work for the request (n children, the queue's admission) is done.
        params = check_request(self.config, params, priority=priority, cache_salt=cache_salt)
        check_lora_request(self.config, lora_request)
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if data_parallel_rank is not None and (
            not isinstance(data_parallel_rank, int)
            or isinstance(data_parallel_rank, bool)
            or not 0 <= data_parallel_rank < self.config.data_parallel_size
        ):
            raise ValueError(
                f"data_parallel_rank must be an int in [0, {self.config.data_parallel_size}), "
                f"got {data_parallel_rank!r}"
            )
        if (
            data_parallel_rank is not None
            and self.config.disaggregated
            and self.config.roles[data_parallel_rank] == "prefill"
        ):
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} is a prefill-only engine (engine_roles "
                f"{self.config.roles}): pin a decode engine or leave it out"
            )
        text, token_ids = parse_prompt(prompt, self.tokenizer)
        external_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self._admit(params.n, external_id)
        # Unique even when a caller reuses an id: outputs carry external_id.
        internal_id = f"{external_id}-{self._prefix}{next(self._ids)}"
        collector = RequestOutputCollector(params.output_kind)
        requests = processor.add_request(
            internal_id,
            text,
            token_ids,
            params,
            external_id=external_id,
            priority=priority,
            cache_salt=cache_salt,
            collector=collector,
        )
        finished = False
        self._num_in_flight += params.n
        try:
            for request in requests:
                request.data_parallel_rank = data_parallel_rank
                request.lora_request = lora_request
                client.add_request(request)
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                yield output
        finally:
            self._num_in_flight -= params.n
            if not finished:
                self._abort_now(internal_id)

    def _admit(self, num_seqs: int, request_id: str) -> None:
        """Raise :class:`RetryableRequestError` when ``max_queued_requests`` is set and
        ``num_seqs`` more sequences would not fit the running batch and the queue."""
        limit = self.config.max_queued_requests
        if limit is None:
            return
        capacity = self.config.max_num_seqs + limit
        if self._num_in_flight + num_seqs > capacity:
            raise RetryableRequestError(
                f"the engine's queue is full ({self._num_in_flight} sequences in flight, "
                f"max_num_seqs {self.config.max_num_seqs} + max_queued_requests {limit}); "
                "retry later",
                request_id,
            )

    def _abort_now(self, request_id: str) -> None:
        """Forget ``request_id`` here and tell the engine, without awaiting (usable while
        cancelled or from a generator's finalizer)."""
        client, processor = self._client, self._processor
        if client is None or processor is None:
            return
        engine_ids = processor.abort_request(request_id)
        if engine_ids and self._dead is None and not self._closed:
            # A dead or closed engine holds no requests.
            with contextlib.suppress(EngineError):
                client.abort_requests(engine_ids)

    async def abort(self, request_id: str) -> None:
        """Abort every request with this id (all ``n`` completions of it)."""
        self._started()
        self._abort_now(request_id)

    # -- the output handler ---------------------------------------------------------------------

    async def _output_handler(self) -> None:
        client, processor = self._client, self._processor
        assert client is not None and processor is not None
        clock = time.perf_counter
        try:
            last_yield = clock()
            while True:
                # Returns without yielding when outputs are waiting (the engine ran ahead).
                outputs = await client.get_output_async()
                for chunk in split_outputs(outputs, OUTPUT_CHUNK_SIZE):
                    processed = processor.process_outputs(chunk)
                    if processed.reqs_to_abort:
                        client.abort_requests(processed.reqs_to_abort)
                    if clock() - last_yield >= OUTPUT_YIELD_INTERVAL_S:
                        await anyio.lowlevel.checkpoint()
                        last_yield = clock()
        except EngineDeadError as exc:
            self._dead = exc
            processor.propagate_error(exc)
        except EngineClosedError:
            if not self._closed:
                raise

    # -- control --------------------------------------------------------------------------------

    async def _call(self, method: str, *args: Any) -> Any:
        client, _ = self._started()
        return await client.call_utility_async(method, *args)

    async def get_stats(self) -> EngineStats:
        """A snapshot of the engine's state and counters."""
        stats: EngineStats = await self._call("get_stats")
        return stats

    async def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the engine core is dead."""
        await self._call("check_health")

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter and keep it (steps go on while it loads); True once loaded.
        Raises :class:`~engine_core.lora.LoRAError` naming it when it cannot be served."""
        check_lora_request(self.config, lora_request, required=True)
        done: bool = await self._call("add_lora", lora_request)
        return done

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests in flight with it finish first. False when it was not
        loaded."""
        done: bool = await self._call("remove_lora", check_lora_id(lora_int_id))
        return done

    async def list_loras(self) -> set[int]:
        """The ids of the loaded adapters."""
        ids: list[int] = await self._call("list_loras")
        return set(ids)

    async def pin_lora(self, lora_int_id: int) -> bool:
        """Keep a loaded adapter loaded until it is removed (never evicted)."""
        done: bool = await self._call("pin_lora", check_lora_id(lora_int_id))
        return done

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        done: bool = await self._call("reset_prefix_cache", reset_running_requests)
        return done

    async def pause_generation(self, mode: str = "abort") -> None:
        """``"abort"``: in-flight requests end as aborted; ``"wait"``: they finish; ``"keep"``:
        they freeze in place. New requests are rejected with a retryable error until
        :meth:`resume_generation` in the first two modes, and queue in the third."""
        await self._call("pause_generation", mode)

    async def resume_generation(self) -> None:
        await self._call("resume_generation")

    async def is_paused(self) -> bool:
        paused: bool = await self._call("is_paused")
        return paused

    async def start_profile(self) -> None:
        await self._call("profile", "start")

    async def stop_profile(self) -> None:
        await self._call("profile", "stop")

    async def sleep(self, level: int = 1) -> None:
        await self._call("sleep", level)

    async def wake_up(self) -> None:
        await self._call("wake_up")
