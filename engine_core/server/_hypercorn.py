"""Hypercorn, under trio or asyncio, its connections kept by a :class:`ConnectionGuard`.

Hypercorn's own ``worker_serve`` accepts every connection and bounds only how long one waits
for a request (``keep_alive_timeout``, its request's header time included). This module runs
hypercorn's per-connection ``TCPServer`` from its own accept loop instead, so that the guard
admits or refuses each connection, and overrides two of its methods:

- ``_idle_timeout`` (the task hypercorn runs while the connection waits for a request, and stops
  once a request's headers are in) closes the connection at the guard's deadlines
  (:meth:`ConnectionLimits.request_wait_s`), or when the guard evicts it, or when the server
  stops;
- ``_read_data`` moves that deadline to ``header_timeout_s`` when a request's first bytes come
  in.

A request that comes in as the idle deadline passes is answered, not dropped. Hypercorn's own
``_idle_timeout`` closes the connection once its deadline has passed even when the request's
bytes are already in (the loop was busy: the deadline and the bytes are seen in the same turn,
and the reading task then moves a deadline that has already fired), and it closes through
several awaits, during which a client that checked the connection sends its request into a
connection being closed. Here the deadline's end first looks whether a request has begun (read,
or waiting in the socket or the stream's buffer): then the connection waits for its headers
instead; else the connection's writing side is shut at once, in the same step as that look, so
a client sees the end of the connection before it can send (what it sends after the end is its
own race, which a keep-alive longer than the client's idle expiry avoids: the default).

The guard's bookkeeping is the same under both runtimes (``_KeptConnection``); only the deadline
(a trio cancel scope, an asyncio timeout) and the reading differ.

Written against hypercorn 0.18's ``TCPServer``. Hypercorn's lifespan protocol is not run (the
app has no startup or shutdown of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import sniffio

from engine_core.server._connections import (
    REJECT_LINGER_S,
    TOO_MANY_CONNECTIONS,
    ConnectionGuard,
)

__all__ = ["serve_hypercorn"]

_MAX_RECV = 1 << 16


async def serve_hypercorn(
    app: Any,
    sock: Any,
    guard: ConnectionGuard,
    stop: anyio.Event,
    *,
    backstop_s: float,
    access_log: Any,
    logger: Any,
) -> None:
    """Serve ``app`` on the listening ``sock`` until ``stop``; then stop accepting, close the
    connections that wait for a request, and wait up to ``backstop_s`` for the others to
    finish before closing them."""
    from hypercorn.config import Config
    from hypercorn.utils import wrap_app

    config = Config()
    config.keep_alive_timeout = guard.limits.keep_alive_timeout_s
    config.graceful_timeout = backstop_s
    config.errorlog = logger
    config.include_server_header = False
    if access_log is not None:
        config.accesslog = access_log
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    if sniffio.current_async_library() == "trio":
        await _serve_trio(wrapped, config, sock, guard, stop, backstop_s)
    else:
        await _serve_asyncio(wrapped, config, sock, guard, stop, backstop_s)


class _KeptConnection:
    """What hypercorn's trio and asyncio connections share: the guard's bookkeeping of the wait
    for a request, under a deadline that the request's first bytes move to the header timeout.
    Comes before hypercorn's ``TCPServer`` in a connection class's bases."""

    context: Any

    if TYPE_CHECKING:

        async def run(self) -> None: ...  # TCPServer's

    def __init__(self, guard: ConnectionGuard, *args: Any) -> None:
        super().__init__(*args)
        self.guard = guard
        self.deadline: Any = None
        """The wait for a request under way (a trio cancel scope, an asyncio timeout), while
        there is one."""
        self.first_byte_pending = False
        self.served = False
        """Whether a request has begun on the connection."""
        self.stop_waiting: Callable[[], None] | None = None
        """Ends the wait for a request (or for its headers) under way at once: the connection
        then closes."""

    async def run_kept(self, live: set[Any]) -> None:
        """Run the connection (admitted by the guard), in ``live`` while it runs; the guard
        releases it after."""
        live.add(self)
        try:
            await self.run()
        finally:
            live.discard(self)
            self.guard.release(self)

    async def _wait_for_request(self, deadline: Any, expire: Callable[[], None]) -> None:
        """Wait under ``deadline`` (which ``expire`` ends at once) until the server stops;
        :meth:`_request_begins` moves it, a request's headers in end it (hypercorn cancels
        ``_idle_timeout``)."""
        self.deadline = deadline
        self.first_byte_pending = True
        self.guard.waiting(self, expire)
        self.stop_waiting = expire
        try:
            await self.context.terminated.wait()
        finally:
            self.stop_waiting = None
            if self.deadline is deadline:  # not yet replaced by the next wait
                self.deadline = None
                self.guard.busy(self)

    def _peer_closed(self) -> None:
        """The client ended the connection: a wait for its request ends now (hypercorn's
        connection ends only once its idle task has)."""
        if self.stop_waiting is not None:
            self.stop_waiting()

    def _request_begins(self) -> None:
        deadline = self.deadline
        if deadline is not None and self.first_byte_pending:
            self.first_byte_pending = False
            self.served = True
            self.guard.busy(self)
            self._move_deadline(deadline, self.guard.limits.header_timeout_s)

    def _move_deadline(self, deadline: Any, seconds: float) -> None:
        """Set ``deadline`` to ``seconds`` from now (nothing when it has already passed)."""
        raise NotImplementedError

    def _request_arrived(self) -> bool:
        """Whether a request has begun on the connection: its first bytes read, or waiting to
        be read."""
        arrived = not self.first_byte_pending or self._bytes_waiting()
        self.served |= arrived
        return arrived

    def _bytes_waiting(self) -> bool:
        """Whether bytes (or the end of the connection) wait to be read."""
        raise NotImplementedError


def _readable(fileno: int) -> bool:
    """Whether the socket ``fileno`` has bytes (or its end) to read, now."""
    if fileno < 0:
        return False
    poller = select.poll()
    poller.register(fileno, select.POLLIN)
    return bool(poller.poll(0))


# -- trio ----------------------------------------------------------------------------------------


async def _serve_trio(
    app: Any, config: Any, sock: Any, guard: ConnectionGuard, stop: anyio.Event, backstop_s: float
) -> None:
    import functools

    import trio
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState

    connection_class = _trio_connection_class()
    context = WorkerContext(None)
    live: set[Any] = set()

    async def handle(stream: trio.SocketStream) -> None:
        if not guard.admit():
            await _refuse_trio(stream, guard)
            return
        connection = connection_class(guard, app, config, context, ConnectionState({}), stream)
        await connection.run_kept(live)

    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as accepting:
            accepting.start_soon(
                functools.partial(
                    trio.serve_listeners, handle, [listener], handler_nursery=connections
                )
            )
            await stop.wait()
            accepting.cancel_scope.cancel()
        await trio.aclose_forcefully(listener)
        # Connections waiting for a request close now (their _idle_timeout sees it), the others
        # once their response is out (hypercorn keeps no connection alive from then on).
        await context.terminated.set()
        with trio.move_on_after(backstop_s):
            while live:
                await trio.sleep(0.05)
        # Past the backstop: hypercorn writes under a shield, so a client that reads nothing
        # would hold its connection forever; closing the stream ends the write.
        for connection in list(live):
            await trio.aclose_forcefully(connection.stream)
        connections.cancel_scope.cancel()


async def _refuse_trio(stream: Any, guard: ConnectionGuard) -> None:
    import trio

    lingering = guard.linger()
    try:
        with trio.move_on_after(REJECT_LINGER_S if lingering else 0.05):
            await stream.send_all(TOO_MANY_CONNECTIONS)
            if lingering:
                await stream.send_eof()
                while await stream.receive_some(_MAX_RECV):
                    pass
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        if lingering:
            guard.unlinger()
        await trio.aclose_forcefully(stream)


def _trio_connection_class() -> type[Any]:
    import trio
    from hypercorn.events import Closed, RawData
    from hypercorn.trio.tcp_server import TCPServer

    class Connection(_KeptConnection, TCPServer):
        """Hypercorn's trio connection, kept by ``guard``."""

        async def _idle_timeout(self) -> None:
            limits = self.guard.limits
            evicted = False
            deadline = trio.current_time() + limits.request_wait_s(first=not self.served)
            with trio.CancelScope(deadline=deadline) as scope:

                def expire() -> None:
                    nonlocal evicted
                    evicted = True
                    scope.cancel()

                await self._wait_for_request(scope, expire)
            if not evicted and self._request_arrived():
                # Came in as the deadline passed: the request's headers have their own.
                with trio.move_on_after(limits.header_timeout_s) as headers:
                    self.stop_waiting = headers.cancel
                    try:
                        await self.context.terminated.wait()
                    finally:
                        self.stop_waiting = None
            # When nothing came, in the same step as the look: the client sees the end before
            # it can send.
            with contextlib.suppress(OSError, AttributeError):
                self.stream.socket.shutdown(socket.SHUT_WR)
            with trio.CancelScope(shield=True):
                await self._initiate_server_close()

        def _move_deadline(self, scope: trio.CancelScope, seconds: float) -> None:
            scope.deadline = trio.current_time() + seconds

        def _bytes_waiting(self) -> bool:
            try:
                return _readable(self.stream.socket.fileno())
            except (OSError, AttributeError):
                return False

        async def _read_data(self) -> None:
            while True:
                try:
                    data = await self.stream.receive_some(_MAX_RECV)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    break
                if data:
                    self._request_begins()
                await self.protocol.handle(RawData(bytes(data)))
                if not data:
                    break
            self._peer_closed()
            await self.protocol.handle(Closed())

    return Connection


