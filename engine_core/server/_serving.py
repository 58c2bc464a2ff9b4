"""What the completion endpoints share in reading a request: the server's state, the body,
its prompts' checks, and the :class:`SamplingParams` it asks for (answering it is ``_respond``'s).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request

from engine_core._core.tokenizer import PromptInput, Tokenizer
from engine_core._frontend.async_llm import AsyncLLM
from engine_core.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from engine_core.server._chat_template import ChatTemplate
from engine_core.server._errors import APIError, invalid_parameter
from engine_core.server._metrics import ServerMetrics
from engine_core.server._protocol import SamplingFields

__all__ = ["PreparedPrompt", "ServerState", "prepare_prompt", "read_body", "sampling_params"]

S = TypeVar("S", bound=msgspec.Struct)


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
    renames: dict[str, str],
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's parameters for ``body``; 400 naming the field when one is invalid.
    ``structured_outputs`` (from the endpoint's own field) replaces ``body.structured_outputs``.
    Streams get DELTA outputs, whole responses FINAL_ONLY."""
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
        "output_kind": RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
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


def prepare_prompt(
    state: ServerState, token_ids: list[int], param: str, text: str | None = None
) -> PreparedPrompt:
    """A prompt of ``token_ids`` (and ``text``, when it came as text), its length checked: 400
    naming ``param`` when it is empty or leaves no room to generate."""
    num_tokens = len(token_ids)
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
    if text is None:
        return PreparedPrompt({"prompt_token_ids": token_ids}, num_tokens)
    return PreparedPrompt({"prompt": text, "prompt_token_ids": token_ids}, num_tokens)
