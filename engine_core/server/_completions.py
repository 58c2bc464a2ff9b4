"""``POST /v1/completions``: text completion of one prompt or a batch of prompts.

Choices are numbered prompt by prompt: choice ``i * n + j`` is completion ``j`` of prompt ``i``.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine_core._core.tokenizer import Tokenizer, output_decoder
from engine_core.outputs import PositionLogprobs, RequestOutput
from engine_core.sampling_params import SamplingParams
from engine_core.server._errors import APIError
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


class _TextOffsets:
    """Where the text of each token of one choice begins in the choice's text (``text_offset``).

    Only text that appears counts: a skipped special token moves nothing, and the tokens of a
    character split over several begin where the character does. The tokens are decoded again
    in the choice's context, as the engine decoded them for its text.
    """

    __slots__ = ("_decoder", "offset")

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._decoder = output_decoder(
            tokenizer,
            prompt_token_ids,
            params.skip_special_tokens,
            params.spaces_between_special_tokens,
        )
        self.offset = 0

    def of(self, token_ids: list[int]) -> list[int]:
        """The offsets of the next ``token_ids``."""
        offsets = []
        step = self._decoder.step
        for token_id in token_ids:
            offsets.append(self.offset)
            self.offset += len(step(token_id))
        return offsets


def _logprobs(
    positions: list[PositionLogprobs], token_ids: list[int], offsets: _TextOffsets
) -> CompletionLogprobs:
    """The legacy logprobs columns of ``positions`` (those of ``token_ids``)."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    for position in positions:
        sampled = next(iter(position.values()))
        tokens.append(sampled.decoded_token or "")
        token_logprobs.append(sampled.logprob)
        top_logprobs.append({(lp.decoded_token or ""): lp.logprob for lp in position.values()})
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=token_logprobs,
        top_logprobs=top_logprobs,
        text_offset=offsets.of(token_ids[: len(positions)]),
    )


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
    max_tokens = body.max_tokens
    given: str | None = "max_tokens"
    if isinstance(max_tokens, msgspec.UnsetType):
        max_tokens, given = DEFAULT_MAX_TOKENS, None  # the engine stops sooner if it must
    params = sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=body.logprobs,
        renames={},
        compact_json=state.disable_any_whitespace,
    )
    prompts = _prepare_prompts(state, body.prompt, params.n)
    check_lengths(state, prompts, params, given)
    ctx = RequestContext(state, body, prompts, params, model, new_id("cmpl"))
    return await respond(request, ctx, _CompletionStream, Completion, _choices)


def _choices(
    ctx: RequestContext[CompletionRequest], prompt_index: int, output: RequestOutput
) -> list[CompletionChoice]:
    body = ctx.body
    echo = _echo_text(ctx.state, output) if body.echo else ""
    choices = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        logprobs = None
        if body.logprobs is not None and completion.logprobs is not None:
            offsets = _TextOffsets(ctx.state.tokenizer, output.prompt_token_ids, ctx.params)
            logprobs = _logprobs(completion.logprobs, completion.token_ids, offsets)
        choices.append(
            CompletionChoice(
                index=prompt_index * body.n + completion.index,
                text=echo + completion.text,
                logprobs=logprobs,
                finish_reason=completion.finish_reason,
            )
        )
    return choices


class _CompletionStream(ResponseStream[CompletionRequest, CompletionChoice]):
    """One streamed completion response: a chunk per choice per output (the echoed prompt
    leading a choice's first one), then (when asked) a usage chunk."""

    chunk = Completion

    def __init__(self, ctx: RequestContext[CompletionRequest]) -> None:
        super().__init__(ctx)
        self.begun: set[int] = set()
        """The choices that have had an output."""
        self.text_offsets: dict[int, _TextOffsets] = {}
        """Per choice with logprobs: the offsets of its tokens' text."""

    def events(self, prompt_index: int, output: RequestOutput) -> list[bytes]:
        body = self.ctx.body
        events = []
        for completion in output.outputs:
            index = prompt_index * body.n + completion.index
            self.completion_tokens += len(completion.token_ids)
            text = completion.text
            if index not in self.begun:  # the choice's first output
                self.begun.add(index)
                if body.echo:
                    text = _echo_text(self.ctx.state, output) + text
            logprobs = None
            if body.logprobs is not None and completion.logprobs:
                offsets = self.text_offsets.get(index)
                if offsets is None:
                    offsets = self.text_offsets[index] = _TextOffsets(
                        self.ctx.state.tokenizer, output.prompt_token_ids, self.ctx.params
                    )
                logprobs = _logprobs(completion.logprobs, completion.token_ids, offsets)
            if text or logprobs is not None or completion.finish_reason is not None:
                choice = CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                )
                events.append(self.event([choice]))
        return events
