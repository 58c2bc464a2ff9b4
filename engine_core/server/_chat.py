"""``POST /v1/chat/completions``: messages rendered with the chat template, then generated."""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine_core._core.checks import show
from engine_core.outputs import RequestOutput
from engine_core.sampling_params import SamplingParams, StructuredOutputsParams
from engine_core.server._chat_output import ChatReader
from engine_core.server._chat_template import ChatTemplateError
from engine_core.server._errors import APIError
from engine_core.server._logprobs import chat_logprobs
from engine_core.server._protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionTokensDetails,
    Delta,
)
from engine_core.server._respond import (
    Fields,
    RequestContext,
    ResponseStream,
    new_id,
    respond,
)
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
from engine_core.server.tools._choice import (
    FunctionTool,
    ToolChoice,
    read_tool_choice,
    read_tools,
)

__all__ = [
    "chat_params",
    "chat_prompt",
    "chat_reader",
    "create_chat_completion",
    "max_tokens_field",
    "render_messages",
    "tool_choice_of",
]


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The roles OpenAI's chat API knows; any other is a 400 naming ``messages``."""


def _message_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as templates expect them: content flattened to a string."""
    if not body.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(body.messages):
        if message.role not in CHAT_ROLES:
            raise APIError(
                400,
                f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}, "
                f"got {show(message.role)}",
                param="messages",
            )
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400,
                        f"only text content parts are supported, got {part.get('type')!r}",
                        param="messages",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [_template_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        messages.append(entry)
    return messages


def _template_call(call: Any) -> dict[str, Any]:
    """An assistant message's tool call as templates expect it: the arguments decoded (HF
    templates write them with ``tojson``)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(
            400,
            'a tool call in messages must be {"id", "type": "function", "function": {"name", '
            '"arguments"}}',
            param="messages",
        )
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # else kept as the text it is
            arguments = json.loads(arguments)
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


_RESERVED_TEMPLATE_KWARGS = ("chat_template", "messages", "tokenize")
"""What ``chat_template_kwargs`` may not set: the server renders the request's own messages
with its own template (vLLM refuses ``chat_template`` and ``tokenize`` too)."""
_TEMPLATE_FLAGS = ("add_generation_prompt", "continue_final_message")
"""Request fields that ``chat_template_kwargs`` may override, as in vLLM."""


def _template_arguments(body: ChatCompletionRequest) -> tuple[dict[str, bool], dict[str, Any]]:
    """The template's flags (the request's, overridden by ``chat_template_kwargs``) and its
    other variables; 400 naming ``chat_template_kwargs`` for a name it may not set or a flag
    that is not a bool."""
    flags = {
        "add_generation_prompt": body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
    }
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = [name for name in _RESERVED_TEMPLATE_KWARGS if name in kwargs]
    if reserved:
        raise APIError(
            400,
            f"chat_template_kwargs may not set {', '.join(reserved)}: the server renders the "
            "request's messages with its own template",
            param="chat_template_kwargs",
        )
    for name in _TEMPLATE_FLAGS:
        if name in kwargs:
            value = kwargs.pop(name)
            if not isinstance(value, bool):
                raise APIError(
                    400,
                    f"chat_template_kwargs.{name} must be a bool, got {show(value)}",
                    param="chat_template_kwargs",
                )
            flags[name] = value
    if flags["add_generation_prompt"] and flags["continue_final_message"]:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true (set "
            "add_generation_prompt to false to continue the final message)",
            param="continue_final_message",
        )
    return flags, kwargs


def render_messages(
    state: ServerState, body: ChatCompletionRequest, tools: list[FunctionTool] | None = None
) -> PreparedPrompt:
    """The prompt of a chat request: the rendered template and its token ids, checked."""
    text, token_ids = chat_prompt(state, body, tools)
    return prepare_prompt(state, token_ids, "messages", text)


