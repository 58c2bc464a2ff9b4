"""The server when the engine is full: each test starts its own server (in this process's event
loop) under asyncio and trio, and talks to it with httpx's async client. The engine's death is
in test_server_hygiene.py."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from helpers.serving import ONE_RUNNING_ONE_QUEUED, engine_full, serving

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
    async with serving(**ONE_RUNNING_ONE_QUEUED) as (client, engine):
        with anyio.fail_after(10):
            async with engine_full(
                client, engine, running=completion(2000, True), queued=completion(2)
            ) as queued:
                rejected = await client.post("/v1/completions", json=completion(2))
                assert rejected.status_code == 503
                assert rejected.json()["error"]["code"] == "retry_later"
                assert "max_queued_requests" in rejected.json()["error"]["message"]
        assert queued[0].status_code == 200
        assert queued[0].json()["choices"][0]["text"] == "de"
