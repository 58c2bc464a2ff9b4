"""``log_requests`` (``--enable-log-requests``): one line per request; and the served model's
default name."""

from __future__ import annotations

import logging
import re

import pytest
from helpers.serving import serving

pytestmark = pytest.mark.anyio

_LINE = re.compile(
    r"^(cmpl|chatcmpl)-[0-9a-f]{24}: (\d+) prompt tokens, (\d+) output tokens, "
    r"finish_reason ([a-z,]+|cancelled \(the client left\)|failed \(.*\)), (\d+\.\d{3}) s$"
)


def _logged(caplog: pytest.LogCaptureFixture) -> list[tuple[str, ...]]:
    lines = [r.getMessage() for r in caplog.records if r.name == "engine_core.server.requests"]
    matches = [_LINE.match(line) for line in lines]
    assert all(matches), lines
    return [m.groups()[:4] for m in matches if m is not None]


async def test_one_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engine_core.server.requests")
    async with serving(settings={"log_requests": True}) as (client, _):
        body = {"prompt": "abc", "max_tokens": 5, "temperature": 0}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        streamed = {**body, "prompt": ["ab", "cd"], "stream": True, "n": 2, "temperature": 1}
        streamed["ignore_eos"] = True
        async with client.stream("POST", "/v1/completions", json=streamed) as response:
            assert response.status_code == 200
            async for _ in response.aiter_lines():
                pass
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        refused = {"prompt": "abc", "max_tokens": -1}
        assert (await client.post("/v1/completions", json=refused)).status_code == 400
    assert _logged(caplog) == [
        ("cmpl", "3", "5", "length"),
        ("cmpl", "4", "20", "length"),  # 2 prompts x n=2 x 5 tokens
        ("chatcmpl", _logged(caplog)[2][1], "3", "length"),
    ]  # the refused request never reached the engine: no line


async def test_no_lines_unless_asked(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engine_core.server.requests")
    async with serving() as (client, _):
        body = {"prompt": "abc", "max_tokens": 5}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    assert _logged(caplog) == []


async def test_served_model_name_defaults_to_the_backend() -> None:
    async with serving() as (client, _):
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["mock"]
        body = {"model": "mock", "prompt": "abc", "max_tokens": 5, "temperature": 0}
        response = await client.post("/v1/completions", json=body)
        assert response.json()["choices"][0]["text"] == "defgh"