def chat_prompt(
    state: ServerState, body: ChatCompletionRequest, tools: list[FunctionTool] | None = None
) -> tuple[str, list[int]]:
    """The rendered template of a chat request's messages (given its tools, as Hugging Face
    templates take them: ``tools``, else read from the body) and its token ids (400 naming the
    field for messages, tools or template arguments it cannot render)."""
    if tools is None:
        tools = read_tools(body.tools)
    flags, kwargs = _template_arguments(body)
    if tools:
        kwargs["tools"] = [tool.as_template_tool() for tool in tools]
    try:
        text = state.chat_template.render(
            _message_dicts(body),
            add_generation_prompt=flags["add_generation_prompt"],
            continue_final_message=flags["continue_final_message"],
            **kwargs,
        )
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None
    token_ids = state.tokenizer.encode(text)
    bos = state.tokenizer.bos_token_id
    if bos is not None and len(token_ids) > 1 and token_ids[0] == token_ids[1] == bos:
        # The template wrote the BOS token and the tokenizer added another one.
        del token_ids[0]
    return text, token_ids


def _response_format(body: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The constraint ``response_format`` asks for (None for plain text)."""
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None
    if body.structured_outputs is not None:
        raise APIError(
            400,
            "give either response_format or structured_outputs, not both",
            param="response_format",
        )
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or not spec.schema:
            raise APIError(
                400, "response_format.json_schema.schema is required", param="response_format"
            )
        try:
            return StructuredOutputsParams(json=spec.schema)
        except (ValueError, TypeError) as exc:
            reason = str(exc).removeprefix("structured_outputs.json")
            raise APIError(
                400,
                f"response_format.json_schema.schema{reason}",
                param="response_format",
                code="invalid_value",
            ) from None
    raise APIError(
        400,
        f"response_format.type must be 'text', 'json_object' or 'json_schema', "
        f"got {response_format.type!r}",
        param="response_format",
    )


def max_tokens_field(body: ChatCompletionRequest) -> str | None:
    """The field that gives ``max_tokens`` (None: neither does; as many as fit)."""
    if body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens" if body.max_tokens is not None else None


def _constraint(
    state: ServerState, body: ChatCompletionRequest, choice: ToolChoice
) -> StructuredOutputsParams | None:
    """The request's grammar: its ``response_format`` or the calls its ``tool_choice`` asks
    for (not both), after the thinking when the server reads reasoning."""
    constraint = _response_format(body)
    tools = choice.constraint()
    if tools is not None:
        if constraint is not None or body.structured_outputs is not None:
            raise APIError(
                400,
                f'tool_choice "{choice.mode}" constrains the output to tool calls; it cannot '
                "be combined with response_format or structured_outputs",
                param="tool_choice",
            )
        constraint = tools
    constraint = constraint or body.structured_outputs
    reasoning = state.reasoning
    if constraint is not None and reasoning is not None:
        # A forced call's thinking is bounded, so that the call always comes.
        bound = state.max_forced_reasoning_chars if tools is not None else None
        constraint = reasoning.constrain(
            constraint,
            compact=state.disable_any_whitespace,
            max_thought_chars=bound,
            special_tokens=state.reasoning_markers_special,
        )
    return constraint


def tool_choice_of(state: ServerState, body: ChatCompletionRequest) -> ToolChoice:
    """The request's tools and ``tool_choice``, checked."""
    return read_tool_choice(
        body.tool_choice,
        read_tools(body.tools),
        body.parallel_tool_calls,
        auto_enabled=state.tool_parser is not None and state.auto_tool_choice,
    )


def chat_reader(state: ServerState, choice: ToolChoice) -> ChatReader:
    """How the request's outputs become messages."""
    parser = choice.parser(state.tool_parser)
    names = frozenset(tool.name for tool in choice.tools)
    return ChatReader(state.tokenizer, parser, state.reasoning, choice.parallel, names)


def chat_params(
    state: ServerState, body: ChatCompletionRequest, choice: ToolChoice
) -> SamplingParams:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
    max_tokens = body.max_completion_tokens
    renames = {"max_tokens": "max_completion_tokens"}
    if max_tokens is None:
        max_tokens = body.max_tokens
        renames = {}
    renames["logprobs"] = "top_logprobs"
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(
            400, "prompt_logprobs is only given in whole chat answers", param="prompt_logprobs"
        )
    params = sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_logprobs=body.prompt_logprobs,
        renames=renames,
        structured_outputs=_constraint(state, body, choice),
        compact_json=state.disable_any_whitespace,
        tokenizer=state.tokenizer,
    )
    # Formats whose markers are special tokens read them in the text: kept, and (harmony's)
    # without the spaces the detokenizer writes around them by default.
    reasoning = state.reasoning
    parser = state.tool_parser if choice.mode == "auto" else None
    keep, spaces = False, True
    if reasoning is not None and reasoning.keeps_special_tokens:
        keep, spaces = True, False
    if parser is not None and parser.keeps_special_tokens:
        keep, spaces = True, spaces and parser.spaces_around_special_tokens
    if keep:
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    if not spaces:
        params = msgspec.structs.replace(params, spaces_between_special_tokens=False)
    return params


