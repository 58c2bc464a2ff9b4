"""Fuzzed tool, reasoning and Responses requests: whatever the tools, tool choices, tool-call
histories and input items, the server answers 200 or a 400 in OpenAI's shape, never a 5xx."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest
from helpers.serving import fuzz_server
from helpers.tool_servers import TOOLS, WEATHER_SCHEMA, tool_servers
from hypothesis import strategies as st

pytestmark = pytest.mark.anyio

MAX_EXAMPLES = 120

odd = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.text(max_size=8),
    st.sampled_from(["function", "get_weather", "auto", "none", "required", "{", "\\"]),
)
json_like = st.recursive(
    odd,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["type", "name", "function", "parameters", "arguments", "x"]),
            inner,
            max_size=3,
        )
    ),
    max_leaves=8,
)
tools = st.one_of(
    st.just(TOOLS),
    st.lists(json_like, max_size=3),
    st.lists(
        st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": odd})},
            optional={"parameters": st.one_of(json_like, st.just(WEATHER_SCHEMA))},
        ),
        max_size=2,
    ),
)
tool_choice = st.one_of(
    odd,
    json_like,
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": odd})}
    ),
)
tool_call = st.fixed_dictionaries(
    {},
    optional={
        "id": odd,
        "type": odd,
        "function": st.one_of(
            json_like,
            st.fixed_dictionaries(
                {"name": st.sampled_from(["get_weather", "x"]), "arguments": odd}
            ),
        ),
    },
)
chat_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool", "system"])},
        optional={
            "content": st.one_of(odd, st.sampled_from(["hermes weather", "think", "broken"])),
            "tool_calls": st.one_of(st.lists(tool_call, max_size=2), json_like),
            "tool_call_id": odd,
            "reasoning_content": odd,
        },
    ),
    min_size=1,
    max_size=4,
)
input_items = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "developer", "assistant", "x"])},
            optional={"content": st.one_of(odd, st.lists(json_like, max_size=2))},
        ),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function_call", "function_call_output", "reasoning", "x"])},
            optional={"call_id": odd, "name": odd, "arguments": odd, "output": json_like},
        ),
        json_like,
    ),
    max_size=4,
)


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": draw(chat_messages), "max_tokens": 24}
    for name, strategy in [
        ("tools", tools),
        ("tool_choice", tool_choice),
        ("parallel_tool_calls", odd),
        ("stream", st.booleans()),
        ("response_format", st.sampled_from([None, {"type": "json_object"}])),
        ("n", st.integers(1, 2)),
    ]:
        if draw(st.booleans()):
            body[name] = draw(strategy)
    return body


@st.composite
def responses_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input": draw(st.one_of(odd, input_items, st.just("hermes weather"))),
        "max_output_tokens": 24,
    }
    for name, strategy in [
        ("tools", st.one_of(tools, st.just([{"type": "function", "name": "get_weather"}]))),
        ("tool_choice", tool_choice),
        ("instructions", odd),
        ("stream", st.booleans()),
        ("text", st.one_of(json_like, st.just({"format": {"type": "json_object"}}))),
        ("store", odd),
        ("previous_response_id", odd),
    ]:
        if draw(st.booleans()):
            body[name] = draw(strategy)
    return body


def fuzz(url: str, path: str, strategy: st.SearchStrategy[dict[str, Any]]) -> int:
    def post(client: httpx.Client, body: dict[str, Any]) -> None:
        with client.stream("POST", path, json=body) as response:
            data = response.read()
        context = (path, json.dumps(body)[:400], response.status_code, data[:300])
        assert response.status_code in (200, 400), context
        if response.status_code == 400:
            assert json.loads(data)["error"]["type"] == "invalid_request_error", context
        elif data.startswith((b"data: ", b"event: ")):
            assert data.endswith(b"data: [DONE]\n\n"), context
            assert b'"server_error"' not in data, context

    return fuzz_server(url, strategy, post, MAX_EXAMPLES)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_fuzzed_tool_requests_get_no_5xx(anyio_backend: str) -> None:
    async with tool_servers() as servers:
        url = servers.urls["hermes"]
        with anyio.fail_after(300):
            for path, strategy in [
                ("/v1/chat/completions", chat_bodies()),
                ("/v1/responses", responses_bodies()),
            ]:
                assert await anyio.to_thread.run_sync(fuzz, url, path, strategy) >= MAX_EXAMPLES
