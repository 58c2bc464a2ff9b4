"""HTTP errors in OpenAI's JSON shape, and the mapping from engine errors to status codes.

============================================  ======  ==============================
cause                                          status  ``error.type`` / ``error.code``
============================================  ======  ==============================
invalid body or parameter                      400     invalid_request_error
body nested too deep                           400     invalid_request_error
parameter over an engine limit (max_n, ...)    400     invalid_request_error
prompt the engine cannot serve                 400     invalid_request_error
prompt (+ max_tokens) over max_model_len       400     ... / context_length_exceeded
missing or wrong API key                       401     invalid_request_error / invalid_api_key
unknown model name                             404     invalid_request_error / model_not_found
unknown route                                  404     invalid_request_error / not_found
body over the size limit                       413     invalid_request_error / request_too_large
engine dead or closed                          503     service_unavailable / engine_dead
engine paused or its queue full                503     service_unavailable / retry_later
============================================  ======  ==============================

Every 400 names the request field at fault in ``error.param`` where there is one. Only errors
raised while a request is being admitted (read, checked, handed to the engine, refused by it) are
the client's: an exception of the server's own code once outputs flow is a 500.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import msgspec

from engine_core.errors import (
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    RetryableRequestError,
)
from engine_core.lora import LoRAError, UnknownLoRAError
from engine_core.server._protocol import ErrorBody, ErrorResponse

__all__ = ["APIError", "api_error_from", "error_json", "invalid_parameter"]

_ENCODER = msgspec.json.Encoder()
_PARAM_AT = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_MISSING = re.compile(r"missing required field `([A-Za-z_][A-Za-z0-9_]*)`")
_LEADING_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\b")


class APIError(Exception):
    """An error answered to the client with ``status`` and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> bytes:
        """The JSON response body."""
        return error_json(self.message, self.type, self.param, self.code)


def error_json(message: str, type: str, param: str | None = None, code: str | None = None) -> bytes:
    return _ENCODER.encode(
        ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))
    )


def invalid_parameter(
    exc: Exception, fields: Iterable[str], renames: Mapping[str, str] | None = None
) -> APIError:
    """A 400 for a ``ValueError``/``TypeError`` (or msgspec ``ValidationError``) about a request;
    ``param`` names the request field the message points at (msgspec's "at `$.x...`"), says is
    missing, or starts with, mapped through ``renames`` (SamplingParams name -> request field
    name); None when that is no field of ``fields``."""
    message = str(exc)
    match = _PARAM_AT.search(message) or _MISSING.search(message) or _LEADING_NAME.match(message)
    param = match.group(1) if match else None
    if param is not None and renames:
        param = renames.get(param, param)
    if param is not None and param not in set(fields):
        param = None
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def api_error_from(
    exc: Exception,
    *,
    fields: Iterable[str],
    prompt_field: str,
    grammar_field: str = "structured_outputs",
    admitting: bool,
) -> APIError | None:
    """The HTTP error for an exception ``AsyncLLM.generate`` raised about a request (None: not one,
    a server error). ``admitting``: no output has come yet, so a ``ValueError`` or ``TypeError`` is
    ``generate`` refusing an argument (a 400 naming the field of ``fields`` it names); later one is
    a bug, not the client's. An invalid request the engine refused names ``stop_token_ids`` or
    ``logit_bias``, ``grammar_field`` (its grammar failed) or else ``prompt_field``."""
    if isinstance(exc, RetryableRequestError):
        return APIError(503, str(exc), type="service_unavailable", code="retry_later")
    if isinstance(exc, UnknownLoRAError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, InvalidRequestError):
        message = str(exc)
        if isinstance(exc, LoRAError) or message.startswith("LoRA adapter "):
            return APIError(400, message, param="model")
        if message.startswith(("stop_token_ids", "logit_bias")):
            param = message.split(" ", 1)[0]
        elif "structured_outputs" in message:
            param = grammar_field
        else:
            param = prompt_field
        return APIError(400, message, param=param)
    if isinstance(exc, (ValueError, TypeError)):
        if not admitting:
            return None
        error = invalid_parameter(exc, fields)
        if error.param is None and "prompt" in error.message:
            error.param = prompt_field  # parse_prompt's "'prompt_token_ids' must be ..."
        return error
    if isinstance(exc, EngineDeadError):
        return APIError(
            503, f"the engine is dead: {exc}", type="service_unavailable", code="engine_dead"
        )
    if isinstance(exc, EngineClosedError):
        return APIError(
            503, "the engine is shutting down", type="service_unavailable", code="engine_dead"
        )
    return None
