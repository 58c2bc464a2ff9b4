"""What the completion endpoints share in reading a request: the server's state, the body,
its prompts' checks, and the :class:`SamplingParams` it asks for (answering it is ``_respond``'s).

Whatever a request could never get is refused here with a 400 naming the field, before the
engine sees it: a body nested deeper than :data:`MAX_BODY_DEPTH`, token ids outside the
vocabulary, a prompt with ``max_tokens`` (or ``min_tokens``) past ``max_model_len``, more
sequences than the engine's running batch and queue hold together.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request

from engine_core._core.checks import json_nests_within, show
from engine_core._core.tokenizer import PromptInput, Tokenizer
from engine_core._frontend.async_llm import AsyncLLM
from engine_core.lora import LoRARequest
from engine_core.sampling_params import (
    MAX_LOGIT_BIAS,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from engine_core.server._chat_template import ChatTemplate
from engine_core.server._errors import APIError, invalid_parameter
from engine_core.server._metrics import ServerMetrics
from engine_core.server._protocol import SamplingFields
from engine_core.server._reasoning import ReasoningParser
from engine_core.server.tools import ToolParser

__all__ = [
    "MAX_BODY_DEPTH",
    "PreparedPrompt",
    "ServerState",
    "check_lengths",
    "check_sequences",
    "decode_body",
    "prepare_prompt",
    "read_body",
    "sampling_params",
    "unknown_fields",
]

S = TypeVar("S", bound=msgspec.Struct)
logger = logging.getLogger("engine_core.server")

MAX_BODY_DEPTH = 128
"""Deepest nesting of arrays and objects accepted in a request body: room for a JSON schema at
the engine's own limit (``MAX_JSON_DEPTH``, 100) inside the body's few levels, and far below
where decoding or rendering such values would recurse too deep (Python's limit is 1000)."""


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
    log_requests: bool = False
    """Log one line per request (see ``_respond``)."""
    disable_any_whitespace: bool = False
    """Compact JSON for every JSON-constrained request (each may also ask for it)."""
    strict_request_fields: bool = False
    """A body field the server does not know is a 400 (else a warning)."""
    tool_parser: ToolParser | None = None
    """The parser of ``tool_choice: "auto"`` (``--tool-call-parser``)."""
    auto_tool_choice: bool = False
    """Whether ``tool_choice: "auto"`` is served (``--enable-auto-tool-choice``)."""
    reasoning: ReasoningParser | None = None
    """``--reasoning-parser``: the thinking goes to ``reasoning_content``."""
    max_forced_reasoning_chars: int = 0
    """The thinking a forced tool call may do first (``--max-forced-reasoning-chars``)."""
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))
    loras: dict[str, LoRARequest] = field(default_factory=dict)
    """LoRA adapters by the name a request's ``model`` gives (``--lora-modules``, and those
    loaded at run time)."""
    _lora_ids: int = 0

    @functools.cached_property
    def reasoning_markers_special(self) -> bool:
        """Whether the reasoning parser's end marker is one special token of the tokenizer (a
        token that decoding with ``skip_special_tokens`` leaves out): its grammars then name
        the markers as special tokens."""
        reasoning = self.reasoning
        if reasoning is None or not reasoning.keeps_special_tokens:
            return False
        ids = self.tokenizer.encode(reasoning.end, add_special_tokens=False)
        return len(ids) == 1 and self.tokenizer.decode(ids, skip_special_tokens=True) == ""

    def next_lora_id(self) -> int:
        """An adapter id no adapter of this server had."""
        self._lora_ids = max(self._lora_ids, *(a.lora_int_id for a in self.loras.values()), 0) + 1
        return self._lora_ids

    def model_name(self, requested: str | None) -> str:
        """The name to answer with (the base model's, or a LoRA adapter's); 404 for a model
        this server does not serve."""
        if requested is None or requested in self.model_names or requested in self.loras:
            return requested or self.model_names[0]
        served = [*self.model_names, *self.loras]
        raise APIError(
            404,
            f"the model {requested!r} does not exist; this server serves "
            f"{', '.join(repr(n) for n in served)}",
            param="model",
            code="model_not_found",
        )


