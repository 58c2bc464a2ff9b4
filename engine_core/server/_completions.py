"""``POST /v1/completions``: text completion of one prompt or a batch of prompts.

Choices are numbered prompt by prompt: choice ``i * n + j`` is completion ``j`` of prompt ``i``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine_core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from engine_core.server._errors import APIError
from engine_core.server._logprobs import TextOffsets, completion_logprobs, prompt_logprobs
from engine_core.server._protocol import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
)
from engine_core.server._respond import RequestContext, ResponseStream, new_id, respond
from engine_core.server._serving import (
    PreparedPrompt,
    ServerState,
    check_lengths,
    check_sequences,
    prepare_prompt,
    read_body,
    sampling_params,
)
from engine_core.server._sse import EventStreamResponse

__all__ = ["DEFAULT_MAX_TOKENS", "create_completion"]

DEFAULT_MAX_TOKENS = 16
"""OpenAI's ``max_tokens`` when a completion request leaves it out."""


def _prepare_prompts(
    state: ServerState, prompt: str | list[str | int | list[int]], n: int
) -> list[PreparedPrompt]:
    """The prompts of the body (a string, a list of strings, a list of token ids, or a list of
    lists of token ids), their number checked (with ``n`` each) before any is tokenized."""
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
    check_sequences(state, len(items), n, "prompt")
    prepared = []
    for item in items:
        if isinstance(item, str):
            prepared.append(prepare_prompt(state, state.tokenizer.encode(item), "prompt", item))
        else:
            assert isinstance(item, list)  # the checks above leave no bare int
            prepared.append(prepare_prompt(state, item, "prompt"))
    return prepared


def _echo_text(state: ServerState, output: RequestOutput) -> str:
    if output.prompt is not None:
        return output.prompt
    return state.tokenizer.decode(output.prompt_token_ids)


def _generates(body: CompletionRequest) -> bool:
    """Whether the response carries generated tokens: not with ``echo`` and ``max_tokens`` 0,
    which asks for the prompt (and its logprobs) alone."""
    return not (body.echo and body.max_tokens == 0)


