"""Stream events never break a line reader: U+2028, U+2029 and U+0085 in a streamed answer go
out escaped in every ``data:`` line (httpx's ``aiter_lines()``, like Python's ``splitlines``,
splits on them), in chat, completions and Responses streams, under asyncio and trio."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from helpers.serving import serving

from engine_core.server._sse import sse_event

pytestmark = pytest.mark.anyio

TEXT = "line\u2028para\u2029next\x85end"
REPLIES = [{"match": "breaks", "text": TEXT}]


@pytest.fixture(scope="module")
async def client(anyio_backend: str) -> AsyncIterator[httpx.AsyncClient]:
    async with serving(multiprocess=False, backend_options={"replies": REPLIES}) as (c, _):
        yield c


def test_the_event_escapes_them() -> None:
    data = json.dumps({"t": TEXT}, ensure_ascii=False).encode()
    event = sse_event(data)
    assert event == b'data: {"t": "line\\u2028para\\u2029next\\u0085end"}\n\n'
    assert json.loads(event.removeprefix(b"data: "))["t"] == TEXT


async def _events(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    """The JSON of every ``data:`` line, read as line readers read them."""
    events = []
    async with client.stream("POST", path, json={"model": "mock", "stream": True, **body}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line and not line.startswith("event:") and line != "data: [DONE]":
                assert line.startswith("data: "), repr(line)
                events.append(json.loads(line.removeprefix("data: ")))  # never a broken line
    return events


async def test_streams_carry_them_whole(client: httpx.AsyncClient) -> None:
    chat = await _events(
        client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "breaks"}]}
    )
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in chat) == TEXT
    completion = await _events(client, "/v1/completions", {"prompt": "breaks", "max_tokens": 50})
    assert "".join(e["choices"][0]["text"] for e in completion) == TEXT
    responses = await _events(client, "/v1/responses", {"input": "breaks"})
    deltas = [e["delta"] for e in responses if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == TEXT