@dataclass(slots=True)
class PreparedPrompt:
    """One prompt ready for the engine: what ``generate`` takes and its token count."""

    prompt: PromptInput
    num_tokens: int


async def read_body(request: Request, struct: type[S], state: ServerState) -> S:
    """The JSON body decoded into ``struct``: 413 past the server's body limit, 400 when invalid
    (the message names the offending field). Fields ``struct`` does not know are ignored with
    one warning naming them, or a 400 under ``strict_request_fields``."""
    body = await _read_bytes(request, state.max_body_bytes)
    decoded = decode_body(body, struct)
    unknown = unknown_fields(body, struct)
    if unknown:
        _refuse_or_warn(request.url.path, unknown, state.strict_request_fields)
    return decoded


def unknown_fields(body: bytes, struct: type[msgspec.Struct]) -> list[str]:
    """The top-level fields of the JSON object ``body`` that ``struct`` does not have (the
    body decoded into ``struct`` already)."""
    known = struct.__struct_fields__
    try:
        keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return []
    return [key for key in keys if key not in known]


def _refuse_or_warn(path: str, unknown: list[str], strict: bool) -> None:
    names = ", ".join(show(name) for name in unknown)
    if strict:
        raise APIError(
            400,
            f"unknown field{'s' if len(unknown) > 1 else ''} {names} (the server refuses fields "
            "it does not know: --strict-request-fields)",
            param=unknown[0],
            code="unknown_field",
        )
    logger.warning("%s: ignored the request fields this server does not know: %s", path, names)


async def _read_bytes(request: Request, limit: int) -> bytes:
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
    return b"".join(chunks)


def decode_body(body: bytes, struct: type[S]) -> S:
    """``body`` decoded into ``struct``; 400 when it is not JSON, is nested deeper than
    :data:`MAX_BODY_DEPTH` or does not fit ``struct`` (naming the field where there is one)."""
    if not json_nests_within(body, MAX_BODY_DEPTH):
        raise _too_deep(body, struct.__struct_fields__)
    try:
        return msgspec.json.decode(body, type=struct)
    except msgspec.ValidationError as exc:
        raise invalid_parameter(exc, struct.__struct_fields__) from None
    except msgspec.DecodeError as exc:
        lone = _lone_surrogate(body)
        if lone is not None:  # msgspec may call it "truncated" or "malformed"
            raise _lone_surrogate_error(body, lone, struct.__struct_fields__) from None
        raise APIError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:  # not expected past the depth check; never a 500
        raise _too_deep(body, struct.__struct_fields__) from None


_SURROGATE_ESCAPE = re.compile(rb"(?<!\\)(\\++)u([dD][0-9a-fA-F]{3})")
"""A run of backslashes (matched from its start, without backtracking: linear in a body of
backslashes) and the ``u`` of an escape in the surrogates' range."""


def _lone_surrogate(body: bytes) -> tuple[int, int] | None:
    """Where the first ``\\uXXXX`` escape of a UTF-16 surrogate without its partner is in
    ``body`` (start and end), or None: JSON text escapes a character past U+FFFF as a high
    surrogate followed by a low one, and either alone is no character."""
    high: tuple[int, int] | None = None
    for match in _SURROGATE_ESCAPE.finditer(body):
        if len(match.group(1)) % 2 == 0:
            continue  # an escaped backslash followed by "u": no escape
        start, end = match.end(1) - 1, match.end()
        if int(match.group(2), 16) < 0xDC00:  # a high surrogate: a low one must follow
            if high is not None:
                return high
            high = (start, end)
        elif high is not None and high[1] == start:
            high = None  # a pair
        else:
            return high or (start, end)
    return high


