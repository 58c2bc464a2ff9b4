"""``POST /v1/responses``: the Responses API without server-side storage, answered by the chat
completion machinery (template, tools, reasoning, grammars) and written as output items, whole
or as the semantic stream events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``,
``response.completed``, ...)."""

from __future__ import annotations

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
from engine_core.server._respond import Fields, RequestContext, pinned_rank, run_prompts
from engine_core.server._responses_input import ResponsesRequest, to_chat_request
from engine_core.server._responses_items import OutputItems, item_id
from engine_core.server._serving import ServerState, check_lengths, read_body
from engine_core.server._sse import Emit, EventStreamResponse, cancel_on_disconnect

__all__ = ["create_response"]

_ENCODER = msgspec.json.Encoder()
_RENAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}


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
        item_id("resp"),
        fields=Fields(prompt="input", grammar="text"),
        data_parallel_rank=pinned_rank(request, state),
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
        # Read as a stream of one piece: the same items as the streamed answer.
        items = OutputItems()
        parts, self.finish_reason = self.reader.stream(0).parts(completion)
        items.add(parts)
        items.close()
        return self.response("completed", items.items)

    # -- streamed -----------------------------------------------------------------------------

    async def stream(self, emit: Emit) -> bytes:
        items = OutputItems()
        start = self.response("in_progress", [])
        await emit(
            items.event("response.created", response=start)
            + items.event("response.in_progress", response=start)
        )
        tail: list[bytes] = []

        async def handle(index: int, output: RequestOutput) -> None:
            completion = output.outputs[0]
            self.output_tokens += len(completion.token_ids)
            parts, reason = self.reader.stream(0).parts(completion)
            events = items.add(parts)
            if reason is not None:
                self.finish_reason = reason
                tail.extend(events)
            elif events:
                await emit(b"".join(events))

        await run_prompts(self.ctx, handle)
        tail.extend(items.close())
        tail.append(
            items.event("response.completed", response=self.response("completed", items.items))
        )
        return b"".join(tail)
