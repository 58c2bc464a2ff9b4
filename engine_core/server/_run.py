"""Running the app on an HTTP server, under asyncio or trio (whichever runs the caller).

Two servers carry the same ASGI app: uvicorn (with httptools) under asyncio where it is
installed, the faster of the two by about a third of the server's CPU time per streamed request;
hypercorn otherwise and always under trio, which uvicorn does not support.
``ServerSettings.http_server`` picks one explicitly. Either way this module binds the listening
socket itself (so ``port=0`` reports the port it got) and stops the server through its own
graceful shutdown, never by cancelling it.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import sniffio

from engine_core._frontend.async_llm import AsyncLLM
from engine_core.config import EngineConfig
from engine_core.server._app import ServerSettings, create_app

__all__ = ["run_server", "serve", "wait_for_signal"]

logger = logging.getLogger("engine_core.server")

_BACKLOG = 2048
"""Pending connections the listening socket holds (a benchmark opens hundreds at once)."""

ShutdownTrigger = Callable[[], Awaitable[None]]


async def wait_for_signal() -> None:
    """Return at the first SIGINT or SIGTERM."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logger.info("received %s, shutting down", signal.Signals(signum).name)
            return


def http_server_for(settings: ServerSettings, runtime: str) -> str:
    """``"uvicorn"`` or ``"hypercorn"``: what serves under ``runtime`` with ``settings``."""
    choice = settings.http_server
    if choice == "auto":
        uvicorn = importlib.util.find_spec("uvicorn") is not None
        return "uvicorn" if runtime == "asyncio" and uvicorn else "hypercorn"
    if choice == "uvicorn" and runtime != "asyncio":
        raise ValueError("http_server 'uvicorn' runs under asyncio only; use 'hypercorn'")
    return choice


async def serve(
    engine: AsyncLLM,
    settings: ServerSettings | None = None,
    *,
    shutdown_trigger: ShutdownTrigger | None = None,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``engine`` (started) over HTTP until ``shutdown_trigger`` returns (default: a
    SIGINT or SIGTERM) or this call is cancelled, then let in-flight responses finish for up to
    ``graceful_timeout_s``.

    With ``task_group.start(serve, ...)`` the base URL (``http://127.0.0.1:PORT``) is reported
    once the socket listens; ``port=0`` picks a free port.
    """
    settings = settings or ServerSettings()
    runner = _serve_uvicorn
    if http_server_for(settings, sniffio.current_async_library()) == "hypercorn":
        runner = _serve_hypercorn
    app = create_app(engine, settings)
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.create_server((settings.host, settings.port), family=family, backlog=_BACKLOG)
    # Accepted connections inherit it. asyncio sets it itself only on sockets made with
    # proto=IPPROTO_TCP, which this one is not: without it, a response written in two parts
    # waited ~40 ms for the client's delayed ACK on every keep-alive request after the first.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.setblocking(False)
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        stop = anyio.Event()
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(_shielded, runner, app, sock, settings, stop)
            task_status.started(url)
            logger.info("serving on %s", url)
            try:
                await (shutdown_trigger or wait_for_signal)()
            finally:
                stop.set()
    finally:
        sock.close()


async def _shielded(
    runner: Callable[[Any, socket.socket, ServerSettings, anyio.Event], Awaitable[None]],
    app: Any,
    sock: socket.socket,
    settings: ServerSettings,
    stop: anyio.Event,
) -> None:
    """Run the server until ``stop``. Shielded: the servers shut down cleanly through their own
    trigger only (hypercorn's asyncio worker fails when cancelled), so cancelling :func:`serve`
    sets ``stop`` and waits for the graceful shutdown instead."""
    with anyio.CancelScope(shield=True):
        await runner(app, sock, settings, stop)


async def _serve_hypercorn(
    app: Any, sock: socket.socket, settings: ServerSettings, stop: anyio.Event
) -> None:
    from hypercorn.config import Config, Sockets
    from hypercorn.utils import wrap_app

    config = Config()
    config.backlog = _BACKLOG
    config.graceful_timeout = settings.graceful_timeout_s
    config.errorlog = logger
    config.include_server_header = False
    if settings.access_log:
        config.accesslog = logging.getLogger("engine_core.server.access")
    if sniffio.current_async_library() == "trio":
        from hypercorn.trio.run import worker_serve
    else:
        from hypercorn.asyncio.run import worker_serve  # type: ignore[assignment]
    await worker_serve(
        wrap_app(app, config.wsgi_max_body_size, "asgi"),
        config,
        sockets=Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[]),
        shutdown_trigger=stop.wait,
    )


async def _serve_uvicorn(
    app: Any, sock: socket.socket, settings: ServerSettings, stop: anyio.Event
) -> None:
    import uvicorn

    config = uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,  # leave the process's logging alone
        access_log=settings.access_log,
        backlog=_BACKLOG,
        timeout_graceful_shutdown=max(1, round(settings.graceful_timeout_s)),
        server_header=False,
    )
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    async with anyio.create_task_group() as task_group:
        # The main loop refreshes the Date header every second; it ends on should_exit.
        task_group.start_soon(server.main_loop)
        await stop.wait()
        server.should_exit = True
    await server.shutdown(sockets=[sock])


async def run_server(
    config: EngineConfig,
    settings: ServerSettings | None = None,
    *,
    shutdown_trigger: ShutdownTrigger | None = None,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Start an engine from ``config`` and :func:`serve` it; the engine stops with the server.

    Meant to own its process: once the engine is up, everything allocated so far (modules,
    tokenizer, engine state) is moved out of the garbage collector's sight (``gc.freeze``), so
    the collections that request traffic triggers do not walk it again and again.
    """
    async with AsyncLLM.from_config(config) as engine:
        gc.collect()
        gc.freeze()
        await serve(engine, settings, shutdown_trigger=shutdown_trigger, task_status=task_status)
