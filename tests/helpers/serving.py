"""A server over a mock engine for the server tests that each start their own."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx

from engine_core import AsyncLLM
from engine_core.server import ServerSettings, serve

ONE_RUNNING_ONE_QUEUED: dict[str, Any] = {
    "multiprocess": False,
    "max_num_seqs": 1,
    "max_queued_requests": 1,
    "backend_options": {"latency": {"step_s": 0.002}},
}
"""An engine config (for :func:`serving`) that one running and one queued request fill."""


@contextlib.asynccontextmanager
async def serving(
    *, settings: dict[str, Any] | None = None, **engine_config: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, AsyncLLM]]:
    """A server on a free loopback port over a mock engine (byte tokenizer, ``engine_config``),
    and an httpx client for it; the server stops when the block ends. ``settings``: more
    :class:`ServerSettings` fields."""
    stop = anyio.Event()
    server_settings = ServerSettings(port=0, **(settings or {}))
    async with (
        AsyncLLM(backend="mock", tokenizer="byte", **engine_config) as engine,
        anyio.create_task_group() as task_group,
    ):
        url = await task_group.start(
            functools.partial(serve, engine, server_settings, shutdown_trigger=stop.wait)
        )
        try:
            async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
                yield client, engine
        finally:
            stop.set()


@contextlib.asynccontextmanager
async def engine_full(
    client: httpx.AsyncClient,
    engine: AsyncLLM,
    *,
    running: dict[str, Any],
    queued: dict[str, Any],
) -> AsyncIterator[list[httpx.Response]]:
    """Fill an engine of :data:`ONE_RUNNING_ONE_QUEUED`: the block runs once ``running`` (a
    streamed completion) has sent its first event and ``queued`` (a completion, sent in a task)
    waits in the engine's queue. After the block the stream is closed, so the queued request
    runs; the list holds its response once the block is done."""
    responses: list[httpx.Response] = []

    async def send_queued() -> None:
        responses.append(await client.post("/v1/completions", json=queued))

    async with client.stream("POST", "/v1/completions", json=running) as stream:
        lines = stream.aiter_lines()  # kept: dropping it would close the response
        assert (await anext(lines)).startswith("data: ")
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(send_queued)
            while (await engine.get_stats()).num_waiting != 1:
                await anyio.sleep(0.005)
            yield responses
            await stream.aclose()  # the running stream ends; the queued request runs
