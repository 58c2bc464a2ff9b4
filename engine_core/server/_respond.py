"""Answering a completion request, whole or streamed: what both endpoints do alike.

An endpoint reads its request into a :class:`RequestContext` and says how an output becomes its
choices; the code here runs the prompts through the engine (one ``AsyncLLM.generate`` call per
prompt, its ``n`` completions included, feeding the metrics as it goes), counts the usage and
writes the JSON: one body of FINAL_ONLY outputs, or server-sent events of DELTA outputs ending
with ``[DONE]``. With ``log_requests`` each request ends with one line on the
``engine_core.server.requests`` logger: its id, prompt and output token counts, finish reasons
and latency.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine_core._core.checks import show
from engine_core.outputs import RequestOutput
from engine_core.sampling_params import RequestOutputKind, SamplingParams
from engine_core.server._errors import APIError, api_error_from
from engine_core.server._logprobs import prompt_logprobs
from engine_core.server._protocol import (
    CompletionTokensDetails,
    ResponseBody,
    SamplingFields,
    Usage,
)
from engine_core.server._serving import PreparedPrompt, ServerState
from engine_core.server._sse import Emit, EventStreamResponse, cancel_on_disconnect, sse_event

__all__ = [
    "RANK_HEADER",
    "Fields",
    "RequestContext",
    "ResponseStream",
    "new_id",
    "pinned_rank",
    "respond",
    "run_prompts",
]

B = TypeVar("B", bound=SamplingFields)
C = TypeVar("C")

_ENCODER = msgspec.json.Encoder()
request_logger = logging.getLogger("engine_core.server.requests")

_OutputHandler = Callable[[int, RequestOutput], Awaitable[None]]
"""Called with (prompt index, output) for every output of every prompt."""


def new_id(prefix: str) -> str:
    """A fresh response id: ``prefix``, a dash and 24 hex digits."""
    return f"{prefix}-{secrets.token_hex(12)}"


def _usage(
    prompt_tokens: int, completion_tokens: int, details: CompletionTokensDetails | None = None
) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        completion_tokens_details=details,
    )


@dataclass(frozen=True, slots=True)
class Fields:
    """The request fields that errors about the prompt and about the grammar name."""

    prompt: str = "prompt"
    grammar: str = "structured_outputs"


@dataclass(frozen=True, slots=True)
class RequestContext(Generic[B]):
    """One request being answered: what its endpoint read and decided, which the whole or the
    streamed response is made from."""

    state: ServerState
    body: B
    prompts: Sequence[PreparedPrompt]
    params: SamplingParams
    model: str
    """The model name to answer with."""
    request_id: str
    """The response's id; the engine requests' ids derive from it."""
    created: int = field(default_factory=lambda: int(time.time()))
    fields: Fields = Fields()
    data_parallel_rank: int | None = None
    """The engine the ``X-Data-Parallel-Rank`` header pins the request to."""


async def _run_one(
    ctx: RequestContext[Any], index: int, request_id: str, handle: _OutputHandler
) -> None:
    lora = ctx.state.loras.get(ctx.model)
    recorder = ctx.state.metrics.recorder(None if lora is None else lora.lora_name)
    params = ctx.params
    outputs = ctx.state.engine.generate(
        ctx.prompts[index].prompt,
        params,
        request_id,
        priority=ctx.body.priority,
        data_parallel_rank=ctx.data_parallel_rank,
        lora_request=lora,
    )
    admitting = True  # no output yet: what generate() raises now is about the request
    try:
        # Closed here, not by the garbage collector, when the response is cancelled: the
        # request is aborted at once, and trio warns of generators it has to finalize.
        async with contextlib.aclosing(outputs):
            while True:
                try:
                    output = await outputs.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    error = api_error_from(
                        exc,
                        fields=type(ctx.body).__struct_fields__,
                        prompt_field=ctx.fields.prompt,
                        grammar_field=ctx.fields.grammar,
                        admitting=admitting,
                    )
                    if error is None:
                        raise
                    rank = ctx.data_parallel_rank
                    if error.status == 503 and rank is not None and _dead_pin(ctx.state, rank):
                        error.param = RANK_HEADER  # its engine died: the pin is why
                    raise error from exc
                admitting = False
                recorder.observe(output)
                # Not under the try above: what the server's own code raises is a 500.
                await handle(index, output)
    finally:
        recorder.close(params.n)


def _single_api_error(group: BaseExceptionGroup[Any]) -> APIError | None:
    """The first :class:`APIError` of a failed fan-out when nothing but API errors failed it."""
    errors, rest = group.split(APIError)
    if rest is not None or errors is None:
        return None
    while isinstance(first := errors.exceptions[0], BaseExceptionGroup):
        errors = first
    assert isinstance(first, APIError)
    return first


async def run_prompts(ctx: RequestContext[Any], handle: _OutputHandler) -> None:
    """Generate for every prompt concurrently, handing each output to ``handle``; engine errors
    become :class:`APIError` (the first one, when several prompts fail). Logs the request when
    the server logs requests."""
    if not ctx.state.log_requests:
        await _generate(ctx, handle)
        return
    start = time.perf_counter()
    delta = ctx.params.output_kind is RequestOutputKind.DELTA
    num_tokens = [0] * len(ctx.prompts)
    reasons: set[str] = set()

    async def counted(index: int, output: RequestOutput) -> None:
        count = sum(len(c.token_ids) for c in output.outputs)
        num_tokens[index] = num_tokens[index] + count if delta else count
        reasons.update(c.finish_reason for c in output.outputs if c.finish_reason is not None)
        await handle(index, output)

    outcome = None
    try:
        await _generate(ctx, counted)
    except anyio.get_cancelled_exc_class():
        outcome = "cancelled (the client left)"
        raise
    except BaseException as exc:
        outcome = f"failed ({exc.message if isinstance(exc, APIError) else type(exc).__name__})"
        raise
    finally:
        request_logger.info(
            "%s: %d prompt tokens, %d output tokens, finish_reason %s, %.3f s",
            ctx.request_id,
            sum(prompt.num_tokens for prompt in ctx.prompts),
            sum(num_tokens),
            outcome or ",".join(sorted(reasons)) or "none",
            time.perf_counter() - start,
        )


async def _generate(ctx: RequestContext[Any], handle: _OutputHandler) -> None:
    if len(ctx.prompts) == 1:
        await _run_one(ctx, 0, ctx.request_id, handle)
        return
    try:
        async with anyio.create_task_group() as task_group:
            for index in range(len(ctx.prompts)):
                task_group.start_soon(_run_one, ctx, index, f"{ctx.request_id}-{index}", handle)
    except BaseExceptionGroup as group:
        error = _single_api_error(group)
        if error is None:
            raise
        raise error from None


ChoicesOf = Callable[[RequestContext[B], int, RequestOutput], list[C]]
"""The choices of (request, prompt index, final output of that prompt) in a whole response."""
UsageDetails = Callable[[], CompletionTokensDetails | None]
"""The details of the usage of a whole response, once its choices are made."""


async def respond(
    request: Request,
    ctx: RequestContext[B],
    stream: Callable[[RequestContext[B]], ResponseStream[B, Any]],
    response: type[ResponseBody[C]],
    choices_of: ChoicesOf[B, C],
    details: UsageDetails | None = None,
) -> Response | EventStreamResponse:
    """The answer to ``request``: streamed by ``stream(ctx)`` when the body asks for a stream,
    else a whole ``response`` with the choices ``choices_of`` makes of each prompt's output
    (and the usage's ``details()``, when given)."""
    rank = pinned_rank(request, ctx.state)
    if rank is not None:
        ctx = dataclasses.replace(ctx, data_parallel_rank=rank)
    if ctx.body.stream:
        return EventStreamResponse(stream(ctx).run)
    return await cancel_on_disconnect(
        request.receive, lambda: _whole(ctx, response, choices_of, details)
    )


RANK_HEADER = "X-Data-Parallel-Rank"


def pinned_rank(request: Request, state: ServerState) -> int | None:
    """The engine the ``X-Data-Parallel-Rank`` header pins the request to (as vLLM reads it),
    or None: 400 for a value that is no engine's rank, a retryable 503 for a dead engine."""
    raw = request.headers.get(RANK_HEADER.lower())
    if raw is None:
        return None
    size = state.engine.config.data_parallel_size
    try:
        rank = int(raw)
    except ValueError:
        rank = -1
    if not 0 <= rank < size:
        # Header values arrive as Latin-1 text of their bytes: shown as the UTF-8 they are.
        shown = show(raw.encode("latin-1").decode("utf-8", "backslashreplace"))
        raise APIError(
            400,
            f"{RANK_HEADER} must be an engine rank in [0, {size}), got {shown}",
            param=RANK_HEADER,
        )
    roles = state.engine.config.roles
    if rank < len(roles) and roles[rank] == "prefill" and state.engine.config.disaggregated:
        raise APIError(
            400,
            f"{RANK_HEADER} {rank} names a prefill-only engine (engine_roles {roles}): it "
            "computes prompts for the decode engines and takes no whole request; pin a "
            "decode engine or leave the header out",
            param=RANK_HEADER,
        )
    dead = _dead_pin(state, rank)
    if dead is not None:
        raise dead
    return rank


def _dead_pin(state: ServerState, rank: int) -> APIError | None:
    """The 503 for a request pinned to engine ``rank`` when that engine is dead (None: it
    is alive)."""
    deployment = state.engine.data_parallel
    if deployment is None:
        return None
    engines = deployment.engine_status()
    if engines[rank]["alive"]:
        return None
    alive = ", ".join(str(e["rank"]) for e in engines if e["alive"]) or "none"
    return APIError(
        503,
        f"{RANK_HEADER} pins engine {rank}, which is not alive (alive: {alive}); retry "
        "later, or send the request to a live engine or without the header",
        type="service_unavailable",
        param=RANK_HEADER,
        code="retry_later",
    )


async def _whole(
    ctx: RequestContext[B],
    response: type[ResponseBody[C]],
    choices_of: ChoicesOf[B, C],
    details: UsageDetails | None,
) -> Response:
    finals: list[RequestOutput | None] = [None] * len(ctx.prompts)

    async def handle(index: int, output: RequestOutput) -> None:
        finals[index] = output

    await run_prompts(ctx, handle)
    choices: list[C] = []
    prompt_tokens = completion_tokens = 0
    for index, output in enumerate(finals):
        assert output is not None
        prompt_tokens += len(output.prompt_token_ids)
        completion_tokens += sum(len(c.token_ids) for c in output.outputs)
        choices += choices_of(ctx, index, output)
    result = response(
        id=ctx.request_id,
        created=ctx.created,
        model=ctx.model,
        choices=choices,
        usage=_usage(prompt_tokens, completion_tokens, details() if details else None),
    )
    positions = finals[0].prompt_logprobs if finals[0] is not None else None
    if positions is not None and "prompt_logprobs" in response.__struct_fields__:
        # vLLM's chat answer carries the prompt's logprobs beside the choices.
        result = msgspec.structs.replace(result, prompt_logprobs=prompt_logprobs(positions))
    return Response(_ENCODER.encode(result), media_type="application/json")


class ResponseStream(Generic[B, C]):
    """One streamed response: the events of each output in one write, then (when asked) a
    usage chunk. With one prompt, the last output's events are returned to go out with
    ``[DONE]``. Subclasses name their ``chunk`` struct and make the events of an output,
    adding its tokens to ``completion_tokens`` as they go over its completions."""

    chunk: type[ResponseBody[C]]

    def __init__(self, ctx: RequestContext[B]) -> None:
        self.ctx = ctx
        self.completion_tokens = 0
        self.tail = b""
        self.emit: Emit | None = None

    def events(self, prompt_index: int, output: RequestOutput) -> list[bytes]:
        """The encoded events of one output of prompt ``prompt_index`` (its tokens counted)."""
        raise NotImplementedError

    def usage_details(self) -> CompletionTokensDetails | None:
        """The details of the stream's usage chunk (none here)."""
        return None

    def event(self, choices: list[C], usage: Usage | None = None) -> bytes:
        """One chunk as an encoded event."""
        ctx = self.ctx
        chunk = self.chunk(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=usage
        )
        return sse_event(_ENCODER.encode(chunk))

    async def run(self, emit: Emit) -> bytes:
        """Stream every prompt's outputs with ``emit``; return the events that end the stream."""
        prompts = self.ctx.prompts
        self.emit = emit if len(prompts) == 1 else _serialized(emit)
        await run_prompts(self.ctx, self._handle)
        options = self.ctx.body.stream_options
        if options is not None and options.include_usage:
            prompt_tokens = sum(p.num_tokens for p in prompts)
            usage = _usage(prompt_tokens, self.completion_tokens, self.usage_details())
            self.tail += self.event([], usage)
        return self.tail

    async def _handle(self, prompt_index: int, output: RequestOutput) -> None:
        data = b"".join(self.events(prompt_index, output))
        if output.finished and len(self.ctx.prompts) == 1:
            self.tail = data
        elif data:
            assert self.emit is not None
            await self.emit(data)


def _serialized(emit: Emit) -> Emit:
    """``emit`` for several prompt tasks: one write at a time."""
    lock = anyio.Lock()

    async def locked(data: bytes) -> None:
        async with lock:
            await emit(data)

    return locked
