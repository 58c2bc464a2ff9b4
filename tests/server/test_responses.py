"""``POST /v1/responses`` through the official ``openai`` client, under asyncio and trio: text,
reasoning, JSON schemas and function tools, whole and streamed with the semantic events, an
agent loop over function_call_output items, and the storage fields refused."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from helpers.tool_servers import (
    ANSWER_SCHEMA,
    BROKEN,
    MODEL,
    TIME_SCHEMA,
    WEATHER_ARGS,
    WEATHER_SCHEMA,
    ToolServers,
    in_thread,
)

pytestmark = pytest.mark.anyio

WEATHER_TOOL: Any = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}
TIME_TOOL: Any = {"type": "function", "name": "get_time", "parameters": TIME_SCHEMA}


async def create(servers: ToolServers, server: str, **kwargs: Any) -> Any:
    client = servers.client(server)
    return await in_thread(client.responses.create, model=MODEL, **kwargs)


async def events(servers: ToolServers, server: str, **kwargs: Any) -> list[Any]:
    client = servers.client(server)
    return await in_thread(
        lambda: list(client.responses.create(model=MODEL, stream=True, **kwargs))
    )


def _final(stream: list[Any]) -> Any:
    assert stream[0].type == "response.created" and stream[-1].type == "response.completed"
    assert [e.sequence_number for e in stream] == list(range(len(stream)))
    return stream[-1].response


def _summary(response: Any) -> list[tuple[str, Any]]:
    """(type, what it says) of each output item."""
    found: list[tuple[str, Any]] = []
    for item in response.output:
        if item.type == "message":
            found.append(("message", "".join(part.text for part in item.content)))
        elif item.type == "reasoning":
            found.append(("reasoning", "".join(part.text for part in item.content)))
        else:
            found.append((item.type, (item.name, json.loads(item.arguments))))
    return found


async def test_text_whole_and_streamed(servers: ToolServers) -> None:
    kwargs = {"input": "hi", "temperature": 0, "max_output_tokens": 4}
    whole = await create(servers, "plain", **kwargs)
    assert whole.object == "response" and whole.output_text == ";<=>"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 4
    stream = await events(servers, "plain", **kwargs)
    deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == ";<=>"
    kinds = [e.type for e in stream]
    for kind in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.output_item.done",
    ):
        assert kind in kinds
    assert _final(stream).output_text == ";<=>"


async def test_instructions_and_message_input_reach_the_template(servers: ToolServers) -> None:
    response = await create(
        servers,
        "plain",
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        temperature=0,
        max_output_tokens=1,
    )
    # "system: Be brief.\nuser: hi\nassistant:"
    assert response.usage.input_tokens == len("system: Be brief.\nuser: hi\nassistant:")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_function_tool_gives_a_function_call_item(
    servers: ToolServers, stream: bool
) -> None:
    kwargs = {"input": "hermes weather", "tools": [WEATHER_TOOL]}
    if stream:
        got = await events(servers, "hermes", **kwargs)
        response = _final(got)
        pieces = [e.delta for e in got if e.type == "response.function_call_arguments.delta"]
        assert json.loads("".join(pieces)) == WEATHER_ARGS
        added = [e.item.type for e in got if e.type == "response.output_item.added"]
        assert added == ["message", "function_call"]
    else:
        response = await create(servers, "hermes", **kwargs)
    (kind, text), call_item = _summary(response)
    assert kind == "message" and text.strip() == "Let me check."
    assert call_item == ("function_call", ("get_weather", WEATHER_ARGS))
    call = response.output[-1]
    assert call.call_id.startswith("call_") and call.status == "completed"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_reasoning_and_a_json_schema(servers: ToolServers, stream: bool) -> None:
    schema = ANSWER_SCHEMA
    kwargs = {
        "input": "json think",
        "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    }
    if stream:
        got = await events(servers, "hermes", **kwargs)
        response = _final(got)
        thought = [e.delta for e in got if e.type == "response.reasoning_text.delta"]
        assert "".join(thought) == "It wants JSON."
    else:
        response = await create(servers, "hermes", **kwargs)
    assert _summary(response) == [("reasoning", "It wants JSON."), ("message", '{"answer": 4}')]
    assert response.usage.output_tokens_details.reasoning_tokens == len(
        "<think>It wants JSON.</think>"
    )


async def test_agent_loop_over_function_call_output(servers: ToolServers) -> None:
    items: list[Any] = [{"role": "user", "content": "agent: the weather in Paris?"}]
    first = await create(servers, "hermes", input=items, tools=[WEATHER_TOOL])
    call = first.output[-1]
    assert call.type == "function_call" and json.loads(call.arguments) == WEATHER_ARGS
    items += [item.model_dump(exclude_none=True) for item in first.output]
    output = json.dumps({"temperature": 22, "unit": "celsius"})
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": output})
    second = await create(servers, "hermes", input=items, tools=[WEATHER_TOOL])
    assert second.output_text == "It is 22 degrees in Paris."
    assert second.status == "completed"


def _items(response: Any) -> list[tuple[str, Any]]:
    """(type, stripped text or (name, arguments text)) of each output item."""
    found: list[tuple[str, Any]] = []
    for item in response.output:
        if item.type == "function_call":
            found.append((item.type, (item.name, item.arguments)))
        else:
            found.append((item.type, "".join(part.text for part in item.content).strip()))
    return found


@pytest.mark.parametrize(
    ("text", "tools"),
    [
        ("truncated", [WEATHER_TOOL]),
        ("broken", [WEATHER_TOOL]),
        ("call then cut", [WEATHER_TOOL, TIME_TOOL]),
        ("hermes two", [WEATHER_TOOL]),  # the second call names a tool not offered
        ("hermes two", [WEATHER_TOOL, TIME_TOOL]),
    ],
)
async def test_streamed_and_whole_responses_agree(
    servers: ToolServers, text: str, tools: list[Any]
) -> None:
    whole = await create(servers, "hermes", input=text, tools=tools)
    got = await events(servers, "hermes", input=text, tools=tools)
    streamed = _final(got)
    assert _items(streamed) == _items(whole)
    assert streamed.status == whole.status == "completed"
    for item in streamed.output:
        if item.type == "function_call":
            assert isinstance(json.loads(item.arguments), dict)
    added = [e.item.type for e in got if e.type == "response.output_item.added"]
    assert added == [item.type for item in streamed.output]
    offered = {tool["name"] for tool in tools}
    assert all(i.name in offered for i in streamed.output if i.type == "function_call")
    if text in ("truncated", "broken"):
        assert _items(whole) == [("message", BROKEN[text])]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"input": [{"type": "image", "url": "x"}]}, "input"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
        ),
    ],
)
async def test_unsupported_fields_are_400_naming_them(
    servers: ToolServers, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await create(servers, "hermes", **{"input": "hi", **kwargs})
    assert caught.value.body["param"] == param  # type: ignore[index]
    if param in ("previous_response_id", "store"):
        assert "not supported" in caught.value.body["message"]  # type: ignore[index]


_CALL: Any = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": "{}",
}


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([{k: v for k, v in _CALL.items() if k != "call_id"}], "needs call_id"),
        ([{k: v for k, v in _CALL.items() if k != "name"}], "needs name"),
        ([_CALL | {"arguments": {"city": "Paris"}}], "needs arguments as a string"),
        ([_CALL, {"type": "function_call_output", "call_id": "call_1"}], "needs an output"),
        (
            [_CALL, {"type": "function_call_output", "call_id": "call_1", "output": 22}],
            "output must be a string or a list of text parts",
        ),
        (
            [{"type": "function_call_output", "call_id": "call_9", "output": "22"}],
            "no function_call item before it has call_id 'call_9'",
        ),
    ],
)
async def test_function_call_items_are_checked(
    servers: ToolServers, items: list[Any], message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await create(servers, "hermes", input=items, tools=[WEATHER_TOOL])
    assert caught.value.body["param"] == "input"  # type: ignore[index]
    assert message in caught.value.body["message"]  # type: ignore[index]


async def test_a_function_call_output_may_be_text_parts(servers: ToolServers) -> None:
    output = [{"type": "input_text", "text": '{"temperature": 22, "unit": "celsius"}'}]
    items = [
        {"role": "user", "content": "agent: the weather in Paris?"},
        _CALL,
        {"type": "function_call_output", "call_id": "call_1", "output": output},
    ]
    response = await create(servers, "hermes", input=items, tools=[WEATHER_TOOL])
    assert response.output_text == "It is 22 degrees in Paris."
