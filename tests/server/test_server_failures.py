"""The server when the engine fails or is full: each test starts its own server (in this
process's event loop) under asyncio and trio, and talks to it with httpx's async client."""

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


async def test_dead_engine_gives_503_without_hanging() -> None:
    fault = {"kind": "raise", "at_step": 5}
    # Slow steps: the stream has emitted its first tokens well before the engine dies (the
    # death replaces outputs its consumer has not taken yet).
    options = {"fault": fault, "latency": {"step_s": 0.02}}
    async with serving(multiprocess=True, backend_options=options) as (client, _):
        with anyio.fail_after(10):
            # A stream that is running when the engine dies ends with an error event.
            async with client.stream("POST", "/v1/completions", json=completion(50, True)) as r:
                assert r.status_code == 200
                events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert '"error"' in events[-2] and "engine is dead" in events[-2]
            health = await client.get("/health")
            assert health.status_code == 503
            assert health.json()["error"]["type"] == "service_unavailable"
            for body in (completion(5), completion(5, stream=True)):
                response = await client.post("/v1/completions", json=body)
                assert response.status_code == 503
                assert response.json()["error"]["code"] == "engine_dead"
            chat = await client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
            )
            assert chat.status_code == 503
            metrics = await client.get("/metrics")
            assert metrics.status_code == 200
            assert "engine_core_generation_tokens_total" in metrics.text
            assert "engine_core_num_requests_running" not in metrics.text


async def test_dead_engine_during_a_whole_response() -> None:
    fault = {"kind": "exit", "at_step": 3}
    async with serving(multiprocess=True, backend_options={"fault": fault}) as (client, _):
        with anyio.fail_after(10):
            response = await client.post("/v1/completions", json=completion(50))
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "engine_dead"
            assert (await client.get("/health")).status_code == 503


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
