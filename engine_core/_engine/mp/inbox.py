"""What comes up a client's output pipe, read by whoever needs it and kept for its owner.

There is no reader task. A caller reads until what it waits for has arrived (a step's outputs, a
call's reply, ``Ready``) or the engine is gone; what it reads meanwhile is sorted into
:attr:`EngineInbox.outputs`, the replies of pending calls, and the handshake and death notices.
In an event loop one task reads at a time (it holds a lock) and the others wait for it to sort a
message, then look again for theirs: so a reply read by another task is taken at once, even while
the reader waits on for its own message. Sync and async reads must not be mixed across threads: a
client belongs to one thread.

The end. The engine's last frames (a shutdown's final outputs, a failure's death notice with its
cause) may still wait in the pipe when its process has ended and the client's watch says so: a
front end that is behind (a busy event loop) reads them later. So the watch's own death notice
(posted into the pipe, so it may come up before frames the engine sent) ends nothing by itself:
the reader that takes it first reads whatever else the pipe holds, and only then is the engine
:attr:`EngineInbox.gone`. No time limit applies: the process has ended, so what it sent is all
there.

Silence. The inbox also knows whether its client waits for the engine (requests in flight, a
call's reply) and when it last heard from it. :meth:`EngineInbox.look` (called by the client's
process watch thread) posts a :class:`~engine_core._engine.wire.Silence` notice into the pipe
once the client has waited ``heartbeat_timeout_s`` with nothing heard; the reader that takes it
declares the engine frozen only if no message of the engine's is queued behind it, so a client
that was itself too busy to read never mistakes the backlog for a silence. Nothing on the hot
path waits with a timeout: the watch keeps the clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import anyio
import msgspec
from anyio.lowlevel import RunVar

from engine_core._core.engine_io import EngineCoreOutputs
from engine_core._engine.pipes.pipes import Receiver
from engine_core._engine.wire import (
    EngineDead,
    Heartbeat,
    Hello,
    Ready,
    Silence,
    UtilityReply,
    decode,
    engine_message_decoder,
)

__all__ = ["EngineInbox"]

logger = logging.getLogger(__name__)


class _LoopReaders:
    """The readers of one event loop: the task that reads holds ``lock``; the others wait for
    ``sorted``, set (and renewed) after each message the reader sorts while one waits."""

    __slots__ = ("lock", "num_waiting", "sorted")

    def __init__(self) -> None:
        # fast_acquire: taking the lock when nobody holds it must not yield, or the output
        # handler would hand the event loop over after every message and never batch outputs.
        self.lock = anyio.Lock(fast_acquire=True)
        self.sorted = anyio.Event()
        self.num_waiting = 0
        """Tasks waiting for ``sorted``: with none (the usual case, the output handler alone
        reads), a sorted message renews nothing."""

    async def wait_sorted(self) -> None:
        """Until the reader sorted a message (or gave up)."""
        self.num_waiting += 1
        try:
            await self.sorted.wait()
        finally:
            self.num_waiting -= 1

    def announce(self) -> None:
        """Wake the waiting readers: a message was sorted (or the reader gave up)."""
        if self.num_waiting:
            self.sorted.set()
            self.sorted = anyio.Event()


_SILENCE_FRAME = msgspec.msgpack.encode(Silence())


class EngineInbox:
    """The engine's messages to one client. ``on_hello(hello)`` runs when the process says it
    listens (the startup handshake), ``on_notice`` when the engine's own death notice is read;
    :attr:`exit_code` is set once the client's own death notice has been read (the process has
    ended) and everything the pipe held with it.

    With ``heartbeat_timeout_s``, ``on_silence(seconds)`` runs in the reader that finds the
    engine silent that long while it was waited for (and :attr:`listening`); ``post(frame)``
    puts a frame into the pipe from another thread."""

    def __init__(
        self,
        pipe: Receiver,
        on_notice: Callable[[], None],
        *,
        on_hello: Callable[[Hello], None] | None = None,
        heartbeat_timeout_s: float | None = None,
        on_silence: Callable[[float], None] | None = None,
        post: Callable[[bytes], None] | None = None,
    ) -> None:
        if heartbeat_timeout_s is not None and (on_silence is None or post is None):
            raise ValueError("a heartbeat timeout needs on_silence and post")
        self._pipe = pipe
        self._on_notice = on_notice
        self._on_hello = on_hello
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._on_silence = on_silence
        self._post = post
        self._decoder = engine_message_decoder()
        self.outputs: deque[EngineCoreOutputs] = deque()
        self._replies: dict[int, UtilityReply | None] = {}
        self.ready: Ready | None = None
        self.notice: EngineDead | None = None
        """The engine's own death notice: why it stopped."""
        self.notice_seen = threading.Event()
        self.exit_code: int | None = None
        """The process's exit status, once its end has been read (every frame before it too)."""
        self.silent_s: float | None = None
        """How long the engine had been silent when the client declared it frozen."""
        self._loop_readers: RunVar[_LoopReaders] = RunVar("EngineInbox readers")
        # Silence (see the module docstring).
        self.listening = False
        """Whether a silence counts (the client sets it while it is ready)."""
        self.in_flight: set[str] = set()
        """The requests the client waits for: added, and neither finished nor aborted."""
        self._owed: set[int] = set()
        """The calls whose replies have not come, even where their callers stopped waiting:
        the engine still owes them (a ``/health`` probe that timed out, say)."""
        self._heard_at = time.monotonic()
        self._waiting_since = self._heard_at
        self._silence_posted = False
        self._ending = False
        """The watch's death notice is being read: what follows it ends with the process."""

    @property
    def gone(self) -> bool:
        """Whether nothing more comes: the engine's death notice arrived, its process ended, or
        the client declared it frozen."""
        return self.notice is not None or self.exit_code is not None or self.silent_s is not None

    def has_output(self) -> bool:
        """Whether a step's outputs are queued (what ``get_output`` reads until)."""
        return bool(self.outputs)

    # -- silence --------------------------------------------------------------------------------

    @property
    def waiting(self) -> bool:
        """Whether the client waits for the engine: requests in flight or a call's reply."""
        return bool(self.in_flight or self._owed)

    def _start_waiting(self) -> None:
        if not self.in_flight and not self._owed:
            self._waiting_since = time.monotonic()  # the engine owed nothing until now

    def track(self, request_id: str) -> None:
        """Wait for ``request_id`` until its outputs report it finished (or it is untracked)."""
        self._start_waiting()
        self.in_flight.add(request_id)

    def untrack(self, request_ids: list[str]) -> None:
        """Stop waiting for these requests (aborted: no more output comes for them)."""
        for request_id in request_ids:
            self.in_flight.discard(request_id)

    def _quiet_s(self) -> float:
        """How long the client has waited with nothing heard from the engine."""
        return time.monotonic() - max(self._heard_at, self._waiting_since)

    def look(self) -> float | None:
        """For the process watch thread: post a :class:`Silence` notice when the engine has been
        silent for ``heartbeat_timeout_s`` while waited for; how long to wait before looking
        again (None: never). Reads what the reader writes: a stale value only moves a look."""
        limit = self.heartbeat_timeout_s
        if limit is None or self.gone:
            return None
        if not self.listening or not self.waiting:
            return limit  # a wait that starts now cannot time out before the next look
        left = limit - self._quiet_s()
        if left > 0:
            return left
        if not self._silence_posted:
            self._silence_posted = True
            assert self._post is not None
            self._post(_SILENCE_FRAME)
        return limit

    def _check_silence(self) -> None:
        """A :class:`Silence` notice was read: declare the engine frozen unless something of the
        engine's is queued after all or the wait is not as long as the watch thought."""
        self._silence_posted = False
        limit = self.heartbeat_timeout_s
        if limit is None or self.gone or self._ending or not self.listening or not self.waiting:
            return
        # A backlog of the engine's messages (the client was too busy to read) is no silence:
        # the first of them ends the check.
        while (quiet_s := self._quiet_s()) >= limit and self.waiting:
            frame = self._pipe.recv_nowait()
            if frame is None:
                self.silent_s = quiet_s
                assert self._on_silence is not None
                self._on_silence(quiet_s)
                return
            self._route(frame)
            if self.gone:
                return

    # -- replies --------------------------------------------------------------------------------

    def expect_reply(self, call_id: int) -> None:
        """Keep the reply to ``call_id`` when it arrives (others are dropped)."""
        self._start_waiting()
        self._owed.add(call_id)
        self._replies[call_id] = None

    def has_reply(self, call_id: int) -> bool:
        return self._replies[call_id] is not None

    def take_reply(self, call_id: int) -> UtilityReply | None:
        """The reply to ``call_id`` (None if it has not come); later ones are dropped."""
        return self._replies.pop(call_id)

    # -- reading --------------------------------------------------------------------------------

    def _route(self, frame: bytes) -> None:
        message = decode(self._decoder, frame)
        match message:
            case EngineCoreOutputs():
                self._heard_at = time.monotonic()
                self.outputs.append(message)
                for finished in message.finished:
                    self.in_flight.discard(finished.req_id)
            case Heartbeat():
                self._heard_at = time.monotonic()
            case Silence():  # from the process watch
                self._check_silence()
            case UtilityReply(call_id=call_id):
                self._heard_at = time.monotonic()
                self._owed.discard(call_id)
                if call_id in self._replies:
                    self._replies[call_id] = message
                elif message.error is not None:  # its caller stopped waiting
                    logger.warning("utility call %d failed: %s", call_id, message.error)
            case Hello():
                self._heard_at = time.monotonic()
                if self._on_hello is not None:
                    self._on_hello(message)
            case Ready():
                self._heard_at = time.monotonic()
                self.ready = message
            case EngineDead(exit_code=None):  # the engine's own notice
                if self.notice is None:
                    self.notice = message
                self.notice_seen.set()
                self._on_notice()
            case EngineDead(exit_code=exit_code):
                # From the process watch, once the process ended: what the engine sent before
                # its end is read first, all of it (the engine's own notice among it).
                self._ending = True
                while (pending := self._pipe.recv_nowait()) is not None:
                    self._route(pending)
                self.exit_code = exit_code

    def read_until_sync(self, done: Callable[[], bool], timeout: float | None = None) -> None:
        """Read until ``done()``, the engine is gone, or ``timeout`` seconds passed."""
        if self._async_reader_active():
            raise RuntimeError("a task of an event loop is reading; use the *_async methods")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done() and not self.gone:
            timeout = None
            if deadline is not None:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    return
            if self._pipe.poll(timeout) and (frame := self._pipe.recv_nowait()) is not None:
                self._route(frame)

    def read_pending_sync(self) -> None:
        """Sort every frame the pipe holds now (without waiting)."""
        while not self.gone and (frame := self._pipe.recv_nowait()) is not None:
            self._route(frame)

    async def read_until(self, done: Callable[[], bool]) -> None:
        """Read until ``done()`` or the engine is gone, one task of the event loop at a time."""
        readers = self._readers()
        while not done() and not self.gone:
            if readers.lock.locked():  # another task reads: wait for it to sort a message
                await readers.wait_sorted()
                continue
            try:
                async with readers.lock:
                    self._route(await self._pipe.recv())
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
