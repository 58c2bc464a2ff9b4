"""What comes up a client's output socket, read by whoever needs it and kept for its owner.

There is no reader task. A caller reads until what it waits for has arrived (a step's outputs, a
call's reply, ``Ready``) or the engine is gone; what it reads meanwhile is sorted into
:attr:`EngineInbox.outputs`, the replies of pending calls, and the handshake and death notices.
In an event loop one task reads at a time (it holds a lock) and the others wait for it to sort a
message, then look again for theirs: so a reply read by another task is taken at once, even while
the reader waits on for its own message. Sync and async reads must not be mixed across threads: a
client belongs to one thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import anyio
import zmq
from anyio.lowlevel import RunVar

from engine_core._core.protocol import EngineCoreOutputs
from engine_core._engine.sockets import recv_async
from engine_core._engine.wire import EngineDead, Ready, UtilityReply, decode, engine_message_decoder

__all__ = ["EngineInbox"]

logger = logging.getLogger(__name__)


class _LoopReaders:
    """The readers of one event loop: the task that reads holds ``lock``; the others wait for
    ``sorted``, set (and renewed) after each message the reader sorts."""

    __slots__ = ("lock", "sorted")

    def __init__(self) -> None:
        self.lock = anyio.Lock()
        self.sorted = anyio.Event()

    def announce(self) -> None:
        """Wake the waiting readers: a message was sorted (or the reader gave up)."""
        self.sorted.set()
        self.sorted = anyio.Event()


class EngineInbox:
    """The engine's messages to one client. ``on_notice`` runs when the engine's own death
    notice is read; :attr:`exit_code` is set by the client once the process has ended."""

    def __init__(self, sock: zmq.Socket[bytes], on_notice: Callable[[], None]) -> None:
        self._sock = sock
        self._on_notice = on_notice
        self._decoder = engine_message_decoder()
        self.outputs: deque[EngineCoreOutputs] = deque()
        self._replies: dict[int, UtilityReply | None] = {}
        self.ready: Ready | None = None
        self.notice: EngineDead | None = None
        """The engine's own death notice: why it stopped."""
        self.notice_seen = threading.Event()
        self.exit_code: int | None = None
        self._loop_readers: RunVar[_LoopReaders] = RunVar("EngineInbox readers")

    @property
    def gone(self) -> bool:
        """Whether nothing more comes: the engine's death notice arrived or its process ended."""
        return self.notice is not None or self.exit_code is not None

    # -- replies --------------------------------------------------------------------------------

    def expect_reply(self, call_id: int) -> None:
        """Keep the reply to ``call_id`` when it arrives (others are dropped)."""
        self._replies[call_id] = None

    def has_reply(self, call_id: int) -> bool:
        return self._replies[call_id] is not None

    def take_reply(self, call_id: int) -> UtilityReply | None:
        """The reply to ``call_id`` (None if it has not come); later ones are dropped."""
        return self._replies.pop(call_id)

    # -- reading --------------------------------------------------------------------------------

    def _sort(self, frame: bytes) -> None:
        message = decode(self._decoder, frame)
        match message:
            case EngineCoreOutputs():
                self.outputs.append(message)
            case UtilityReply(call_id=call_id):
                if call_id in self._replies:
                    self._replies[call_id] = message
                elif message.error is not None:  # its caller stopped waiting
                    logger.warning("utility call %d failed: %s", call_id, message.error)
            case Ready():
                self.ready = message
            case EngineDead(exit_code=None):  # the engine's own notice
                if self.notice is None:
                    self.notice = message
                self.notice_seen.set()
                self._on_notice()
            case EngineDead():
                # From the process watch: what the engine sent before it ended comes first.
                while True:
                    try:
                        frame = self._sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._sort(frame)

    def read_until_sync(self, done: Callable[[], bool], timeout: float | None = None) -> None:
        """Read until ``done()``, the engine is gone, or ``timeout`` seconds passed."""
        if self._async_reader_active():
            raise RuntimeError("a task of an event loop is reading; use the *_async methods")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done() and not self.gone:
            timeout_ms = None
            if deadline is not None:
                timeout_ms = int((deadline - time.monotonic()) * 1000)
                if timeout_ms <= 0:
                    return
            if self._sock.poll(timeout_ms, zmq.POLLIN):
                self._sort(self._sock.recv(zmq.NOBLOCK))

    async def read_until(self, done: Callable[[], bool]) -> None:
        """Read until ``done()`` or the engine is gone, one task of the event loop at a time."""
        readers = self._readers()
        while not done() and not self.gone:
            if readers.lock.locked():  # another task reads: wait for it to sort a message
                await readers.sorted.wait()
                continue
            try:
                async with readers.lock:
                    self._sort(await recv_async(self._sock))
            finally:
                readers.announce()

    async def wait_for_readers(self) -> None:
        """Until no task of the event loop is reading (they end once the engine is gone)."""
        async with self._readers().lock:
            pass

    def _readers(self) -> _LoopReaders:
        # One lock and event per event loop: they belong to the loop they are first used in,
        # and a client may serve one loop after another (as tests do).
        readers = self._loop_readers.get(None)
        if readers is None:
            readers = _LoopReaders()
            self._loop_readers.set(readers)
        return readers

    def _async_reader_active(self) -> bool:
        try:
            readers = self._loop_readers.get(None)
        except RuntimeError:  # no event loop runs in this thread
            return False
        return readers is not None and readers.lock.locked()
