"""The two data pipes between a client and its engine-core process, behind one small interface.

A pipe carries frames (msgspec messages) one way: a :class:`Receiver` binds an address and reads,
a :class:`Sender` connects to it and writes. :class:`Pipes` opens both kinds, choosing the
implementation by the address's scheme:

- ``unix://PATH``: length-prefixed frames on a Unix stream socket (``pipes.unix``), the default
  on one host (Linux): one ``send`` and one ``recv`` per message, no thread hop;
- ``tcp://HOST:PORT`` and ``ipc://PATH``: ZMQ PUSH/PULL sockets (``pipes.addresses``), for engines
  on another host, and on one host where there is no epoll (or ``ENGINE_CORE_IPC_TRANSPORT=zmq``).

Either way the client's output pipe takes frames that other threads of its own process
:meth:`Receiver.post` (death and silence notices), and the engine's output pipe is bounded: a
sender says when it has no room, and the engine stops stepping until the client catches up.
"""

from __future__ import annotations

import uuid
from typing import Protocol

import zmq

from engine_core._engine.pipes.addresses import (
    EngineKeys,
    curve_client,
    make_socket,
    recv_async,
    send_async,
)
from engine_core._engine.pipes.unix import StreamReceiver, StreamSender

__all__ = ["Pipes", "Receiver", "Sender", "ZmqReceiver", "ZmqSender"]

_POST_LINGER_MS = 1000


class Receiver(Protocol):
    """The reading end of a pipe. One reader at a time; :meth:`post` from any thread."""

    @property
    def endpoint(self) -> str:
        """The bound address (with the port the OS picked)."""
        ...

    @property
    def pollable(self) -> zmq.Socket[bytes] | int:
        """What ``zmq.Poller`` waits on for this pipe to become readable."""
        ...

    def recv_nowait(self) -> bytes | None:
        """The next frame, or None when none is there now."""
        ...

    def recv_ready(self) -> bytes | None:
        """The next frame if one is at hand without a system call (a Unix stream's frames
        already read; ZMQ's queue), or None."""
        ...

    async def recv(self) -> bytes:
        """The next frame, waiting in the event loop; cancelling it loses nothing."""
        ...

    def poll(self, timeout_s: float | None) -> bool:
        """Whether something may be read within ``timeout_s`` (None: no limit)."""
        ...

    def post(self, frame: bytes) -> None:
        """Put ``frame`` among the frames to read, from any thread of this process."""
        ...

    def close(self) -> None: ...


class Sender(Protocol):
    """The writing end of a pipe: bounded (the engine's output) or never blocking."""

    @property
    def needs_flush(self) -> bool:
        """Whether part of a frame :meth:`send_nowait` took still waits for room."""
        ...

    def send_nowait(self, frame: bytes) -> bool:
        """Hand ``frame`` over without waiting; False when a bounded pipe has no room."""
        ...

    async def flush(self) -> None:
        """Until what :meth:`send_nowait` took is written."""
        ...

    async def send(self, frame: bytes) -> None:
        """Hand ``frame`` over, waiting in the event loop while there is no room."""
        ...

    def send_blocking(self, frame: bytes, timeout_s: float | None = None) -> bool:
        """Hand ``frame`` over, waiting here up to ``timeout_s``; whether it went."""
        ...

    def close(self) -> None: ...