def _lone_surrogate_error(body: bytes, at: tuple[int, int], fields: Collection[str]) -> APIError:
    """The 400 for a body holding a lone surrogate at ``at``, naming its top-level field."""
    escape = body[at[0] : at[1]].decode("ascii")
    param = None
    marked = body[: at[0]] + b"\\u0000lone\\u0000" + body[at[1] :]
    with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        top = msgspec.json.decode(marked, type=dict[str, msgspec.Raw])
        param = next((k for k, v in top.items() if b"\\u0000lone" in bytes(v)), None)
    if param not in fields:
        param = None
    where = f"{param} holds" if param else "the body holds"
    return APIError(
        400,
        f"{where} a lone UTF-16 surrogate ({escape} at byte {at[0]}), which is not text: "
        "a character past U+FFFF is escaped as a pair (\\ud83d\\ude00) or written as itself",
        param=param,
        code="invalid_value" if param else None,
    )


def _too_deep(body: bytes, fields: Collection[str]) -> APIError:
    """The 400 for a body that fails the depth check: naming the field nested too deep, or
    saying what else is wrong with the body when it is no JSON at all."""
    message = f"the body nests arrays and objects deeper than {MAX_BODY_DEPTH} levels"
    try:
        top = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        return APIError(400, message)  # not an object: no field to name
    except msgspec.DecodeError as exc:
        return APIError(400, f"the body is not valid JSON: {exc}")
    except RecursionError:
        return APIError(400, message)
    for name, value in top.items():
        if not json_nests_within(bytes(value), MAX_BODY_DEPTH - 1):
            if name in fields:
                return APIError(400, f"{name} is nested too deep: {message}", param=name)
            break
    return APIError(400, message)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


def sampling_params(
    body: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    renames: dict[str, str],
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    compact_json: bool = False,
    tokenizer: Tokenizer | None = None,
) -> SamplingParams:
    """The engine's parameters for ``body``; 400 naming the field when one is invalid.
    ``structured_outputs`` (from the endpoint's own field) replaces ``body.structured_outputs``;
    ``compact_json`` (the server's default) turns on its ``disable_any_whitespace``. Streams get
    DELTA outputs, whole responses FINAL_ONLY."""
    fields = body.__struct_fields__
    structured_outputs = structured_outputs or body.structured_outputs
    if compact_json and structured_outputs is not None:
        structured_outputs = msgspec.structs.replace(
            structured_outputs, disable_any_whitespace=True
        )
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
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
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "output_kind": RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
        "structured_outputs": structured_outputs,
        "logit_bias": _token_bias(body, tokenizer),
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise invalid_parameter(exc, fields, renames) from None


def _token_bias(body: SamplingFields, tokenizer: Tokenizer | None) -> dict[int, float] | None:
    """The logit bias of ``logit_bias``, ``allowed_token_ids`` (+100 on each: nothing else is
    sampled, as OpenAI's bounds of the bias mean) and ``bad_words`` (-100 on the token of each
    word, as written and after a space, as vLLM tokenizes them); 400 naming the field for a
    bad word that is more than one token either way."""
    bias = _logit_bias(body.logit_bias) or {}
    if body.allowed_token_ids:
        if not all(isinstance(t, int) and t >= 0 for t in body.allowed_token_ids):
            raise APIError(400, "allowed_token_ids must be token ids", param="allowed_token_ids")
        bias.update(dict.fromkeys(body.allowed_token_ids, MAX_LOGIT_BIAS))
    for word in body.bad_words or ():
        if tokenizer is None:
            raise APIError(400, "bad_words needs a tokenizer", param="bad_words")
        banned = [ids[0] for ids in _word_tokens(tokenizer, word) if len(ids) == 1]
        if not banned:
            raise APIError(
                400,
                f"bad_words: {show(word)} is more than one token; only words of one token can "
                "be banned",
                param="bad_words",
            )
        bias.update(dict.fromkeys(banned, -MAX_LOGIT_BIAS))
    return bias or None


