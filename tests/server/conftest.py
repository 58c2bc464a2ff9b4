"""Fixtures the server suites share. A module that needs other stacks or another scope defines
its own fixture of the same name, which wins over these.

- ``anyio_backend``: module-scoped, asyncio and trio, so that a module-scoped server (one per
  runtime for the whole module) can be built on it;
- ``stack``: (runtime, HTTP server) pairs, module-scoped: one server per stack per module;
- ``servers``: the tool-calling test servers (``helpers.tool_servers``), one set per runtime.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from helpers.tool_servers import ToolServers, tool_servers

STACKS = [("asyncio", "uvicorn"), ("asyncio", "hypercorn"), ("trio", "hypercorn")]


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=STACKS, ids=lambda stack: "-".join(stack))
def stack(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(runtime, HTTP server)."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
async def servers(anyio_backend: str) -> AsyncIterator[ToolServers]:
    async with tool_servers() as servers:
        yield servers
