"""Running the app on an HTTP server, under asyncio or trio (whichever runs the caller), and
stopping it: on a signal, when cancelled, and when the engine dies.

Two servers carry the same ASGI app: uvicorn (with httptools) under asyncio where it is
installed, the faster of the two by about a third of the server's CPU time per streamed request;
hypercorn otherwise and always under trio, which uvicorn does not support.
``ServerSettings.http_server`` picks one explicitly. Either way this module binds the listening
socket itself (so ``port=0`` reports the port it got), keeps the connections within the
settings' limits (``_connections``: idle and header timeouts, ``max_connections``) and the
requests within theirs (``_request_guard``: the body timeout), and stops the server through its
own graceful shutdown, never by cancelling it.

Stopping (:func:`serve`):

- on the shutdown trigger (SIGINT or SIGTERM by default) the server stops accepting
  connections, closes those that wait for a request and lets the responses in flight finish for
  up to ``shutdown_timeout_s``; then it ends the rest with a 503 (a stream: an error event and
  ``data: [DONE]``) and returns. A second signal ends them at once;
- cancelling :func:`serve` does the same at once;
- when the engine dies, the responses in flight end with a 503 ``engine_dead`` at once, the
  server stops, and :func:`serve` raises the :class:`EngineDeadError` (``engine-core serve``
  exits with :data:`ENGINE_DEAD_EXIT_CODE`, so that a supervisor restarts it).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import logging
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import sniffio

from engine_core._frontend.async_llm import AsyncLLM
from engine_core.config import EngineConfig
from engine_core.errors import EngineDeadError
from engine_core.lora import LoRAError
from engine_core.server._app import ServerSettings, create_app, lora_requests
from engine_core.server._connections import (
    ConnectionGuard,
    ConnectionLimits,
    default_max_connections,
)
from engine_core.server._errors import APIError, api_error_from
from engine_core.server._request_guard import RequestGuard

__all__ = ["ENGINE_DEAD_EXIT_CODE", "run_server", "serve", "wait_for_signal"]

logger = logging.getLogger("engine_core.server")

ENGINE_DEAD_EXIT_CODE = 3
"""``engine-core serve``'s exit status when it stopped because the engine died."""

_BACKLOG = 2048
"""Pending connections the listening socket holds (a benchmark opens hundreds at once)."""

_ENGINE_POLL_S = 0.2
"""How often the server looks whether the engine died."""

_BACKSTOP_S = 5.0
"""After ``shutdown_timeout_s`` and the error that ends the responses still in flight, how long
the HTTP server waits for them to be written before it cancels them and closes their
connections (a client that reads nothing would otherwise hold the shutdown forever)."""

_SHUTTING_DOWN = APIError(
    503, "the server is shutting down", type="service_unavailable", code="server_shutting_down"
)

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
        uvicorn = all(importlib.util.find_spec(m) is not None for m in ("uvicorn", "httptools"))
        return "uvicorn" if runtime == "asyncio" and uvicorn else "hypercorn"
    if choice == "uvicorn" and runtime != "asyncio":
        raise ValueError("http_server 'uvicorn' runs under asyncio only; use 'hypercorn'")
    if choice == "uvicorn" and importlib.util.find_spec("httptools") is None:
        raise ValueError("http_server 'uvicorn' needs httptools (pip install httptools)")
    return choice


def connection_limits(settings: ServerSettings) -> ConnectionLimits:
    fitting = default_max_connections()
    if settings.max_connections is not None and settings.max_connections > fitting:
        logger.warning(
            "max_connections %d is more than the open-file limit leaves room for (%d): "
            "the process may run out of file descriptors (raise it with ulimit -n)",
            settings.max_connections,
            fitting,
        )
    return ConnectionLimits(
        keep_alive_timeout_s=settings.keep_alive_timeout_s,
        header_timeout_s=settings.header_timeout_s,
        max_connections=settings.max_connections or fitting,
    )


