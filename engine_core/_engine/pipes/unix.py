"""Length-prefixed frames on a Unix stream socket: the same-host pipes between a client and its
engine-core process.

Each frame goes as a 4-byte little-endian length and the bytes. A pipe has one direction: a
:class:`StreamReceiver` listens on a path and takes the first connection, a
:class:`StreamSender` connects to it. Both sockets are non-blocking; an event loop waits on a
descriptor (asyncio, uvloop and trio alike: see ``fd_wait`` for the receiver, which keeps its
descriptor registered with an asyncio loop between waits; :func:`anyio.wait_writable` for the
sender), and only after the non-blocking call found nothing to read or no room. One
message costs a ``send`` and a ``recv`` and no thread hop, where ZMQ hands every message to its
I/O thread on each side.

The receiver waits on an epoll descriptor that holds the listening socket (until the peer
connects), the connection, and a pipe that :meth:`StreamReceiver.post` rings: another thread of
the same process can put a frame into the pipe's stream of messages (the client's process watch
posts its death and silence notices so), and a reader waiting on the descriptor wakes for
either. A peer that closes (or dies) mid-frame leaves the partial frame behind, dropped; what it
sent whole before is read first.

Bounds. A sender waits (or reports that it would wait) while the kernel's buffers are full: the
engine's output pipe holds what the socket buffers hold, and the engine then stops stepping (see
``proc``). The client's input pipe never blocks its caller: when the engine is behind, what does
not fit is kept in order and written by a short-lived thread.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import socket
import struct
import threading

import anyio
import anyio.lowlevel

from engine_core._engine.pipes.fd_wait import ReadableWaiter

__all__ = ["MAX_FRAME", "StreamReceiver", "StreamSender", "unix_path"]

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
MAX_FRAME = 2**32 - 1
"""The largest frame the 4-byte length can carry."""
_CHUNK = 65536
"""Bytes read at once (below glibc's threshold for mapping an allocation)."""
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)
_FLUSH_POLL_S = 0.5
"""How often the input pipe's writer thread looks whether the pipe was closed meanwhile."""


def unix_path(address: str) -> str:
    """The path of a ``unix://PATH`` address."""
    if not address.startswith("unix://"):
        raise ValueError(f"not a unix:// address: {address!r}")
    return address.removeprefix("unix://")