def _fields(body: ChatCompletionRequest) -> Fields:
    grammar = "response_format" if body.structured_outputs is None else "structured_outputs"
    return Fields(prompt="messages", grammar=grammar)


async def create_chat_completion(
    state: ServerState, request: Request
) -> Response | EventStreamResponse:
    body = await read_body(request, ChatCompletionRequest, state)
    model = state.model_name(body.model)
    choice = tool_choice_of(state, body)
    params = chat_params(state, body, choice)
    check_sequences(state, 1, params.n, "messages")
    prompts = [render_messages(state, body, choice.tools)]
    check_lengths(state, prompts, params, max_tokens_field(body))
    ctx = RequestContext(
        state, body, prompts, params, model, new_id("chatcmpl"), fields=_fields(body)
    )
    reader = chat_reader(state, choice)
    return await respond(
        request,
        ctx,
        functools.partial(_ChatStream, reader=reader),
        ChatCompletion,
        functools.partial(_choices, reader),
        reader.usage_details,
    )


def _choices(
    reader: ChatReader,
    ctx: RequestContext[ChatCompletionRequest],
    prompt_index: int,
    output: RequestOutput,
) -> list[ChatChoice]:
    body = ctx.body
    choices = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        logprobs = None
        if body.logprobs and completion.logprobs is not None:
            logprobs = chat_logprobs(
                completion.logprobs, body.top_logprobs or 0, ctx.state.tokenizer
            )
        message, finish_reason = reader.message(completion)
        choices.append(
            ChatChoice(
                index=completion.index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish_reason,
            )
        )
    return choices


class _ChatStream(ResponseStream[ChatCompletionRequest, ChatChunkChoice]):
    """One streamed chat response: a role chunk per choice, then content chunks, then (when
    asked) a usage chunk."""

    chunk = ChatCompletionChunk

    def __init__(self, ctx: RequestContext[ChatCompletionRequest], *, reader: ChatReader) -> None:
        super().__init__(ctx)
        self.started = False
        self.reader = reader

    def usage_details(self) -> CompletionTokensDetails | None:
        return self.reader.usage_details()

    def events(self, prompt_index: int, output: RequestOutput) -> list[bytes]:
        body = self.ctx.body
        events = []
        if not self.started:
            self.started = True
            for index in range(body.n):
                role = ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))
                events.append(self.event([role]))
        top = body.top_logprobs or 0
        for completion in output.outputs:
            self.completion_tokens += len(completion.token_ids)
            logprobs = None
            if completion.logprobs:
                logprobs = chat_logprobs(completion.logprobs, top, self.ctx.state.tokenizer)
            delta, finish_reason = self.reader.stream(completion.index).delta(completion)
            if delta is None and logprobs is None and finish_reason is None:
                continue
            choice = ChatChunkChoice(
                index=completion.index,
                delta=delta or Delta(),
                logprobs=logprobs,
                finish_reason=finish_reason,
            )
            events.append(self.event([choice]))
        return events
