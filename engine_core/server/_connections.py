"""What a connection may cost the server: how long it may sit idle or take over its request's
headers, and how many the server holds at once.

Both HTTP servers keep their connections through a :class:`ConnectionGuard` (uvicorn in
``_uvicorn``, hypercorn in ``_hypercorn``):

- a connection waiting for a request is closed after ``keep_alive_timeout_s`` between two
  requests, and after no more than ``header_timeout_s`` before its first (a client that
  connects sends at once; one that keeps a connection for later may idle up to its own idle
  expiry, which the keep-alive outlasts: then the client, not the server, ends the connection,
  and never while a request of its own is on the way); one whose request has begun is closed
  unless the request's headers are complete within ``header_timeout_s`` of its first byte (the
  body's deadline is the app's: ``_request_guard``);
- past ``max_connections``, a new connection first takes the place of the connection that has
  waited longest for a request; when every connection is in a request, it is answered
  ``503`` (OpenAI's error shape, ``Retry-After``) and closed. So the process never runs out of
  file descriptors, and clients that only hold connections open cannot lock out the others.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass

from engine_core.server._errors import error_json

__all__ = [
    "ConnectionGuard",
    "ConnectionLimits",
    "REJECT_LINGER_S",
    "TOO_MANY_CONNECTIONS",
    "default_max_connections",
]

logger = logging.getLogger("engine_core.server")

REJECT_LINGER_S = 1.0
"""How long a refused connection is kept open after its ``503`` (reading and dropping what the
client sends), so that closing it does not reset the connection before the client has read the
answer."""

_RESERVED_FDS = 64
"""File descriptors left to the process itself (engine sockets, pipes, files) by the default
connection limit."""


def _raw_response(status: int, reason: str, body: bytes, headers: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{headers}\r\n"
    )
    return head.encode("ascii") + body


TOO_MANY_CONNECTIONS = _raw_response(
    503,
    "Service Unavailable",
    error_json(
        "the server has too many connections open; retry later",
        "service_unavailable",
        code="too_many_connections",
    ),
    "retry-after: 1\r\n",
)
"""The whole answer to a connection over the limit."""


def default_max_connections() -> int:
    """The connection limit that fits this process's file-descriptor limit: what is left after
    a reserve for the process's own files, less an eighth for the connections that are refused
    (each holds a descriptor for up to :data:`REJECT_LINGER_S`)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft > 1 << 20:
        soft = 1 << 20
    return max(16, (soft - _RESERVED_FDS) * 7 // 8)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    keep_alive_timeout_s: float
    header_timeout_s: float
    max_connections: int

    def request_wait_s(self, first: bool) -> float:
        """How long a connection may wait for a request: its ``first``, or the next one."""
        if first:
            return min(self.keep_alive_timeout_s, self.header_timeout_s)
        return self.keep_alive_timeout_s


class ConnectionGuard:
    """The connections of one server: how many there are, which of them wait for a request
    (oldest first, with how to close each), and the refused ones still lingering."""

    __slots__ = ("limits", "count", "idle", "lingering", "max_lingering", "refused")

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.count = 0
        self.idle: dict[object, Callable[[], None]] = {}
        """Connections waiting for a request, in the order they began to wait."""
        self.lingering = 0
        self.max_lingering = max(8, limits.max_connections // 8)
        """Refused connections kept open at once; past it they are closed at once."""
        self.refused = 0

    def admit(self) -> bool:
        """Whether a new connection may be served (counted then: call :meth:`release` when it
        ends). At the limit the connection that has waited longest for a request is closed to
        make room; with none waiting, False (answer :data:`TOO_MANY_CONNECTIONS`)."""
        if self.count >= self.limits.max_connections:
            if not self.idle:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    logger.warning(
                        "%d connections open (max_connections): refusing new ones (%d so far)",
                        self.count,
                        self.refused,
                    )
                return False
            connection = next(iter(self.idle))
            self.idle.pop(connection)()
        self.count += 1
        return True

    def release(self, connection: object) -> None:
        self.count -= 1
        self.idle.pop(connection, None)

    def waiting(self, connection: object, close: Callable[[], None]) -> None:
        """``connection`` waits for a request: :meth:`admit` may ``close`` it."""
        self.idle[connection] = close

    def busy(self, connection: object) -> None:
        """``connection`` has begun a request."""
        self.idle.pop(connection, None)

    def linger(self) -> bool:
        """Whether a refused connection may linger (counted then: call :meth:`unlinger`)."""
        if self.lingering >= self.max_lingering:
            return False
        self.lingering += 1
        return True

    def unlinger(self) -> None:
        self.lingering -= 1
