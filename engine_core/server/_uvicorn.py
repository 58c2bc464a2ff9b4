"""Uvicorn (httptools), its connections kept by a :class:`ConnectionGuard`.

Uvicorn bounds only the wait between two requests of a connection (``timeout_keep_alive``), and
its ``limit_concurrency`` answers over the limit only once a request's headers are in, on a
connection it has already taken. Its HTTP protocol class is a setting, so the guard goes into a
subclass of uvicorn's httptools protocol:

- ``connection_made`` asks the guard to admit the connection, and refuses it otherwise;
- the connection's one timer closes it when it has waited too long for a request (connected:
  ``header_timeout_s`` at most; its last response out: ``keep_alive_timeout_s``), or
  ``header_timeout_s`` after a request's first byte unless the headers are in by then;
- a response that goes out before its request's body was read (an error, a timeout) closes the
  connection: the rest of that body would otherwise trickle in unbounded.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio

from engine_core.server._connections import (
    REJECT_LINGER_S,
    TOO_MANY_CONNECTIONS,
    ConnectionGuard,
)

__all__ = ["protocol_class", "serve_uvicorn"]


async def serve_uvicorn(
    app: Any,
    sock: Any,
    guard: ConnectionGuard,
    stop: anyio.Event,
    *,
    backstop_s: float,
    access_log: bool,
    backlog: int,
) -> None:
    """Serve ``app`` on the listening ``sock`` until ``stop``; then stop accepting, close the
    connections that wait for a request, and wait up to ``backstop_s`` for the others to
    finish before cancelling them."""
    import uvicorn

    protocol = protocol_class(guard)
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,  # leave the process's logging alone
        access_log=access_log,
        backlog=backlog,
        http=protocol,
        timeout_keep_alive=guard.limits.keep_alive_timeout_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=backstop_s,  # type: ignore[arg-type]
        server_header=False,
    )
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    try:
        async with anyio.create_task_group() as task_group:
            # The main loop refreshes the Date header every second; it ends on should_exit.
            task_group.start_soon(server.main_loop)
            await stop.wait()
            server.should_exit = True
        await server.shutdown(sockets=[sock])
    finally:
        for connection in list(server.server_state.connections):
            connection.transport.close()
        for transport in list(protocol.refused):
            transport.close()


def protocol_class(guard: ConnectionGuard) -> Any:
    """Uvicorn's httptools protocol with its connections kept by ``guard``."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    limits = guard.limits

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        refused: set[asyncio.BaseTransport] = set()
        """Refused connections still open (lingering)."""

        _timer: asyncio.TimerHandle | None = None
        _admitted = False
        _lingering = False
        _reading_body = False

        # -- the connection -----------------------------------------------------------------------

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if not guard.admit():
                self._refuse(transport)
                return
            self._admitted = True
            super().connection_made(transport)
            self._wait_for_request(first=True)

        def data_received(self, data: bytes) -> None:
            if self._admitted:
                super().data_received(data)
            # a refused connection's request is dropped

        def eof_received(self) -> None:
            if self._admitted:
                super().eof_received()
            # else refused: returning nothing closes it

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timer()
            if self._admitted:
                guard.release(self)
                super().connection_lost(exc)
            else:
                self.refused.discard(self.transport)
                if self._lingering:
                    guard.unlinger()

        def _refuse(self, transport: asyncio.Transport) -> None:
            self.transport = transport
            transport.write(TOO_MANY_CONNECTIONS)
            if not guard.linger():
                transport.close()
                return
            self._lingering = True
            self.refused.add(transport)
            if transport.can_write_eof():
                transport.write_eof()
            self._timer = self.loop.call_later(REJECT_LINGER_S, self._close)

        # -- its timer ----------------------------------------------------------------------------

        def _cancel_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _close(self) -> None:
            self._cancel_timer()
            if not self.transport.is_closing():
                self.transport.close()

        def _wait_for_request(self, first: bool = False) -> None:
            self._cancel_timer()
            self._timer = self.loop.call_later(limits.request_wait_s(first), self._close)
            guard.waiting(self, self._close)

        # -- parser callbacks ---------------------------------------------------------------------

        def on_message_begin(self) -> None:
            guard.busy(self)
            self._cancel_timer()
            self._timer = self.loop.call_later(limits.header_timeout_s, self._close)
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._cancel_timer()
            self._reading_body = True
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._reading_body = False
            super().on_message_complete()

        def on_response_complete(self) -> None:
            if self._reading_body:
                self._close()
                return
            super().on_response_complete()
            # Uvicorn arms its keep-alive timer when no pipelined request follows: this
            # connection now waits for a request.
            if self.timeout_keep_alive_task is not None:
                self._unset_keepalive_if_required()
                self._wait_for_request()

    return GuardedHttpToolsProtocol