# -- asyncio -------------------------------------------------------------------------------------


async def _serve_asyncio(
    app: Any, config: Any, sock: Any, guard: ConnectionGuard, stop: anyio.Event, backstop_s: float
) -> None:
    from hypercorn.asyncio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState

    connection_class = _asyncio_connection_class()
    loop = asyncio.get_running_loop()
    context = WorkerContext(None)
    tasks: set[asyncio.Task[Any]] = set()
    live: set[Any] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if not guard.admit():
            await _refuse_asyncio(reader, writer, guard)
            return
        connection = connection_class(
            guard, app, loop, config, context, ConnectionState({}), reader, writer
        )
        await connection.run_kept(live)

    server = await asyncio.start_server(handle, sock=sock, backlog=config.backlog)
    try:
        await stop.wait()
    finally:
        server.close()
        await context.terminated.set()
        deadline = time.monotonic() + backstop_s
        while tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for connection in list(live):
            connection.writer.transport.abort()
        for task in list(tasks):
            task.cancel()
        if tasks:
            await asyncio.wait(list(tasks), timeout=1.0)


async def _refuse_asyncio(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, guard: ConnectionGuard
) -> None:
    lingering = guard.linger()
    try:
        writer.write(TOO_MANY_CONNECTIONS)
        if lingering:
            if writer.can_write_eof():
                writer.write_eof()
            async with asyncio.timeout(REJECT_LINGER_S):
                while await reader.read(_MAX_RECV):
                    pass
    except (OSError, TimeoutError):
        pass
    finally:
        if lingering:
            guard.unlinger()
        writer.close()


