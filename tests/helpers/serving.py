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
