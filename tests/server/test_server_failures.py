"""The server when the engine is full: each test starts its own server (in this process's event
loop) under asyncio and trio, and talks to it with httpx's async client. The engine's death is
in test_server_hygiene.py."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
from helpers.serving import serving

pytestmark = pytest.mark.anyio


def completion(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "prompt": "abc",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def test_full_queue_gives_503() -> None:
    async with serving(
        multiprocess=False,
        max_num_seqs=1,
        max_queued_requests=1,
        backend_options={"latency": {"step_s": 0.002}},
    ) as (client, engine):
        queued: list[httpx.Response] = []

        async def send_queued() -> None:
            queued.append(await client.post("/v1/completions", json=completion(2)))

        with anyio.fail_after(10):
            async with client.stream("POST", "/v1/completions", json=completion(2000, True)) as r:
                lines = r.aiter_lines()  # kept: dropping it would close the response
                assert (await anext(lines)).startswith("data: ")
                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(send_queued)
                    while (await engine.get_stats()).num_waiting != 1:
                        await anyio.sleep(0.005)
                    rejected = await client.post("/v1/completions", json=completion(2))
                    assert rejected.status_code == 503
                    assert rejected.json()["error"]["code"] == "retry_later"
                    assert "max_queued_requests" in rejected.json()["error"]["message"]
                    await r.aclose()  # the running stream ends; the queued request runs
        assert queued[0].status_code == 200
        assert queued[0].json()["choices"][0]["text"] == "de"