def _asyncio_connection_class() -> type[Any]:
    from hypercorn.asyncio.tcp_server import TCPServer
    from hypercorn.events import Closed, RawData

    class Connection(_KeptConnection, TCPServer):
        """Hypercorn's asyncio connection, kept by ``guard``."""

        async def _idle_timeout(self) -> None:
            loop = asyncio.get_running_loop()
            limits = self.guard.limits
            evicted = False
            try:
                wait_s = limits.request_wait_s(first=not self.served)
                async with asyncio.timeout(wait_s) as timeout:

                    def expire() -> None:
                        nonlocal evicted
                        evicted = True
                        if not timeout.expired():
                            timeout.reschedule(loop.time())

                    await self._wait_for_request(timeout, expire)
            except TimeoutError:
                pass
            if not evicted and self._request_arrived():
                # Came in as the deadline passed: the request's headers have their own.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(limits.header_timeout_s) as headers:
                        self.stop_waiting = lambda: (
                            None if headers.expired() else headers.reschedule(loop.time())
                        )
                        try:
                            await self.context.terminated.wait()
                        finally:
                            self.stop_waiting = None
            # When nothing came, in the same step as the look: the client sees the end before
            # it can send.
            if self.writer.can_write_eof() and not self.writer.is_closing():
                with contextlib.suppress(OSError, RuntimeError):
                    self.writer.write_eof()
            await asyncio.shield(self._initiate_server_close())

        def _move_deadline(self, timeout: asyncio.Timeout, seconds: float) -> None:
            if not timeout.expired():  # once fired, _idle_timeout sees the request begun
                timeout.reschedule(asyncio.get_running_loop().time() + seconds)

        def _bytes_waiting(self) -> bool:
            # Bytes the transport has read are in the reader's buffer until the reading task
            # runs; the rest are in the socket.
            if getattr(self.reader, "_buffer", None):
                return True
            sock = self.writer.get_extra_info("socket")
            return sock is not None and _readable(sock.fileno())

        async def _read_data(self) -> None:
            while not self.reader.at_eof():
                try:
                    data = await self.reader.read(_MAX_RECV)
                except (ConnectionError, OSError, TimeoutError, ssl.SSLError):
                    break
                if data:
                    self._request_begins()
                await self.protocol.handle(RawData(data))
            self._peer_closed()
            await self.protocol.handle(Closed())

    return Connection