class StreamReceiver:
    """The reading end of a pipe: listens on ``address`` (``unix://PATH``) and reads the frames
    of the first connection. One reader at a time; :meth:`post` from any thread."""

    def __init__(self, address: str) -> None:
        self.endpoint = address
        self._listener: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn: socket.socket | None = None
        self._epoll = select.epoll()
        self._readable = ReadableWaiter(self._epoll.fileno())
        self._wake_r, self._wake_w = os.pipe()
        try:
            self._listener.bind(unix_path(address))
            self._listener.listen(8)
            self._listener.setblocking(False)
            for fd in (self._wake_r, self._wake_w):
                os.set_blocking(fd, False)
            self._epoll.register(self._listener.fileno(), select.EPOLLIN)
            self._epoll.register(self._wake_r, select.EPOLLIN)
        except BaseException:
            self.close()
            raise
        self._data = b""
        """Bytes read and not yet taken, from ``_pos`` on."""
        self._pos = 0
        self._big: bytearray | None = None
        """A frame longer than what was read with its header, filled in place up to ``_fill``."""
        self._fill = 0
        self._drained = False
        """The last read took less than it asked for: the socket held no more then."""
        self._posted: collections.deque[bytes] = collections.deque()
        self._lock = threading.Lock()
        self._rung = False
        self._closed = False

    @property
    def pollable(self) -> int:
        """A descriptor that is readable while something may be read (for ``poll``, ``zmq.Poller``
        and the event loops); level-triggered."""
        return self._epoll.fileno()

    @property
    def connected(self) -> bool:
        """Whether the peer is connected (and has not closed)."""
        return self._conn is not None

    def post(self, frame: bytes) -> None:
        """Put ``frame`` among the frames to read, from any thread (after ``close``: dropped)."""
        with self._lock:
            if self._closed:
                return
            self._posted.append(frame)
            if not self._rung:
                self._rung = True
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_w, b"\0")

    def _take_posted(self) -> bytes:
        frame = self._posted.popleft()
        if not self._posted:
            with self._lock:
                if not self._posted and self._rung:
                    self._rung = False
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 64)
        return frame

    def _frame(self) -> bytes | None:
        """The next whole frame among the bytes read, if any."""
        data, pos = self._data, self._pos
        if len(data) - pos < 4:
            return None
        (size,) = _HEADER.unpack_from(data, pos)
        end = pos + 4 + size
        if end <= len(data):
            self._pos = end
            return data[pos + 4 : end]
        # A longer frame: the rest is read straight into its own buffer.
        self._big = bytearray(size)
        self._fill = len(data) - pos - 4
        self._big[: self._fill] = memoryview(data)[pos + 4 :]
        self._data, self._pos = b"", 0
        return None

    def recv_nowait(self) -> bytes | None:
        """The next frame, or None when none has come whole (then nothing is readable now)."""
        while True:
            frame = self.recv_ready()
            if frame is not None:
                return frame
            if not self._read():
                return None
            big = self._big
            if big is not None and self._fill == len(big):
                self._big = None
                return bytes(big)

    def recv_ready(self) -> bytes | None:
        """The next frame if it has been read already (or posted): no system call."""
        if self._big is None:
            frame = self._frame()
            if frame is not None:
                return frame
        if self._posted:
            return self._take_posted()
        return None

    def _read(self) -> bool:
        """Read what the connection holds (accepting it first); whether anything came."""
        conn = self._conn
        if conn is None:
            conn = self._accept()
            if conn is None:
                return False
        try:
            big = self._big
            if big is not None:
                count = conn.recv_into(memoryview(big)[self._fill :])
                self._fill += count
            else:
                chunk = conn.recv(_CHUNK)
                count = len(chunk)
                self._drained = count < _CHUNK
                if count:
                    data, pos = self._data, self._pos
                    self._data = data[pos:] + chunk if pos < len(data) else chunk
                    self._pos = 0
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:  # reset by a peer that died
            count = 0
        if count:
            return True
        self._end_of_stream()
        return False

    def _accept(self) -> socket.socket | None:
        listener = self._listener
        if listener is None:
            return None
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return None
        conn.setblocking(False)
        # One peer per pipe: nobody else may connect once it has.
        self._epoll.unregister(listener.fileno())
        listener.close()
        self._listener = None
        self._epoll.register(conn.fileno(), select.EPOLLIN)
        self._conn = conn
        return conn

    def _end_of_stream(self) -> None:
        conn = self._conn
        assert conn is not None
        left = len(self._data) - self._pos + (4 + self._fill if self._big is not None else 0)
        if left:
            logger.warning("the peer closed its pipe mid-frame: %d bytes dropped", left)
        self._data, self._pos, self._big = b"", 0, None
        self._epoll.unregister(conn.fileno())
        conn.close()
        self._conn = None

    async def recv(self) -> bytes:
        """The next frame, waiting in the event loop; cancelling it loses nothing. Returns
        without yielding when one has been read already; when the last read emptied the socket
        it yields once before asking again, so that the tasks woken by what it read run before
        the system calls that find nothing and re-arm the wait."""
        frame = self.recv_ready()
        if frame is not None:
            return frame
        if self._drained:
            await anyio.lowlevel.checkpoint()
        while True:
            frame = self.recv_nowait()
            if frame is not None:
                return frame
            await self._readable.wait()

    def poll(self, timeout_s: float | None) -> bool:
        """Whether something may be read within ``timeout_s`` (None: no limit), waiting here."""
        if self._posted or (self._big is None and len(self._data) - self._pos >= 4):
            return True
        return bool(self._epoll.poll(-1 if timeout_s is None else max(timeout_s, 0.0)))

    def close(self) -> None:
        """Close the sockets (idempotent); the path stays for the directory's owner to remove."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
        self._readable.close()
        for sock in (self._listener, self._conn):
            if sock is not None:
                sock.close()
        self._listener = self._conn = None
        self._epoll.close()


class StreamSender:
    """The writing end of a pipe, connected to the receiver listening at ``address``.

    ``bounded``: :meth:`send_nowait` refuses a frame while the socket has no room (the caller
    waits with :meth:`send`). Unbounded: it always takes the frame and never blocks; what the
    socket cannot take now is written in order by a thread that lives until it is written.
    Frames to a peer that is gone are dropped, as ZMQ drops them.
    """

    def __init__(self, address: str, *, bounded: bool) -> None:
        self.endpoint = address
        self._bounded = bounded
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(unix_path(address))
        except BaseException:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self._rest: memoryview | None = None
        """The part of a frame the socket has not taken yet (bounded)."""
        self._broken = False
        # Unbounded: the frames the writer thread is to write, in order.
        self._backlog: collections.deque[memoryview] = collections.deque()
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None
        self._closed = False

    @property
    def needs_flush(self) -> bool:
        """Whether part of a frame that :meth:`send_nowait` took waits for room (finish it with
        :meth:`flush`)."""
        return self._rest is not None

    def _write(self, data: memoryview | bytes) -> int:
        """Bytes of ``data`` the socket took (all of it once the peer is gone)."""
        if self._broken:
            return len(data)
        try:
            return self._sock.send(data, _SEND_FLAGS)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:  # the peer is gone: nothing will read this
            self._broken = True
            return len(data)

    def _flush_nowait(self) -> bool:
        rest = self._rest
        while rest is not None:
            count = self._write(rest)
            if count == 0:
                return False
            rest = self._rest = rest[count:] if count < len(rest) else None
        return True

    def send_nowait(self, frame: bytes) -> bool:
        """Hand ``frame`` over without waiting. Bounded: False when the socket has no room (the
        frame is not taken); True when it took it, whole or in part (then :attr:`needs_flush`).
        Unbounded: always True."""
        if len(frame) > MAX_FRAME:
            raise ValueError(f"a frame of {len(frame)} bytes exceeds {MAX_FRAME}")
        data = memoryview(_HEADER.pack(len(frame)) + frame)
        if not self._bounded:
            self._send_unbounded(data)
            return True
        if self._rest is not None and not self._flush_nowait():
            return False
        count = self._write(data)
        if count == 0:
            return False
        if count < len(data):
            self._rest = data[count:]
        return True

    async def flush(self) -> None:
        """Until the frame that :meth:`send_nowait` took in part is written."""
        while not self._flush_nowait():
            await anyio.wait_writable(self._sock)

    async def send(self, frame: bytes) -> None:
        """Write ``frame`` whole, waiting in the event loop while the socket has no room."""
        while not self.send_nowait(frame):
            await anyio.wait_writable(self._sock)
        await self.flush()

    def send_blocking(self, frame: bytes, timeout_s: float | None = None) -> bool:
        """Write ``frame`` whole, waiting here up to ``timeout_s``; whether it all went."""
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLOUT)
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        taken = self.send_nowait(frame)
        while not (taken and self._flush_nowait()):
            if not poller.poll(timeout_ms):
                return False
            taken = taken or self.send_nowait(frame)
        return True

    # -- unbounded ------------------------------------------------------------------------------

    def _send_unbounded(self, data: memoryview) -> None:
        if self._writer is None:  # only this thread starts a writer; it ends with no backlog
            count = self._write(data)
            if count == len(data):
                return
            data = data[count:]
        with self._lock:
            if self._closed:
                return
            self._backlog.append(data)
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_backlog, name="EngineCore-pipe-writer", daemon=True
                )
                self._writer.start()

    def _write_backlog(self) -> None:
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLOUT)
        while True:
            with self._lock:
                if not self._backlog or self._closed:
                    self._backlog.clear()
                    self._writer = None
                    return
                data = self._backlog.popleft()
            while data:
                count = self._write(data)
                data = data[count:]
                if data:
                    poller.poll(int(_FLUSH_POLL_S * 1000))
                    if self._closed:
                        break

    def close(self) -> None:
        """Close the socket (idempotent); a writer thread stops and is waited for."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            writer = self._writer
        if writer is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes its poll
            writer.join()
        self._sock.close()
