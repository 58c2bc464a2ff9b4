"""The server under KV pressure: a request that can never fit is a 400 naming both figures, a
stalled engine's ``/health`` is a 503 with the reason, ``/metrics`` reports the recomputed
tokens and the seconds since progress. In-process mock engine, under asyncio and trio."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from helpers.tool_servers import in_thread

from engine_core import AsyncLLM
from engine_core._core.scheduler_output import CachedRequestData, SchedulerOutput
from engine_core._engine.core import EngineCore
from engine_core._engine.inproc_client import InprocClient
from engine_core.server import ServerSettings, serve

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

API_KEY = "k"


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, EngineCore]]:
    settings = ServerSettings(port=0, api_key=API_KEY, served_model_names=("m",))
    stop = anyio.Event()
    async with (
        AsyncLLM(
            backend="mock",
            tokenizer="byte",
            multiprocess=False,
            num_kv_blocks=20,
            stall_timeout_s=0.3,
        ) as engine,
        anyio.create_task_group() as task_group,
    ):
        url = await task_group.start(
            functools.partial(serve, engine, settings, shutdown_trigger=stop.wait)
        )
        client = engine._client
        assert isinstance(client, InprocClient)
        try:
            yield url, client.engine_core
        finally:
            stop.set()


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"model": "m", "max_tokens": 2, **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=10,
    )


async def test_a_request_the_shrunk_cache_cannot_hold_is_a_400_naming_both_figures(
    served: tuple[str, EngineCore],
) -> None:
    url, core = served
    core.scheduler.kv.reserve_blocks(15)  # 5 of 20 blocks left
    response = await in_thread(_post, url, {"prompt": "x" * 100})  # 7 blocks
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "needs 7 KV-cache blocks" in message and "at most 5 blocks" in message
    ok = await in_thread(_post, url, {"prompt": "x" * 40})
    assert ok.status_code == 200


async def test_a_stalled_engine_is_unhealthy_with_the_reason_and_recovers(
    served: tuple[str, EngineCore],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, core = served
    health = await in_thread(httpx.get, f"{url}/health")
    assert health.status_code == 200
    # A scheduler that schedules nothing though a request is queued: a stall.
    real = core.scheduler.schedule
    monkeypatch.setattr(
        core.scheduler,
        "schedule",
        lambda: SchedulerOutput([], CachedRequestData([], [], [], []), 0),
    )
    async with anyio.create_task_group() as task_group:
        done: list[httpx.Response] = []

        async def send() -> None:
            done.append(await in_thread(_post, url, {"prompt": "abc"}))

        task_group.start_soon(send)
        await anyio.sleep(0.6)
        health = await in_thread(httpx.get, f"{url}/health")
        assert health.status_code == 503
        message = health.json()["error"]["message"]
        assert "the engine is stalled: no token computed for" in message
        assert "1 requests waiting and 0 running" in message
        metrics = (await in_thread(httpx.get, f"{url}/metrics")).text
        assert "engine_core_seconds_since_progress" in metrics
        assert "engine_core_num_recomputed_tokens_total 0.0" in metrics
        monkeypatch.setattr(core.scheduler, "schedule", real)
    assert done[0].status_code == 200
    assert (await in_thread(httpx.get, f"{url}/health")).status_code == 200
    logged = [r for r in caplog.records if "the engine is stalled" in r.getMessage()]
    assert len(logged) == 1  # the queue state, once
    assert "waiting: " in logged[0].getMessage()
