"""Waiting for one descriptor to become readable, again and again, in an event loop.

``anyio.wait_readable`` registers the descriptor with the event loop for each wait and removes
it once woken. Under asyncio (and uvloop) that is an ``add_reader`` and a ``remove_reader`` per
wait: two ``epoll_ctl`` calls and a few objects, on the path from a message's arrival to its
reader. A pipe waited on between every message keeps its registration instead: a callback that
wakes the waiting task when there is one. Nobody waiting when it fires is normal once (the
reader was woken in the previous turn and has not asked again yet); the second time in a row
the descriptor stays readable while nobody reads, and the registration is dropped (renewed by
the next wait), so a pipe that is not being read never keeps the event loop spinning. Under
trio ``anyio.wait_readable`` is used as is (one ``epoll_ctl`` per wait already).
"""

from __future__ import annotations

import asyncio
import contextlib

import anyio
import sniffio

__all__ = ["ReadableWaiter"]


class ReadableWaiter:
    """Waits for ``fd`` to be readable; one waiting task at a time. :meth:`close` (before the
    descriptor is closed) drops the registration."""

    __slots__ = ("_fd", "_idle_calls", "_loop", "_waiter")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._loop: asyncio.AbstractEventLoop | None = None
        """The asyncio loop the descriptor is registered with (None: registered nowhere)."""
        self._waiter: asyncio.Future[None] | None = None
        self._idle_calls = 0
        """Callbacks in a row that found nobody waiting."""

    async def wait(self) -> None:
        """Until the descriptor is readable (it may be spuriously woken: read without blocking
        and wait again on nothing)."""
        if sniffio.current_async_library() != "asyncio":
            await anyio.wait_readable(self._fd)
            return
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self.close()
            loop.add_reader(self._fd, self._ready)
            self._loop = loop
        self._idle_calls = 0
        self._waiter = waiter = loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _ready(self) -> None:
        waiter = self._waiter
        if waiter is None:
            self._idle_calls += 1
            if self._idle_calls >= 2:
                self.close()
        elif not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """Drop the registration (idempotent; a loop already closed has none left)."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                loop.remove_reader(self._fd)
