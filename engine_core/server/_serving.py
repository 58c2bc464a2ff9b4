"""What the completion endpoints share: the server's state, reading and checking a request, turning
it into :class:`SamplingParams`, and running prompts through the engine.

Each prompt of a request is one ``AsyncLLM.generate`` call (its ``n`` completions included).
Streams use DELTA outputs, whole responses FINAL_ONLY; both feed the metrics as they go.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.requests import ClientDisconnect, Request

from engine_core._core.tokenizer import PromptInput, Tokenizer
from engine_core._frontend.async_llm import AsyncLLM
from engine_core.outputs import RequestOutput
from engine_core.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from engine_core.server._chat_template import ChatTemplate
from engine_core.server._errors import APIError, api_error_from, invalid_parameter
from engine_core.server._metrics import ServerMetrics
from engine_core.server._protocol import SamplingFields, Usage

__all__ = [
    "Fields",
    "OutputHandler",
    "PreparedPrompt",
    "ServerState",
    "check_prompt_length",
    "new_id",
    "read_body",
    "run_prompts",
    "sampling_params",
    "usage",
]

S = TypeVar("S", bound=msgspec.Struct)
OutputHandler = Callable[[int, RequestOutput], Awaitable[None]]
"""Called with (prompt index, output) for every output of every prompt."""


@dataclass(kw_only=True)
class ServerState:
    """Everything the request handlers share."""

    engine: AsyncLLM
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    model_names: tuple[str, ...]
    max_model_len: int
    api_key: bytes | None
    """SHA-256 digest of the API key, when one is required."""
    max_body_bytes: int
    health_timeout_s: float
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if requested is None or requested in self.model_names:
            return requested or self.model_names[0]
        raise APIError(
            404,
            f"the model {requested!r} does not exist; this server serves "
            f"{', '.join(repr(n) for n in self.model_names)}",
            param="model",
            code="model_not_found",
        )


@dataclass(slots=True)
class PreparedPrompt:
    """One prompt ready for the engine: what ``generate`` takes and its token count."""

    prompt: PromptInput
    num_tokens: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


async def read_body(request: Request, struct: type[S], limit: int) -> S:
    """The JSON body decoded into ``struct``: 413 past ``limit`` bytes, 400 when invalid (the
    message names the offending field)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(499, "the client closed the connection") from None
    try:
        return msgspec.json.decode(b"".join(chunks), type=struct)
    except msgspec.ValidationError as exc:
        raise invalid_parameter(exc, struct.__struct_fields__) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


def sampling_params(
    body: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    output_kind: RequestOutputKind,
    renames: dict[str, str],
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's parameters for ``body``; 400 naming the field when one is invalid.
    ``structured_outputs`` (from the endpoint's own field) replaces ``body.structured_outputs``."""
    fields = body.__struct_fields__
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    kwargs: dict[str, Any] = {
        "n": body.n,
        "max_tokens": max_tokens,
        "seed": body.seed,
        "stop": body.stop,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "min_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos,
        "stop_token_ids": body.stop_token_ids,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "skip_special_tokens": body.skip_special_tokens,
        "logprobs": logprobs,
        "output_kind": output_kind,
        "structured_outputs": structured_outputs or body.structured_outputs,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise invalid_parameter(exc, fields, renames) from None


def check_prompt_length(state: ServerState, num_tokens: int, param: str) -> None:
    if num_tokens == 0:
        raise APIError(400, "the prompt is empty", param=param)
    if num_tokens >= state.max_model_len:
        raise APIError(
            400,
            f"the prompt has {num_tokens} tokens but the model's context length is "
            f"{state.max_model_len} (at least one token must be generated)",
            param=param,
            code="context_length_exceeded",
        )


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


@dataclass(frozen=True, slots=True)
class Fields:
    """The request fields that errors about the prompt and about the grammar name."""

    prompt: str = "prompt"
    grammar: str = "structured_outputs"


async def _run_one(
    state: ServerState,
    index: int,
    prompt: PreparedPrompt,
    params: SamplingParams,
    request_id: str,
    priority: int,
    handle: OutputHandler,
    fields: Fields,
) -> None:
    recorder = state.metrics.recorder()
    try:
        async for output in state.engine.generate(
            prompt.prompt, params, request_id, priority=priority
        ):
            recorder.observe(output)
            await handle(index, output)
    except Exception as exc:
        error = api_error_from(exc, fields.prompt, fields.grammar)
        if error is None:
            raise
        raise error from exc
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


async def run_prompts(
    state: ServerState,
    prompts: Sequence[PreparedPrompt],
    params: SamplingParams,
    request_id: str,
    handle: OutputHandler,
    *,
    priority: int = 0,
    fields: Fields = Fields(),
) -> None:
    """Generate for every prompt concurrently, handing each output to ``handle``; engine errors
    become :class:`APIError` (the first one, when several prompts fail)."""
    if len(prompts) == 1:
        await _run_one(state, 0, prompts[0], params, request_id, priority, handle, fields)
        return
    try:
        async with anyio.create_task_group() as task_group:
            for index, prompt in enumerate(prompts):
                task_group.start_soon(
                    _run_one,
                    state,
                    index,
                    prompt,
                    params,
                    f"{request_id}-{index}",
                    priority,
                    handle,
                    fields,
                )
    except BaseExceptionGroup as group:
        error = _single_api_error(group)
        if error is None:
            raise
        raise error from None
