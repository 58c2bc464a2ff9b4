"""ZMQ sockets awaited portably under asyncio and trio.

pyzmq's async sockets are asyncio-only, so an event loop waits instead on the socket's
notification descriptor (``zmq.FD``) with :func:`anyio.wait_readable`. That descriptor is
edge-triggered and only ever readable: it signals that the socket's events *may* have changed.
The rule that makes it safe: try the non-blocking operation first and wait only after it failed
with ``EAGAIN``; a failed attempt re-arms the descriptor. ``bench/zmq_transport.py`` compares
this with blocking sockets in a worker thread (slower by one thread hop per message).

One task at a time may wait on a given socket.
"""

from __future__ import annotations

import anyio
import zmq

__all__ = ["make_socket", "recv_async", "send_async"]


def make_socket(
    ctx: zmq.Context[zmq.Socket[bytes]], socket_type: int, *, linger_ms: int = 0
) -> zmq.Socket[bytes]:
    """A socket with unbounded queues (sends never block on a connected pipe) and the given
    linger: how long closing waits for unsent messages."""
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, linger_ms)
    return sock


async def recv_async(sock: zmq.Socket[bytes]) -> bytes:
    """The next frame of ``sock``. Returns without yielding when one is already queued;
    cancelling it loses nothing."""
    while True:
        try:
            return sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            await anyio.wait_readable(sock.FD)


async def send_async(sock: zmq.Socket[bytes], frame: bytes) -> None:
    """Send ``frame``, waiting while the socket cannot take it (only before a bound peer
    connects: the queues are unbounded)."""
    while True:
        try:
            sock.send(frame, zmq.NOBLOCK)
            return
        except zmq.Again:
            await anyio.wait_readable(sock.FD)