class ZmqReceiver:
    """A ZMQ PULL socket as a :class:`Receiver` (posts go through an in-process address it also
    binds, when it has a context to make the posting sockets with)."""

    def __init__(
        self, sock: zmq.Socket[bytes], ctx: zmq.Context[zmq.Socket[bytes]] | None = None
    ) -> None:
        self.sock = sock
        self.endpoint = ""
        self._ctx = ctx
        self._wake: str | None = None
        if ctx is not None:
            self._wake = f"inproc://engine-core-wake-{uuid.uuid4().hex}"

    def bind(self, address: str) -> None:
        self.sock.bind(address)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self._wake is not None:
            self.sock.bind(self._wake)

    def connect(self, address: str) -> None:
        """Dial ``address`` instead of binding (an engine that dials its driver)."""
        self.sock.connect(address)
        self.endpoint = address

    @property
    def pollable(self) -> zmq.Socket[bytes]:
        return self.sock

    def recv_nowait(self) -> bytes | None:
        try:
            return self.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None

    recv_ready = recv_nowait

    async def recv(self) -> bytes:
        return await recv_async(self.sock)

    def poll(self, timeout_s: float | None) -> bool:
        timeout_ms = None if timeout_s is None else max(int(timeout_s * 1000), 0)
        return bool(self.sock.poll(timeout_ms, zmq.POLLIN))

    def post(self, frame: bytes) -> None:
        if self._ctx is None or self._wake is None:
            raise RuntimeError("this pipe takes no posts")
        wake = make_socket(self._ctx, zmq.PUSH, linger_ms=_POST_LINGER_MS)
        try:
            wake.connect(self._wake)
            wake.send(frame)
        finally:
            wake.close()

    def close(self) -> None:
        self.sock.close()


class ZmqSender:
    """A ZMQ PUSH socket as a :class:`Sender`: a message is taken whole or not at all."""

    needs_flush = False

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock

    def send_nowait(self, frame: bytes) -> bool:
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def flush(self) -> None:
        return

    async def send(self, frame: bytes) -> None:
        await send_async(self.sock, frame)

    def send_blocking(self, frame: bytes, timeout_s: float | None = None) -> bool:
        # The socket's linger bounds how long closing waits for what it holds.
        self.sock.send(frame)
        return True

    def close(self) -> None:
        self.sock.close()


class Pipes:
    """Opens the pipes of one process and owns what they share (a ZMQ context, when a ZMQ pipe
    is opened). ``hwm``: how many messages a bounded ZMQ pipe holds on each side.

    ``dial_keys``: the pipes of an engine that dials its driver (placed on another machine): its
    ZMQ pipes are CURVE clients of the deployment's server, and its receiver connects rather
    than binds.

    :meth:`close` closes every pipe opened here (ZMQ ones linger as they were told)."""

    def __init__(self, dial_keys: EngineKeys | None = None) -> None:
        self._dial_keys = dial_keys
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._opened: list[Receiver | Sender] = []

    def _context(self) -> zmq.Context[zmq.Socket[bytes]]:
        if self._ctx is None:
            self._ctx = zmq.Context()
        return self._ctx

    def receiver(self, address: str, *, hwm: int = 0, postable: bool = False) -> Receiver:
        """A receiver bound to ``address``; ``postable``: it takes :meth:`Receiver.post`."""
        receiver: Receiver
        if address.startswith("unix://"):
            receiver = StreamReceiver(address)
        else:
            ctx = self._context()
            zmq_receiver = ZmqReceiver(
                make_socket(ctx, zmq.PULL, hwm=hwm), ctx if postable else None
            )
            try:
                if self._dial_keys is None:
                    zmq_receiver.bind(address)
                else:
                    curve_client(zmq_receiver.sock, self._dial_keys)
                    zmq_receiver.connect(address)
            except BaseException:
                zmq_receiver.close()
                raise
            receiver = zmq_receiver
        self._opened.append(receiver)
        return receiver

    def sender(self, address: str, *, hwm: int | None = None, linger_ms: int = 0) -> Sender:
        """A sender connected to ``address``: bounded with ``hwm`` (0 on a ZMQ pipe: its default
        queue), else never blocking. ``linger_ms``: how long closing a ZMQ pipe waits for what
        it holds (a Unix stream's bytes are in the peer's socket once written)."""
        sender: Sender
        if address.startswith("unix://"):
            sender = StreamSender(address, bounded=hwm is not None)
        else:
            sock = make_socket(self._context(), zmq.PUSH, linger_ms=linger_ms, hwm=hwm or 0)
            try:
                if self._dial_keys is not None:
                    curve_client(sock, self._dial_keys)
                sock.connect(address)
            except BaseException:
                sock.close()
                raise
            sender = ZmqSender(sock)
        self._opened.append(sender)
        return sender

    def close(self) -> None:
        """Close every pipe, then the ZMQ context (idempotent)."""
        opened, self._opened = self._opened, []
        for pipe in opened:
            pipe.close()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
