"""An OpenAI-compatible HTTP server over :class:`~engine_core.AsyncLLM` (``engine-core serve``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /version``, ``GET /metrics`` (Prometheus). One ASGI app (Starlette) that
runs under asyncio (on uvicorn, else hypercorn) and under trio (on hypercorn). Needs the
``server`` extra (``pip install 'engine-core[server]'``)::

    async with AsyncLLM(backend="mock") as engine:
        await serve(engine, ServerSettings(port=8000))   # until SIGINT or SIGTERM
"""

from __future__ import annotations

from engine_core.server._app import ServerSettings, create_app
from engine_core.server._chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplate,
    load_chat_template,
)
from engine_core.server._run import ENGINE_DEAD_EXIT_CODE, run_server, serve, wait_for_signal

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "ENGINE_DEAD_EXIT_CODE",
    "ChatTemplate",
    "ServerSettings",
    "create_app",
    "load_chat_template",
    "run_server",
    "serve",
    "wait_for_signal",
]
