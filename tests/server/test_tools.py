"""Tool calling in chat completions through the official ``openai`` client, under asyncio and
trio: grammars for ``"required"`` and named tools, each parser's format under ``"auto"``
(whole and streamed), malformed calls, ``"none"``, the SDK's ``parse`` helper and an agent loop.
The mock plays the model with scripted replies (``tests/helpers/tool_servers.py``)."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
from helpers.tool_servers import (
    BROKEN,
    HERMES_CALLS,
    MODEL,
    SCHEMAS,
    TIME_ARGS,
    TOOLS,
    WEATHER_ARGS,
    ToolServers,
    in_thread,
)
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engine_core.sampling_params import StructuredOutputsParams
from engine_core.server.tools._choice import (
    MAX_REQUIRED_TOOLS,
    call_list_schema,
    read_tool_choice,
    read_tools,
)

pytestmark = pytest.mark.anyio

MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", '"name"')


def _user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


async def chat(servers: ToolServers, server: str, text: str, **kwargs: Any) -> ChatCompletion:
    client = servers.client(server)
    return await in_thread(
        client.chat.completions.create, model=MODEL, messages=_user(text), **kwargs
    )


async def chat_stream(
    servers: ToolServers, server: str, text: str, **kwargs: Any
) -> list[ChatCompletionChunk]:
    client = servers.client(server)
    return await in_thread(
        lambda: list(
            client.chat.completions.create(model=MODEL, messages=_user(text), stream=True, **kwargs)
        )
    )


def assembled(chunks: list[ChatCompletionChunk]) -> tuple[str, list[dict[str, str]], str | None]:
    """(content, calls as {"id", "name", "arguments"}, finish reason) of a stream, checking
    that each call's id and name come once, in its first piece."""
    content = ""
    calls: dict[int, dict[str, str]] = {}
    reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for piece in choice.delta.tool_calls or ():
                function = piece.function
                assert function is not None
                if piece.index not in calls:
                    assert piece.id and function.name and piece.type == "function"
                    calls[piece.index] = {"id": piece.id, "name": function.name, "arguments": ""}
                else:
                    assert piece.id is None and function.name is None
                calls[piece.index]["arguments"] += function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], reason


def whole_calls(result: ChatCompletion) -> list[dict[str, str]]:
    calls = result.choices[0].message.tool_calls or []
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}  # type: ignore[union-attr]
        for c in calls
    ]


def check_valid(calls: list[dict[str, str]]) -> None:
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def _without_ids(calls: list[dict[str, str]]) -> list[tuple[str, Any]]:
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


# -- grammars: a named tool and "required" ----------------------------------------------------


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"],
)
async def test_constrained_calls_validate_streamed_and_not(
    servers: ToolServers, tool_choice: Any
) -> None:
    # No scripted reply: the mock's own tokens, moved by the grammar, still give valid calls.
    kwargs = {
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "temperature": 0,
        "max_tokens": 200,
        "parallel_tool_calls": False,
    }
    result = await chat(servers, "plain", "anything", **kwargs)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = whole_calls(result)
    assert len(calls) == 1
    if tool_choice != "required":
        assert calls[0]["name"] == "get_weather"
    check_valid(calls)
    content, streamed, reason = assembled(await chat_stream(servers, "plain", "anything", **kwargs))
    assert (content, reason) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c["name"], c["arguments"]) for c in calls
    ]


async def test_required_gives_parallel_calls(servers: ToolServers) -> None:
    kwargs = {"tools": TOOLS, "tool_choice": "required", "temperature": 0}
    result = await chat(servers, "plain", "required two", **kwargs)
    expected = [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]
    assert _without_ids(whole_calls(result)) == expected
    _, streamed, _ = assembled(await chat_stream(servers, "plain", "required two", **kwargs))
    assert _without_ids(streamed) == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_cut_required_answer_returns_the_calls_that_parsed(
    servers: ToolServers, stream: bool
) -> None:
    # The scripted two calls, cut by max_tokens inside the second: the first stands.
    first = json.dumps({"name": "get_weather", "parameters": WEATHER_ARGS})
    kwargs = {"tools": TOOLS, "tool_choice": "required", "max_tokens": len(f"[{first}, ") + 12}
    if stream:
        content, calls, reason = assembled(
            await chat_stream(servers, "plain", "required two", **kwargs)
        )
    else:
        result = await chat(servers, "plain", "required two", **kwargs)
        content = result.choices[0].message.content or ""
        calls, reason = whole_calls(result), result.choices[0].finish_reason
    assert (_without_ids(calls), reason) == ([("get_weather", WEATHER_ARGS)], "length")
    assert content.strip() == '{"name": "ge'