@dataclass(frozen=True, slots=True)
class _Prompt:
    """A prompt's token ids and their logprobs (when asked for)."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None] | None


class _Columns:
    """The logprobs columns of one choice, made output by output: with ``echo`` the prompt's
    tokens first (their logprobs the request's prompt logprobs, the first ``null``)."""

    __slots__ = ("ctx", "offsets", "echoed")

    def __init__(self, ctx: RequestContext[CompletionRequest], output: RequestOutput) -> None:
        self.ctx = ctx
        state, params = ctx.state, ctx.params
        self.echoed = not ctx.body.echo
        """Whether the prompt's columns are made (or not asked for)."""
        start = len(_echo_text(state, output)) if ctx.body.echo else 0
        self.offsets = TextOffsets(state.tokenizer, output.prompt_token_ids, params, start)

    def of(self, prompt: _Prompt, completion: CompletionOutput) -> CompletionLogprobs | None:
        """The columns of the tokens ``completion`` adds (None when it adds none)."""
        tokenizer = self.ctx.state.tokenizer
        parts = []
        if not self.echoed and prompt.logprobs is not None:
            self.echoed = True
            offsets = TextOffsets(tokenizer, [], self.ctx.params)
            parts.append(completion_logprobs(tokenizer, prompt.logprobs, prompt.token_ids, offsets))
        if completion.logprobs and _generates(self.ctx.body):
            parts.append(
                completion_logprobs(
                    tokenizer, completion.logprobs, completion.token_ids, self.offsets
                )
            )
        if not parts:
            return None
        return CompletionLogprobs(
            tokens=[t for part in parts for t in part.tokens],
            token_logprobs=[t for part in parts for t in part.token_logprobs],
            top_logprobs=[t for part in parts for t in part.top_logprobs],
            text_offset=[t for part in parts for t in part.text_offset],
        )


async def create_completion(state: ServerState, request: Request) -> Response | EventStreamResponse:
    body = await read_body(request, CompletionRequest, state)
    model = state.model_name(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of must equal n when given", param="best_of")
    max_tokens = body.max_tokens
    given: str | None = "max_tokens"
    if isinstance(max_tokens, msgspec.UnsetType):
        max_tokens, given = DEFAULT_MAX_TOKENS, None  # the engine stops sooner if it must
    elif max_tokens == 0:
        if not body.echo:
            raise APIError(400, "max_tokens must be at least 1 without echo", param="max_tokens")
        max_tokens = 1  # the prompt's logprobs need one step; its token is not sent
    num_prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None and num_prompt_logprobs is None:
        num_prompt_logprobs = body.logprobs  # the echoed prompt's logprobs, as vLLM gives them
    params = sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=num_prompt_logprobs,
        renames={},
        compact_json=state.disable_any_whitespace,
        tokenizer=state.tokenizer,
    )
    prompts = _prepare_prompts(state, body.prompt, params.n)
    check_lengths(state, prompts, params, given)
    ctx = RequestContext(state, body, prompts, params, model, new_id("cmpl"))
    return await respond(request, ctx, _CompletionStream, Completion, _choices)


def _choices(
    ctx: RequestContext[CompletionRequest], prompt_index: int, output: RequestOutput
) -> list[CompletionChoice]:
    choices = []
    prompt = _Prompt(output.prompt_token_ids, output.prompt_logprobs)
    for completion in sorted(output.outputs, key=lambda c: c.index):
        columns = _Columns(ctx, output)
        choices.append(_choice(ctx, prompt_index, output, prompt, completion, columns, first=True))
    return choices


def _choice(
    ctx: RequestContext[CompletionRequest],
    prompt_index: int,
    output: RequestOutput,
    prompt: _Prompt,
    completion: CompletionOutput,
    columns: _Columns,
    *,
    first: bool,
) -> CompletionChoice:
    """The choice (or, streamed, the chunk) of what ``completion`` adds; ``first``: the
    choice's first output, which leads with the echoed prompt and its logprobs."""
    body = ctx.body
    text = completion.text if _generates(body) else ""
    if first and body.echo:
        text = _echo_text(ctx.state, output) + text
    logprobs = columns.of(prompt, completion) if body.logprobs is not None else None
    entries = None
    if first and body.prompt_logprobs is not None and prompt.logprobs is not None:
        entries = prompt_logprobs(prompt.logprobs)
    return CompletionChoice(
        index=prompt_index * body.n + completion.index,
        text=text,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        prompt_logprobs=entries,
    )


class _CompletionStream(ResponseStream[CompletionRequest, CompletionChoice]):
    """One streamed completion response: a chunk per choice per output (the echoed prompt
    leading a choice's first one), then (when asked) a usage chunk."""

    chunk = Completion

    def __init__(self, ctx: RequestContext[CompletionRequest]) -> None:
        super().__init__(ctx)
        self.columns: dict[int, _Columns] = {}
        """Per choice that has had an output: its logprobs columns."""
        self.prompts: dict[int, _Prompt] = {}
        """Per prompt: its ids and logprobs (which come once, with its first output)."""

    def events(self, prompt_index: int, output: RequestOutput) -> list[bytes]:
        events = []
        prompt = self.prompts.get(prompt_index)
        if prompt is None or output.prompt_logprobs is not None:
            prompt = _Prompt(output.prompt_token_ids, output.prompt_logprobs)
            self.prompts[prompt_index] = prompt
        for completion in output.outputs:
            index = prompt_index * self.ctx.body.n + completion.index
            self.completion_tokens += len(completion.token_ids)
            columns = self.columns.get(index)
            first = columns is None
            if columns is None:
                columns = self.columns[index] = _Columns(self.ctx, output)
            choice = _choice(
                self.ctx, prompt_index, output, prompt, completion, columns, first=first
            )
            if choice.text or choice.logprobs is not None or choice.finish_reason is not None:
                events.append(self.event([choice]))
        return events
