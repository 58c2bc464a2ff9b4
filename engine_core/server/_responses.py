"""``POST /v1/responses``: the Responses API without server-side storage, answered by the chat
completion machinery (template, tools, reasoning, grammars) and written as output items, whole
or as the semantic stream events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``,
``response.completed``, ...)."""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine_core.outputs import RequestOutput
from engine_core.server._chat import (
    chat_params,
    chat_reader,
    max_tokens_field,
    render_messages,
    tool_choice_of,
)
from engine_core.server._chat_output import ChatReader
from engine_core.server._errors import APIError
from engine_core.server._protocol import AssistantMessage, Delta
from engine_core.server._respond import Fields, RequestContext, run_prompts
from engine_core.server._responses_input import ResponsesRequest, to_chat_request
from engine_core.server._serving import ServerState, check_lengths, read_body
from engine_core.server._sse import Emit, EventStreamResponse, cancel_on_disconnect, sse_event

__all__ = ["create_response"]

_ENCODER = msgspec.json.Encoder()
_RENAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


async def create_response(state: ServerState, request: Request) -> Response | EventStreamResponse:
    body = await read_body(request, ResponsesRequest, state)
    model = state.model_name(body.model)
    try:
        chat = to_chat_request(body)
        choice = tool_choice_of(state, chat)
        params = chat_params(state, chat, choice)
        prompts = [render_messages(state, chat, choice.tools)]
        check_lengths(state, prompts, params, max_tokens_field(chat))
    except APIError as exc:
        exc.param = _RENAMES.get(exc.param or "", exc.param)
        raise
    ctx = RequestContext(
        state,
        chat,
        prompts,
        params,
        model,
        _item_id("resp"),
        fields=Fields(prompt="input", grammar="text"),
    )
    answer = _Answer(ctx, body, chat_reader(state, choice))
    if body.stream:
        return EventStreamResponse(answer.stream)
    result = await cancel_on_disconnect(request.receive, answer.whole)
    return Response(_ENCODER.encode(result), media_type="application/json")