@pytest.mark.parametrize("temperature", [0, None], ids=["greedy", "default"])
async def test_required_on_the_mock_gives_one_call(
    servers: ToolServers, temperature: float | None
) -> None:
    # No scripted reply: the mock closes what the grammar lets it close, so the output is one
    # call at temperature 0 and at the default temperature alike.
    kwargs: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 150}
    if temperature is not None:
        kwargs["temperature"] = temperature
    for seed in range(5):
        result = await chat(servers, "plain", "anything", seed=seed, **kwargs)
        assert result.choices[0].finish_reason == "tool_calls"
        calls = whole_calls(result)
        assert len(calls) == 1
        check_valid(calls)


# -- "auto": each parser ----------------------------------------------------------------------


@pytest.mark.parametrize("server", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_auto_reads_each_format(servers: ToolServers, server: str, stream: bool) -> None:
    prefix = server.removesuffix("3_json")
    for text, expected in [
        (f"{prefix} weather", [("get_weather", WEATHER_ARGS)]),
        (f"{prefix} two", [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]),
    ]:
        if stream:
            content, calls, reason = assembled(
                await chat_stream(servers, server, text, tools=TOOLS)
            )
        else:
            result = await chat(servers, server, text, tools=TOOLS)
            content = result.choices[0].message.content or ""
            calls, reason = whole_calls(result), result.choices[0].finish_reason
        assert _without_ids(calls) == expected
        assert reason == "tool_calls"
        assert not any(mark in content for mark in MARKUP), content
        if text == "hermes weather":
            assert content.strip() == "Let me check."
        check_valid(calls)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_auto_without_parallel_calls_keeps_the_first(
    servers: ToolServers, stream: bool
) -> None:
    kwargs = {"tools": TOOLS, "parallel_tool_calls": False}
    if stream:
        _, calls, _ = assembled(await chat_stream(servers, "hermes", "hermes two", **kwargs))
    else:
        calls = whole_calls(await chat(servers, "hermes", "hermes two", **kwargs))
    assert _without_ids(calls) == [("get_weather", WEATHER_ARGS)]


async def answer(
    servers: ToolServers, text: str, stream: bool, **kwargs: Any
) -> tuple[str, list[dict[str, str]], str | None]:
    """(content, calls, finish reason) of the hermes server's answer, streamed or whole."""
    if stream:
        return assembled(await chat_stream(servers, "hermes", text, **kwargs))
    result = await chat(servers, "hermes", text, **kwargs)
    content, calls = result.choices[0].message.content or "", whole_calls(result)
    return content, calls, result.choices[0].finish_reason


@pytest.mark.parametrize("broken", ["broken", "truncated"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_malformed_call_text_comes_back_as_content(
    servers: ToolServers, broken: str, stream: bool
) -> None:
    # The truncated call's name is readable early: a stream must not send it all the same.
    got = await answer(servers, broken, stream, tools=TOOLS)
    assert got == (BROKEN[broken], [], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_calls_before_a_broken_one_stand(servers: ToolServers, stream: bool) -> None:
    content, calls, reason = await answer(servers, "call then cut", stream, tools=TOOLS)
    assert (_without_ids(calls), reason) == ([("get_time", TIME_ARGS)], "tool_calls")
    assert content.strip() == BROKEN["truncated"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_call_to_a_tool_not_offered_is_content(servers: ToolServers, stream: bool) -> None:
    weather_only = [TOOLS[0]]
    content, calls, reason = await answer(servers, "hermes two", stream, tools=weather_only)
    assert (_without_ids(calls), reason) == ([("get_weather", WEATHER_ARGS)], "tool_calls")
    assert content.strip().startswith('<tool_call>\n{"name": "get_time"')
    time_only = [TOOLS[1]]
    content, calls, reason = await answer(servers, "hermes weather", stream, tools=time_only)
    assert (content, calls, reason) == (f"Let me check.\n{HERMES_CALLS['get_weather']}", [], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_none_never_returns_calls(servers: ToolServers, stream: bool) -> None:
    if stream:
        content, calls, reason = assembled(
            await chat_stream(servers, "hermes", "hermes weather", tools=TOOLS, tool_choice="none")
        )
    else:
        result = await chat(servers, "hermes", "hermes weather", tools=TOOLS, tool_choice="none")
        content, calls = result.choices[0].message.content or "", whole_calls(result)
        reason = result.choices[0].finish_reason
    assert calls == [] and reason == "stop"
    assert content.startswith("Let me check.\n<tool_call>")


async def test_tools_reach_the_chat_template(servers: ToolServers) -> None:
    # The template writes "tools: get_weather get_time;" first; greedy then counts up from
    # the prompt's last byte, which the tools do not change, so compare the prompt lengths.
    with_tools = await chat(servers, "plain", "hi", tools=TOOLS, tool_choice="none", max_tokens=1)
    without = await chat(servers, "plain", "hi", max_tokens=1)
    assert with_tools.usage is not None and without.usage is not None
    assert with_tools.usage.prompt_tokens - without.usage.prompt_tokens == len(
        "tools: get_weather get_time;"
    )


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("server", "kwargs", "param"),
    [
        ("plain", {"tools": TOOLS}, "tool_choice"),  # "auto" needs a parser
        (
            "hermes",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ("hermes", {"tool_choice": "required"}, "tool_choice"),
        ("hermes", {"tools": [{"type": "retrieval"}]}, "tools"),
        (
            "hermes",
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
async def test_invalid_tool_requests_are_400(
    servers: ToolServers, server: str, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await chat(servers, server, "hi", **kwargs)
    assert caught.value.body["param"] == param  # type: ignore[index]


async def test_too_many_tools_for_required_are_refused_up_front(servers: ToolServers) -> None:
    # Past llguidance's row limit the grammar would fail at the first token.
    many = [
        {"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object"}}}
        for i in range(2000)
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        await chat(servers, "plain", "hi", tools=many, tool_choice="required", max_tokens=2)
    error: Any = caught.value.body
    assert error["param"] == "tools"
    assert f"at most {MAX_REQUIRED_TOOLS} tools, got 2000" in error["message"]
    assert "llguidance" in error["message"]


def test_the_most_tools_required_takes_still_parse() -> None:
    pytest.importorskip("llguidance")
    from engine_core._structured.grammar import GrammarSpec, build_tokenizer, compile_grammar

    def tools(count: int) -> list[Any]:
        return [
            {"type": "function", "function": {"name": f"t_{i}", "parameters": {"type": "object"}}}
            for i in range(count)
        ]

    tokenizer = build_tokenizer("byte", 258)
    for parallel in (True, False):
        choice = read_tool_choice(
            "required", read_tools(tools(MAX_REQUIRED_TOOLS)), parallel, auto_enabled=False
        )
        params = choice.constraint()
        assert params is not None
        matcher = compile_grammar(tokenizer, GrammarSpec.from_params(params))
        assert all(matcher.consume_token(b) for b in b'[{"name": "t_1899", "parameters": {}}]')
        assert not matcher.is_error()
    # Why the bound: with 2,000 tools llguidance refuses the call list's first row (were its
    # limit to grow, so could MAX_REQUIRED_TOOLS).
    params = StructuredOutputsParams(json=call_list_schema(read_tools(tools(2000)), True))
    matcher = compile_grammar(tokenizer, GrammarSpec.from_params(params))
    assert not all(matcher.consume_token(b) for b in b'[{"name": "t_')
    assert "max is 2000" in matcher.get_error()


# -- the SDK's helpers and an agent loop ------------------------------------------------------


class GetWeather(pydantic.BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


async def test_sdk_parse_with_a_pydantic_function_tool(servers: ToolServers) -> None:
    client = servers.client("hermes")
    result = await in_thread(
        client.chat.completions.parse,
        model=MODEL,
        messages=_user("hermes weather"),
        tools=[openai.pydantic_function_tool(GetWeather, name="get_weather")],
    )
    call = result.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.parsed_arguments == GetWeather(city="Paris", unit="celsius")  # type: ignore[union-attr]


async def test_agent_loop_call_then_tool_message_then_answer(servers: ToolServers) -> None:
    client = servers.client("hermes")
    messages: list[Any] = _user("agent: what is the weather in Paris?")
    first = await in_thread(
        client.chat.completions.create, model=MODEL, messages=messages, tools=TOOLS
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        assert json.loads(call.function.arguments) == WEATHER_ARGS  # type: ignore[union-attr]
        result = {"temperature": 22, "unit": "celsius"}
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    second = await in_thread(
        client.chat.completions.create, model=MODEL, messages=messages, tools=TOOLS
    )
    assert second.choices[0].message.content == "It is 22 degrees in Paris."
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.tool_calls is None