async def serve(
    engine: AsyncLLM,
    settings: ServerSettings | None = None,
    *,
    shutdown_trigger: ShutdownTrigger | None = None,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``engine`` (started) over HTTP until ``shutdown_trigger`` returns (default: a
    SIGINT or SIGTERM; a second one ends the responses in flight at once), this call is
    cancelled, or the engine dies (then :class:`EngineDeadError` is raised once the server
    stopped). See the module's docstring for what each does to the responses in flight.

    With ``task_group.start(serve, ...)`` the base URL (``http://127.0.0.1:PORT``) is reported
    once the socket listens; ``port=0`` picks a free port.
    """
    settings = settings or ServerSettings()
    await _load_lora_modules(engine, settings)
    http_server = http_server_for(settings, sniffio.current_async_library())
    limits = connection_limits(settings)
    app = RequestGuard(create_app(engine, settings), settings.body_timeout_s)
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
        async with _shutdown_signals(shutdown_trigger) as (first, second):
            dead = await _serve_until_stopped(
                engine, settings, http_server, app, sock, limits, url, first, second, task_status
            )
    finally:
        sock.close()
    if dead is not None:
        raise dead


async def _load_lora_modules(engine: AsyncLLM, settings: ServerSettings) -> None:
    """Load the adapters of ``--lora-modules`` before serving (a bad one stops the start with
    a ``ValueError`` naming it)."""
    if not settings.lora_modules:
        return
    if not engine.config.enable_lora:
        raise ValueError("--lora-modules needs LoRA on in the engine (--enable-lora)")
    for lora in lora_requests(settings).values():
        try:
            await engine.add_lora(lora)
        except LoRAError as e:
            raise ValueError(f"--lora-modules: {e}") from None


@contextlib.asynccontextmanager
async def _shutdown_signals(
    trigger: ShutdownTrigger | None,
) -> AsyncIterator[tuple[ShutdownTrigger, ShutdownTrigger]]:
    """(wait for the shutdown, wait for the order to stop at once): ``trigger`` and never, or
    the first and the second SIGINT or SIGTERM."""
    if trigger is not None:
        yield trigger, anyio.sleep_forever
        return
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

        async def next_signal(message: str) -> None:
            async for signum in signals:
                logger.info(message, signal.Signals(signum).name)
                return

        yield (
            functools.partial(next_signal, "received %s, shutting down"),
            functools.partial(next_signal, "received %s again, ending the responses in flight"),
        )


async def _serve_until_stopped(
    engine: AsyncLLM,
    settings: ServerSettings,
    http_server: str,
    app: RequestGuard,
    sock: socket.socket,
    limits: ConnectionLimits,
    url: str,
    shutdown: ShutdownTrigger,
    stop_now: ShutdownTrigger,
    task_status: anyio.abc.TaskStatus[str],
) -> EngineDeadError | None:
    stop_server = anyio.Event()
    stopped = anyio.Event()
    backstop_s = settings.shutdown_timeout_s + _BACKSTOP_S
    guard = ConnectionGuard(limits)
    dead: EngineDeadError | None = None

    async def run() -> None:
        # Shielded: the servers shut down cleanly through their own trigger only (hypercorn's
        # asyncio worker fails when cancelled), so cancelling serve() ends the responses and
        # waits for the server's shutdown instead.
        with anyio.CancelScope(shield=True):
            try:
                await _run_http_server(
                    http_server, app, sock, settings, guard, stop_server, backstop_s
                )
            finally:
                stopped.set()

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(run)
        # Once, at startup: what the engine resolved its configuration to.
        logger.info("engine: %s", engine.info.describe())
        task_status.started(url)
        # The caller says where it serves (engine-core serve prints it once).
        logger.debug("serving on %s (max %d connections)", url, limits.max_connections)
        try:
            first = await _first(shutdown=shutdown, death=functools.partial(_death, engine))
            if first == "shutdown":
                logger.info(
                    "no longer accepting connections; the responses in flight have %g s to end",
                    settings.shutdown_timeout_s,
                )
                stop_server.set()
                first = await _first(
                    stopped=stopped.wait,
                    timeout=functools.partial(anyio.sleep, settings.shutdown_timeout_s),
                    stop_now=stop_now,
                    death=functools.partial(_death, engine),
                )
                if first == "timeout":
                    logger.warning(
                        "responses still in flight after %g s: ending them",
                        settings.shutdown_timeout_s,
                    )
            if first == "death":
                dead = engine.dead_error
                logger.error("the engine died (%s): stopping the server", dead)
        finally:
            # Whatever is still in flight ends now: with the engine's death, or the shutdown.
            error = None
            if dead is not None:
                error = api_error_from(dead, fields=(), prompt_field="prompt", admitting=False)
            app.stop_all(error or _SHUTTING_DOWN)
            stop_server.set()
    return dead


async def _death(engine: AsyncLLM) -> None:
    """Return once the engine is dead."""
    while engine.dead_error is None:
        await anyio.sleep(_ENGINE_POLL_S)


async def _first(**waits: Callable[[], Awaitable[Any]]) -> str:
    """The name of the first of ``waits`` to return (the others are cancelled)."""
    winner: list[str] = []

    async def wait(name: str, fn: Callable[[], Awaitable[Any]]) -> None:
        await fn()
        if not winner:
            winner.append(name)
        task_group.cancel_scope.cancel()

    async with anyio.create_task_group() as task_group:
        for name, fn in waits.items():
            task_group.start_soon(wait, name, fn)
    return winner[0]


async def _run_http_server(
    http_server: str,
    app: Any,
    sock: socket.socket,
    settings: ServerSettings,
    guard: ConnectionGuard,
    stop: anyio.Event,
    backstop_s: float,
) -> None:
    """Run ``http_server`` (``"uvicorn"`` or ``"hypercorn"``) on the listening ``sock`` until
    ``stop``, and through its graceful shutdown (see the two modules)."""
    if http_server == "hypercorn":
        from engine_core.server._hypercorn import serve_hypercorn

        access_log = logging.getLogger("engine_core.server.access") if settings.access_log else None
        await serve_hypercorn(
            app, sock, guard, stop, backstop_s=backstop_s, access_log=access_log, logger=logger
        )
    else:
        from engine_core.server._uvicorn import serve_uvicorn

        await serve_uvicorn(
            app,
            sock,
            guard,
            stop,
            backstop_s=backstop_s,
            access_log=settings.access_log,
            backlog=_BACKLOG,
        )


async def run_server(
    config: EngineConfig,
    settings: ServerSettings | None = None,
    *,
    shutdown_trigger: ShutdownTrigger | None = None,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Start an engine from ``config`` and :func:`serve` it; the engine stops with the server.
    Raises :class:`EngineDeadError` when the server stopped because the engine died.

    Meant to own its process: once the engine is up, everything allocated so far (modules,
    tokenizer, engine state) is moved out of the garbage collector's sight (``gc.freeze``), so
    the collections that request traffic triggers do not walk it again and again.
    """
    async with AsyncLLM.from_config(config) as engine:
        gc.collect()
        gc.freeze()
        await serve(engine, settings, shutdown_trigger=shutdown_trigger, task_status=task_status)