def _word_tokens(tokenizer: Tokenizer, word: str) -> list[list[int]]:
    """The ids of ``word`` as written and after a space (no special tokens added)."""
    return [tokenizer.encode(text, add_special_tokens=False) for text in (word, " " + word)]


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) keyed by int; 400 for a key that
    is no token id (the values and the ids' range are :class:`SamplingParams`'s checks)."""
    if not bias:
        return None
    converted: dict[int, float] = {}
    for key, value in bias.items():
        # No 64-bit id has more than 20 digits; int() would refuse past 4300.
        if not (key.isascii() and key.isdigit() and len(key) <= 20):
            raise APIError(
                400, f"logit_bias keys must be token ids, got {show(key)}", param="logit_bias"
            )
        converted[int(key)] = value
    return converted


def prepare_prompt(
    state: ServerState, token_ids: list[int], param: str, text: str | None = None
) -> PreparedPrompt:
    """A prompt of ``token_ids`` (and ``text``, when it came as text), its length and (given as
    ids) its ids checked: 400 naming ``param`` when it is empty, leaves no room to generate, or
    holds an id outside the vocabulary."""
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
        vocab_size = state.engine.info.vocab_size
        low, high = min(token_ids), max(token_ids)
        if low < 0 or high >= vocab_size:
            bad = show(low if low < 0 else high)
            raise APIError(
                400,
                f"token id {bad} is outside the vocabulary (ids 0 to {vocab_size - 1})",
                param=param,
                code="invalid_value",
            )
        return PreparedPrompt({"prompt_token_ids": token_ids}, num_tokens)
    return PreparedPrompt({"prompt": text, "prompt_token_ids": token_ids}, num_tokens)


def check_sequences(state: ServerState, num_prompts: int, n: int, prompt_field: str) -> None:
    """400 for a request of more sequences (``num_prompts`` x ``n``) than the engine would ever
    take from one request: ``n`` over ``max_n``, or more sequences than ``max_n`` or the running
    batch (``max_num_seqs``), whichever is larger, or (with ``max_queued_requests``) than the
    running batch and the queue hold together. A full queue is a retryable 503; this would
    never fit, and is refused before any prompt is tokenized."""
    config = state.engine.config
    if n > config.max_n:
        raise APIError(400, f"n must be at most {config.max_n} (max_n), got {n}", param="n")
    limit, why = max(config.max_n, config.max_num_seqs), "max_n, or max_num_seqs when larger"
    if config.max_queued_requests is not None:
        capacity = config.max_num_seqs + config.max_queued_requests
        if capacity < limit:
            limit, why = capacity, "max_num_seqs + max_queued_requests"
    if n > limit:
        raise APIError(400, f"n must be at most {limit} ({why}), got {n}", param="n")
    if num_prompts * n > limit:
        raise APIError(
            400,
            f"the request asks for {num_prompts} prompts x n {n} sequences; one request may ask "
            f"for at most {limit} ({why})",
            param=prompt_field,
        )


def check_lengths(
    state: ServerState,
    prompts: Sequence[PreparedPrompt],
    params: SamplingParams,
    max_tokens_field: str | None,
) -> None:
    """400 when ``max_tokens``, given by ``max_tokens_field`` (None: a default, which the engine
    cuts to what fits), or ``min_tokens`` does not fit ``max_model_len`` with the longest
    prompt."""
    longest = max(prompt.num_tokens for prompt in prompts)
    limit = state.max_model_len
    room = limit - longest
    if max_tokens_field is not None and params.max_tokens is not None and params.max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens, but "
            f"{longest + params.max_tokens} were requested ({longest} in the prompt, "
            f"{params.max_tokens} for the completion); reduce the prompt or {max_tokens_field}",
            param=max_tokens_field,
            code="context_length_exceeded",
        )
    if params.min_tokens > room:
        raise APIError(
            400,
            f"min_tokens must be at most {room} (this model's maximum context length, {limit} "
            f"tokens, less {longest} in the prompt), got {params.min_tokens}",
            param="min_tokens",
            code="context_length_exceeded",
        )
