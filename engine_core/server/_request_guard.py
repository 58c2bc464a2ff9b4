"""The app's side of the server's limits: a deadline on reading each request's body, and a way
to end every response at once when the server stops (shutdown past its grace, engine death).

:class:`RequestGuard` wraps the app and hands each request a ``receive`` that

- while the body is being read, raises :class:`APIError` 408 once ``body_timeout_s`` has passed
  since the request began (its headers were in), so a client that sends its body slowly or not
  at all holds nothing for long; the endpoints answer it in OpenAI's shape;
- once :meth:`RequestGuard.stop_all` is called, raises the error it was given, at once for every
  request waiting on ``receive`` and for every later call. The responses watch ``receive`` for
  the client's disconnect while they work (``_sse``): they are cancelled there and answer with
  the error, a stream as its last event before ``data: [DONE]``.
"""

from __future__ import annotations

import math

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_core.server._errors import APIError

__all__ = ["RequestGuard"]


class RequestGuard:
    """ASGI middleware: see the module's docstring."""

    def __init__(self, app: ASGIApp, body_timeout_s: float) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s
        self.stopped: APIError | None = None
        self._waiting: set[anyio.CancelScope] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        guarded = _GuardedReceive(self, receive, anyio.current_time() + self.body_timeout_s)
        await self.app(scope, guarded.receive, send)

    def stop_all(self, error: APIError) -> None:
        """End every request with ``error``: those waiting on ``receive`` now, the rest at their
        next call. The first call's error stays."""
        if self.stopped is None:
            self.stopped = error
        for scope in list(self._waiting):
            scope.cancel()


class _GuardedReceive:
    __slots__ = ("guard", "inner", "deadline")

    def __init__(self, guard: RequestGuard, inner: Receive, deadline: float) -> None:
        self.guard = guard
        self.inner = inner
        self.deadline = deadline
        """When the body must be in; infinity once it is."""

    async def receive(self) -> Message:
        guard = self.guard
        if guard.stopped is not None:
            raise guard.stopped
        waiting = guard._waiting
        with anyio.CancelScope(deadline=self.deadline) as scope:
            waiting.add(scope)
            try:
                message = await self.inner()
            finally:
                waiting.discard(scope)
        if scope.cancelled_caught:
            if guard.stopped is not None:
                raise guard.stopped
            raise APIError(
                408,
                f"the request body did not arrive within {self.guard.body_timeout_s:g} s",
                code="request_timeout",
            )
        if message["type"] == "http.request" and not message.get("more_body", False):
            self.deadline = math.inf
        return message
