"""``POST /v1/completions``: text completion of one prompt or a batch of prompts.

Choices are numbered prompt by prompt: choice ``i * n + j`` is completion ``j`` of prompt ``i``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine_core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from engine_core.sampling_params import RequestOutputKind, SamplingParams
from engine_core.server._errors import APIError
from engine_core.server._protocol import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
)
from engine_core.server._serving import (
    PreparedPrompt,
    ServerState,
    check_prompt_length,
    new_id,
    read_body,
    run_prompts,
    sampling_params,
    usage,
)
from engine_core.server._sse import Emit, EventStreamResponse, cancel_on_disconnect, sse_event

__all__ = ["create_completion"]

_ENCODER = msgspec.json.Encoder()


def _prepare_prompts(
    state: ServerState, prompt: str | list[str | int | list[int]]
) -> list[PreparedPrompt]:
    """The prompts of the body: a string, a list of strings, a list of token ids, or a list of
    lists of token ids."""
    items: Sequence[str | int | list[int]]
    if isinstance(prompt, str):
        items = [prompt]
    elif not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    elif all(isinstance(p, int) for p in prompt):
        items = [[p for p in prompt if isinstance(p, int)]]
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        items = prompt
    else:
        raise APIError(
            400,
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids",
            param="prompt",
        )
    prepared = []
    for item in items:
        if isinstance(item, str):
            token_ids = state.tokenizer.encode(item)
            prepared.append(
                PreparedPrompt({"prompt": item, "prompt_token_ids": token_ids}, len(token_ids))
            )
        else:
            assert isinstance(item, list)
            prepared.append(PreparedPrompt({"prompt_token_ids": item}, len(item)))
        check_prompt_length(state, prepared[-1].num_tokens, "prompt")
    return prepared


def _logprobs(
    positions: list[PositionLogprobs], text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy logprobs columns of ``positions``; also the offset after them."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    for position in positions:
        sampled = next(iter(position.values()))
        token = sampled.decoded_token or ""
        tokens.append(token)
        token_logprobs.append(sampled.logprob)
        top_logprobs.append({(lp.decoded_token or ""): lp.logprob for lp in position.values()})
        offsets.append(text_offset)
        text_offset += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=offsets
    ), text_offset


def _echo_text(state: ServerState, output: RequestOutput) -> str:
    if output.prompt is not None:
        return output.prompt
    return state.tokenizer.decode(output.prompt_token_ids)


async def create_completion(state: ServerState, request: Request) -> Response | EventStreamResponse:
    body = await read_body(request, CompletionRequest, state.max_body_bytes)
    model = state.model_name(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of must equal n when given", param="best_of")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported", param="echo")
    prompts = _prepare_prompts(state, body.prompt)
    kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    params = sampling_params(
        body, max_tokens=body.max_tokens, logprobs=body.logprobs, output_kind=kind, renames={}
    )
    request_id = new_id("cmpl")
    created = int(time.time())
    if body.stream:
        stream = _CompletionStream(state, body, prompts, params, request_id, created, model)
        return EventStreamResponse(stream.run)
    return await cancel_on_disconnect(
        request.receive,
        lambda: _complete(state, body, prompts, params, request_id, created, model),
    )


async def _complete(
    state: ServerState,
    body: CompletionRequest,
    prompts: list[PreparedPrompt],
    params: SamplingParams,
    request_id: str,
    created: int,
    model: str,
) -> Response:
    n = body.n
    finals: list[RequestOutput | None] = [None] * len(prompts)

    async def handle(index: int, output: RequestOutput) -> None:
        finals[index] = output

    await run_prompts(state, prompts, params, request_id, handle, priority=body.priority)
    choices: list[CompletionChoice] = []
    prompt_tokens = completion_tokens = 0
    for index, output in enumerate(finals):
        assert output is not None
        prompt_tokens += len(output.prompt_token_ids)
        echo = _echo_text(state, output) if body.echo else ""
        for completion in sorted(output.outputs, key=lambda c: c.index):
            completion_tokens += len(completion.token_ids)
            logprobs = None
            if body.logprobs is not None and completion.logprobs is not None:
                logprobs, _ = _logprobs(completion.logprobs, 0)
            choices.append(
                CompletionChoice(
                    index=index * n + completion.index,
                    text=echo + completion.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                )
            )
    result = Completion(
        id=request_id,
        created=created,
        model=model,
        choices=choices,
        usage=usage(prompt_tokens, completion_tokens),
    )
    return Response(_ENCODER.encode(result), media_type="application/json")


class _CompletionStream:
    """One streamed completion response: a chunk per choice per output (the echoed prompt
    leading a choice's first one), then (when asked) a usage chunk. Each output is one write;
    with one prompt, the last output's chunks are returned to go out with ``[DONE]``."""

    def __init__(
        self,
        state: ServerState,
        body: CompletionRequest,
        prompts: list[PreparedPrompt],
        params: SamplingParams,
        request_id: str,
        created: int,
        model: str,
    ) -> None:
        self.state = state
        self.body = body
        self.prompts = prompts
        self.params = params
        self.request_id = request_id
        self.created = created
        self.model = model
        self.text_offsets: dict[int, int] = {}
        """Per choice that has begun: the ``text_offset`` of its next token."""
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.tail = b""
        self.emit: Emit | None = None

    async def run(self, emit: Emit) -> bytes:
        self.emit = emit if len(self.prompts) == 1 else _serialized(emit)
        await run_prompts(
            self.state,
            self.prompts,
            self.params,
            self.request_id,
            self._handle,
            priority=self.body.priority,
        )
        options = self.body.stream_options
        if options is not None and options.include_usage:
            chunk = Completion(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=[],
                usage=usage(self.prompt_tokens, self.completion_tokens),
            )
            self.tail += sse_event(_ENCODER.encode(chunk))
        return self.tail

    async def _handle(self, prompt_index: int, output: RequestOutput) -> None:
        events = []
        for completion in output.outputs:
            choice = prompt_index * self.body.n + completion.index
            self.completion_tokens += len(completion.token_ids)
            text = completion.text
            offset = self.text_offsets.get(choice)
            if offset is None:  # the choice's first output
                offset = 0
                if completion.index == 0:
                    self.prompt_tokens += len(output.prompt_token_ids)
                if self.body.echo:
                    text = _echo_text(self.state, output) + text
            logprobs = None
            if self.body.logprobs is not None and completion.logprobs:
                logprobs, offset = _logprobs(completion.logprobs, offset)
            self.text_offsets[choice] = offset
            if text or logprobs is not None or completion.finish_reason is not None:
                events.append(
                    _chunk(
                        self.request_id,
                        self.created,
                        self.model,
                        choice,
                        text,
                        logprobs,
                        completion,
                    )
                )
        data = b"".join(events)
        if output.finished and len(self.prompts) == 1:
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


def _chunk(
    request_id: str,
    created: int,
    model: str,
    choice: int,
    text: str,
    logprobs: CompletionLogprobs | None,
    completion: CompletionOutput,
) -> bytes:
    chunk = Completion(
        id=request_id,
        created=created,
        model=model,
        choices=[
            CompletionChoice(
                index=choice, text=text, logprobs=logprobs, finish_reason=completion.finish_reason
            )
        ],
    )
    return sse_event(_ENCODER.encode(chunk))
