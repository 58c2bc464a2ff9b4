"""Fuzzed JSON schemas nested around the limit (100 levels) on every surface where the server
builds a grammar from one: chat ``tools`` with ``tool_choice`` ``"required"`` or named,
``response_format`` ``json_schema``, ``structured_outputs``, ``/v1/completions``'
``structured_outputs``, and ``/v1/responses``' ``text.format`` and tools. Each answer is a 200
or a 400 naming the field, under asyncio and trio; never a 5xx."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest
from helpers.serving import fuzz_server
from helpers.tool_servers import tool_servers
from hypothesis import strategies as st

pytestmark = pytest.mark.anyio

MAX_EXAMPLES = 12
"""Per surface."""
LIMIT = 100
"""The deepest a schema may nest (``engine_core._core.checks.MAX_JSON_DEPTH``)."""
CALL_LIST_DEPTH = 5
"""How much deeper ``"required"``'s call list nests a tool's parameters."""

_USER = [{"role": "user", "content": "x"}]


def nesting(value: Any) -> int:
    """Levels of arrays and objects in ``value`` (0 for a scalar)."""
    if isinstance(value, dict):
        return 1 + max(map(nesting, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(nesting, value), default=0)
    return 0


@st.composite
def deep_schemas(draw: st.DrawFn) -> dict[str, Any]:
    """A schema nested about ``LIMIT`` levels: objects, arrays, ``anyOf`` and deep values."""
    target = draw(st.integers(LIMIT - 12, LIMIT + 24))
    schema: Any = draw(
        st.sampled_from([{"type": "string"}, {"type": "integer"}, {"const": [[[1]]]}])
    )
    while nesting(schema) < target:
        step = draw(st.sampled_from(["properties", "items", "anyOf", "default"]))
        if step == "properties":
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        elif step == "items":
            schema = {"type": "array", "items": schema}
        elif step == "anyOf":
            schema = {"anyOf": [schema, {"type": "null"}]}
        else:
            schema = {"type": "array", "items": schema, "default": [[[[[[]]]]]]}
    assert isinstance(schema, dict)
    return schema


def _tool(schema: dict[str, Any], flat: bool) -> dict[str, Any]:
    if flat:
        return {"type": "function", "name": "f", "parameters": schema}
    return {"type": "function", "function": {"name": "f", "parameters": schema}}


def surface(name: str, schema: dict[str, Any], stream: bool) -> tuple[str, dict[str, Any], str]:
    """(path, body, the field a 400 names) of one surface."""
    chat: dict[str, Any] = {"messages": _USER, "max_tokens": 2, "stream": stream}
    named = {"type": "function", "function": {"name": "f"}}
    if name == "tools required":
        body = chat | {"tools": [_tool(schema, False)], "tool_choice": "required"}
        return "/v1/chat/completions", body, "tools"
    if name == "tools named":
        body = chat | {"tools": [_tool(schema, False)], "tool_choice": named}
        return "/v1/chat/completions", body, "tools"
    if name == "response_format":
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
        return "/v1/chat/completions", chat | {"response_format": fmt}, "response_format"
    if name == "structured_outputs":
        return "/v1/chat/completions", chat | {"structured_outputs": {"json": schema}}, name
    if name == "completions":
        body = {"prompt": "x", "max_tokens": 2, "stream": stream}
        return (
            "/v1/completions",
            body | {"structured_outputs": {"json": schema}},
            "structured_outputs",
        )
    responses: dict[str, Any] = {"input": "x", "max_output_tokens": 2, "stream": stream}
    if name == "text.format":
        fmt = {"format": {"type": "json_schema", "name": "a", "schema": schema}}
        return "/v1/responses", responses | {"text": fmt}, "text"
    choice = "required" if name == "responses required" else {"type": "function", "name": "f"}
    return (
        "/v1/responses",
        responses | {"tools": [_tool(schema, True)], "tool_choice": choice},
        "tools",
    )


SURFACES = [
    "tools required",
    "tools named",
    "response_format",
    "structured_outputs",
    "completions",
    "text.format",
    "responses required",
    "responses named",
]


def fuzz(url: str, name: str) -> set[int]:
    """The statuses of fuzzed requests on surface ``name``."""
    seen: set[int] = set()

    def post(client: httpx.Client, example: tuple[dict[str, Any], bool]) -> None:
        schema, stream = example
        path, body, param = surface(name, schema, stream)
        with client.stream("POST", path, json=body) as response:
            data = response.read()
        context = (name, nesting(schema), response.status_code, data[:300])
        allowed = LIMIT - (CALL_LIST_DEPTH if name.endswith("required") else 0)
        if nesting(schema) > allowed:
            assert response.status_code == 400, context
        assert response.status_code in (200, 400), context
        if response.status_code == 400:
            error = json.loads(data)["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", param), context
            assert "deep" in error["message"], context
        elif stream:
            assert data.endswith(b"data: [DONE]\n\n") or b"response.completed" in data, context
            assert b'"server_error"' not in data, context
        seen.add(response.status_code)

    fuzz_server(url, st.tuples(deep_schemas(), st.booleans()), post, MAX_EXAMPLES, timeout_s=30.0)
    return seen


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_deep_schemas_are_a_400_naming_the_field_everywhere(anyio_backend: str) -> None:
    pytest.importorskip("llguidance")
    async with tool_servers() as servers:
        with anyio.fail_after(300):
            for name in SURFACES:
                seen = await anyio.to_thread.run_sync(fuzz, servers.urls["hermes"], name)
                assert 400 in seen, name
