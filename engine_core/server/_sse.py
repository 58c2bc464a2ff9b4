"""Server-sent events, and cancelling work at once when the client goes away.

Both helpers watch the ASGI ``receive`` channel for ``http.disconnect`` next to the work, in one
task group: a disconnect cancels the work right there (leaving an ``AsyncLLM.generate`` loop
aborts its request in the engine), not when a garbage collector gets to a suspended generator.
When the server ends the response instead (``receive`` raises :class:`APIError`: shutdown past
its grace, engine death, see ``_request_guard``), the work is cancelled the same way and the
client gets that error: a stream as its last event before ``data: [DONE]``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.lowlevel
from starlette.types import Receive, Scope, Send

from engine_core.server._errors import APIError, error_json

__all__ = ["DONE", "Emit", "EventStreamResponse", "cancel_on_disconnect", "sse_event"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]

Emit = Callable[[bytes], Awaitable[None]]
"""Sends encoded events (one or more) to the client in one write."""


_LINE_BREAKS = (
    ("\u2028".encode(), b"\\u2028"),
    ("\u2029".encode(), b"\\u2029"),
    ("\x85".encode(), b"\\u0085"),
)
"""Characters that JSON leaves as they are but that line readers split lines on (Python's
``str.splitlines``, so httpx's ``aiter_lines``, and JavaScript's line terminators), in UTF-8,
with their JSON escapes."""


def sse_event(data: bytes) -> bytes:
    """One ``data:`` event of the JSON text ``data`` (which must hold no newline; JSON from
    msgspec never does), with U+2028, U+2029 and U+0085 escaped so that no line reader splits
    the event."""
    # In UTF-8 these byte sequences are those characters and nothing else (their lead bytes
    # never continue another character), and in JSON they can only be inside strings, where
    # the escape means the same character.
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


class _Watch:
    """Waits for the client to go away, or for the server to end the response (``receive``
    raises :class:`APIError`, kept as ``error``), and cancels ``scope`` then, unless the
    response is ``complete``: servers report the end of a finished response as a disconnect
    too."""

    __slots__ = ("receive", "scope", "complete", "done", "error")

    def __init__(self, receive: Receive, scope: anyio.CancelScope) -> None:
        self.receive = receive
        self.scope = scope
        self.complete = False
        self.done = False
        self.error: APIError | None = None

    async def run(self) -> None:
        try:
            while (await self.receive())["type"] != "http.disconnect":
                pass
        except APIError as exc:
            self.error = exc
        self.done = True
        if not self.complete:
            self.scope.cancel()


async def cancel_on_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work``; if the client disconnects first, cancel it and raise ``APIError`` 499
    (nobody will read the answer); if the server ends it first, cancel it and raise the
    server's error. Call after the request body has been read."""
    result: list[T] = []
    error: Exception | None = None
    async with anyio.create_task_group() as task_group:
        watch = _Watch(receive, task_group.cancel_scope)
        task_group.start_soon(watch.run)
        try:
            result.append(await work())
        except Exception as exc:  # raised as itself below, not inside an exception group
            error = exc
        task_group.cancel_scope.cancel()
    if error is not None:
        raise error
    if not result:
        raise watch.error or APIError(499, "the client closed the connection")
    return result[0]


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


class EventStreamResponse:
    """An ASGI response whose events ``producer`` emits, ending with ``data: [DONE]``.

    ``producer(emit)`` sends events with ``emit`` as they come and returns the last events,
    which go out together with ``data: [DONE]`` in the response's last write. The status line
    and headers (200) go out with the first event, so an :class:`APIError` the producer raises
    before emitting anything becomes a plain JSON error response with its status; an error after
    that is sent as a last ``data: {"error": ...}`` event. A client disconnect cancels the
    producer at once; so does the server ending the response, whose error is then answered the
    same way.
    """

    def __init__(self, producer: Callable[[Emit], Awaitable[bytes]]) -> None:
        self.producer = producer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def emit(events: bytes) -> None:
            nonlocal started
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            await send({"type": "http.response.body", "body": events, "more_body": True})

        failure: tuple[int, bytes] | None = None
        tail = b""
        async with anyio.create_task_group() as task_group:
            with anyio.CancelScope() as work:
                watch = _Watch(receive, work)
                task_group.start_soon(watch.run)
                try:
                    tail = await self.producer(emit)
                except APIError as exc:
                    failure = exc.status, exc.body()
                except Exception:
                    logger.exception("a streamed response failed")
                    failure = 500, error_json("internal server error", "server_error")
                watch.complete = True
            if work.cancelled_caught:
                if watch.error is None:
                    return  # the client went away: nobody reads the rest
                failure = watch.error.status, watch.error.body()
            if failure is not None and not started:
                await _send_json(send, *failure)
            else:
                if failure is not None:
                    tail = sse_event(failure[1])
                if not started:
                    await send(
                        {"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS}
                    )
                await send({"type": "http.response.body", "body": tail + DONE, "more_body": False})
            # The server reports the finished response as a disconnect: let the watch take it
            # rather than pay for a cancellation (one is still there for servers that do not).
            await anyio.lowlevel.checkpoint()
            if not watch.done:
                task_group.cancel_scope.cancel()
