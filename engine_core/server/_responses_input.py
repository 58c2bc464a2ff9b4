"""The Responses API's request (``POST /v1/responses``) and its translation into a chat
completion request: ``instructions`` and ``input`` become messages (``function_call`` and
``function_call_output`` items become an assistant's tool calls and tool messages), flat
function tools become chat tools, ``text.format`` becomes ``response_format``."""

from __future__ import annotations

from typing import Any

import msgspec

from engine_core._core.checks import MAX_JSON_DEPTH, check_json_value, show
from engine_core.server._errors import APIError
from engine_core.server._protocol import ChatCompletionRequest

__all__ = ["ResponsesRequest", "to_chat_request"]

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/responses`` (no server-side storage)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None
    include: list[str] | None = None
    """Extra output OpenAI can add (encrypted reasoning, logprobs); accepted, and nothing is
    added (the Agents SDK sends an empty list)."""


def _refuse_storage(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id is not supported: this server stores no responses; send the "
            "conversation in input",
            param="previous_response_id",
        )
    if body.store:
        raise APIError(
            400, "store: true is not supported: this server stores no responses", param="store"
        )


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of parts", param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else part
            raise APIError(
                400, f"{where}: only text parts are supported, got {kind!r}", param="input"
            )
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def _required_str(item: dict[str, Any], key: str, where: str, allow_empty: bool = False) -> str:
    """``item[key]``, a string (not empty unless ``allow_empty``); 400 naming ``input`` else."""
    value = item.get(key)
    if not isinstance(value, str) or not (value or allow_empty):
        kind = item.get("type")
        got = "nothing" if value is None else show(value)
        wanted = "a string" if allow_empty else "a non-empty string"
        raise APIError(400, f"{where}: a {kind} needs {key} as {wanted}, got {got}", param="input")
    return value


def _output(output: Any, where: str) -> str:
    """A function_call_output's output as the tool message's text: a string, or its text
    parts joined."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _text(output, where)
    raise APIError(
        400,
        f"{where}: output must be a string or a list of text parts, got {show(output)}",
        param="input",
    )


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    call_ids: set[str] = set()
    for index, item in enumerate(body.input):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role", ""))
            if role is None:
                raise APIError(400, f"{where}: unknown role {item.get('role')!r}", param="input")
            messages.append({"role": role, "content": _text(item.get("content", ""), where)})
        elif kind == "function_call":
            call_id = _required_str(item, "call_id", where)
            call = {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": _required_str(item, "name", where),
                    "arguments": _required_str(item, "arguments", where, allow_empty=True),
                },
            }
            call_ids.add(call_id)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _required_str(item, "call_id", where)
            if call_id not in call_ids:
                raise APIError(
                    400,
                    f"{where}: no function_call item before it has call_id {show(call_id)} "
                    "(this server stores no responses: send the calls in input)",
                    param="input",
                )
            if "output" not in item:
                raise APIError(
                    400, f"{where}: a function_call_output needs an output", param="input"
                )
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": _output(item["output"], where)}
            )
        elif kind != "reasoning":  # earlier thinking is not sent back to the model
            raise APIError(400, f"{where}: items of type {kind!r} are not supported", param="input")
    if not messages:
        raise APIError(400, "input must not be empty", param="input")
    return messages


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", param="text")
    if fmt.get("type") == "json_schema":
        try:  # here, to name the Responses API's field
            check_json_value("text.format.schema", fmt.get("schema"), MAX_JSON_DEPTH)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param="text", code="invalid_value") from None
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")},
        }
    return {"type": fmt.get("type")}


def to_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that answers ``body``; 400 naming the Responses field."""
    _refuse_storage(body)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "tools": body.tools,
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "stream": body.stream,
    }
    try:
        return msgspec.convert(chat, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"invalid request: {exc}") from None