class _Answer:
    """One response: its metadata, its usage and output items, whole or streamed."""

    def __init__(self, ctx: RequestContext[Any], body: ResponsesRequest, reader: ChatReader):
        self.ctx = ctx
        self.body = body
        self.reader = reader
        self.created_at = int(time.time())
        self.output_tokens = 0
        self.finish_reason: str | None = None
        # Streaming: the items so far and the one open now.
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}
        self.sequence = 0

    # -- the response object ------------------------------------------------------------------

    def response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        body = self.body
        incomplete = None
        if status == "completed" and self.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        result: dict[str, Any] = {
            "id": self.ctx.request_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.ctx.model,
            "output": output,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "text": body.text or {"format": {"type": "text"}},
            "truncation": "disabled",
        }
        if status != "in_progress":
            details = self.reader.usage_details()
            input_tokens = self.ctx.prompts[0].num_tokens
            result["usage"] = {
                "input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {
                    "reasoning_tokens": details.reasoning_tokens if details else 0
                },
                "total_tokens": input_tokens + self.output_tokens,
            }
        return result

    # -- whole --------------------------------------------------------------------------------

    async def whole(self) -> dict[str, Any]:
        finals: list[RequestOutput] = []

        async def handle(index: int, output: RequestOutput) -> None:
            finals.append(output)

        await run_prompts(self.ctx, handle)
        completion = finals[-1].outputs[0]
        self.output_tokens = len(completion.token_ids)
        message, self.finish_reason = self.reader.message(completion)
        return self.response("completed", _items(message))

    # -- streamed -----------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\n" + sse_event(_ENCODER.encode(data))

    async def stream(self, emit: Emit) -> bytes:
        start = self.response("in_progress", [])
        await emit(
            self.event("response.created", response=start)
            + self.event("response.in_progress", response=start)
        )
        tail: list[bytes] = []

        async def handle(index: int, output: RequestOutput) -> None:
            completion = output.outputs[0]
            self.output_tokens += len(completion.token_ids)
            delta, reason = self.reader.stream(0).delta(completion)
            events = self._delta_events(delta) if delta is not None else []
            if reason is not None:
                self.finish_reason = reason
                tail.extend(events)
            elif events:
                await emit(b"".join(events))

        await run_prompts(self.ctx, handle)
        tail.extend(self._close())
        tail.append(
            self.event("response.completed", response=self.response("completed", self.items))
        )
        return b"".join(tail)

    def _delta_events(self, delta: Delta) -> list[bytes]:
        events: list[bytes] = []
        if delta.reasoning_content:
            self._text_delta("reasoning", delta.reasoning_content, events)
        if delta.content:
            self._text_delta("message", delta.content, events, logprobs=[])
        for piece in delta.tool_calls or ():
            function = piece.function
            if piece.id is not None and function is not None:
                events.extend(self._close())
                item: dict[str, Any] = {
                    "type": "function_call",
                    "id": _item_id("fc"),
                    "call_id": piece.id,
                    "name": function.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                self._open(item, events)
                self.calls[piece.index] = item
            item = self.calls[piece.index]
            arguments = function.arguments if function is not None else None
            if arguments:
                item["arguments"] += arguments
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=self.items.index(item),
                        delta=arguments,
                    )
                )
        return events

    def _text_delta(self, kind: str, text: str, events: list[bytes], **extra: Any) -> None:
        """Append ``text`` to the open item of ``kind`` (``reasoning`` or ``message``) and its
        delta event to ``events``."""
        item = self._ensure(kind, events)
        item["content"][0]["text"] += text
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        events.append(
            self.event(
                f"response.{name}.delta",
                item_id=item["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                **extra,
            )
        )

    def _ensure(self, kind: str, events: list[bytes]) -> dict[str, Any]:
        """The open item of ``kind``, opened now (closing another) when needed."""
        if self.open is not None and self.open["type"] == kind:
            return self.open
        events.extend(self._close())
        part_type = "reasoning_text" if kind == "reasoning" else "output_text"
        part: dict[str, Any] = {"type": part_type, "text": ""}
        item: dict[str, Any]
        if kind == "message":
            part["annotations"] = []
            item = {
                "type": "message",
                "id": _item_id("msg"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
        else:
            item = {"type": "reasoning", "id": _item_id("rs"), "summary": [], "content": []}
        self._open(item, events)
        output_index = len(self.items) - 1
        if kind == "message":
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=output_index,
                    content_index=0,
                    part=dict(part),
                )
            )
        item["content"].append(part)
        return item

    def _open(self, item: dict[str, Any], events: list[bytes]) -> None:
        self.items.append(item)
        self.open = item
        events.append(
            self.event(
                "response.output_item.added", output_index=len(self.items) - 1, item=dict(item)
            )
        )

    def _close(self) -> list[bytes]:
        item = self.open
        if item is None:
            return []
        self.open = None
        output_index = self.items.index(item)
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=output_index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            events.append(
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=output_index,
                    content_index=0,
                    part=part,
                )
            )
        elif item["type"] == "reasoning":
            events.append(
                self.event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=output_index,
                    content_index=0,
                    text=item["content"][0]["text"],
                )
            )
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=output_index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        item["status"] = "completed"
        if item["type"] == "reasoning":
            del item["status"]
        events.append(self.event("response.output_item.done", output_index=output_index, item=item))
        return events


def _items(message: AssistantMessage) -> list[dict[str, Any]]:
    """The output items of a whole message: thinking, text, calls."""
    items: list[dict[str, Any]] = []
    if message.reasoning_content:
        items.append(
            {
                "type": "reasoning",
                "id": _item_id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": message.reasoning_content}],
            }
        )
    if message.content:
        items.append(
            {
                "type": "message",
                "id": _item_id("msg"),
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": message.content, "annotations": []}],
            }
        )
    for call in message.tool_calls or ():
        items.append(
            {
                "type": "function_call",
                "id": _item_id("fc"),
                "call_id": call.id,
                "name": call.function.name,
                "arguments": call.function.arguments,
                "status": "completed",
            }
        )
    return items
