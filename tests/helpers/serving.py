"""A server over a mock engine for the server tests that each start their own."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import anyio
import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core import AsyncLLM
from engine_core.server import ServerSettings, serve

T = TypeVar("T")

ONE_RUNNING_ONE_QUEUED: dict[str, Any] = {
    "multiprocess": False,
    "max_num_seqs": 1,
    "max_queued_requests": 1,
    "backend_options": {"latency": {"step_s": 0.002}},
}
"""An engine config (for :func:`serving`) that one running and one queued request fill."""


@contextlib.asynccontextmanager
async def served(
    settings: Sequence[ServerSettings], **engine_config: Any
) -> AsyncIterator[tuple[list[str], AsyncLLM]]:
    """A server for each of ``settings`` (on its port: 0 for a free one) over one mock engine
    (byte tokenizer, ``engine_config``): their URLs and the engine. The servers stop when the
    block ends."""
    stop = anyio.Event()
    async with (
        AsyncLLM(backend="mock", tokenizer="byte", **engine_config) as engine,
        anyio.create_task_group() as task_group,
    ):
        urls = [
            await task_group.start(
                functools.partial(serve, engine, server_settings, shutdown_trigger=stop.wait)
            )
            for server_settings in settings
        ]
        try:
            yield urls, engine
        finally:
            stop.set()


@contextlib.asynccontextmanager
async def serving(
    *, settings: dict[str, Any] | None = None, **engine_config: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, AsyncLLM]]:
    """A server on a free loopback port over a mock engine (byte tokenizer, ``engine_config``),
    and an httpx client for it; the server stops when the block ends. ``settings``: more
    :class:`ServerSettings` fields."""
    server_settings = ServerSettings(port=0, **(settings or {}))
    async with (
        served([server_settings], **engine_config) as ([url], engine),
        httpx.AsyncClient(base_url=url, timeout=10.0) as client,
    ):
        yield client, engine


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


def fuzz_server(
    url: str,
    examples: st.SearchStrategy[T],
    send: Callable[[httpx.Client, T], None],
    max_examples: int,
    *,
    timeout_s: float = 10.0,
) -> int:
    """``send(client, example)`` for up to ``max_examples`` examples drawn from ``examples``,
    with one blocking httpx client of the server at ``url`` (run it in a worker thread); no
    deadline, no example database, no health checks. Returns how many were sent."""
    count = 0
    with httpx.Client(base_url=url, timeout=timeout_s) as client:

        @settings(
            max_examples=max_examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(example=examples)
        def run(example: T) -> None:
            nonlocal count
            count += 1
            send(client, example)

        run()
    return count
