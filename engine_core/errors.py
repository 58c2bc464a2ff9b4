"""Exceptions raised by engine-core.

::

    Exception
    ├── EngineError                  base of everything the engine raises on its own account
    │   ├── EngineDeadError          the engine core stopped (crash, exit, hang); nothing more runs
    │   ├── EngineClosedError        the engine was closed by its owner and is used afterwards
    │   ├── EngineStalledError       work queued and no token computed for stall_timeout_s
    │   ├── BackendError             a backend could not be found, loaded or started
    │   └── RequestError             one request failed; the engine and other requests are fine
    │       ├── InvalidRequestError  (also a ValueError) bad prompt or parameters for this engine
    │       └── RetryableRequestError  rejected for now (paused, queue full); retry later
    └── ValueError / TypeError       invalid arguments, raised before anything is sent
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "EngineClosedError",
    "EngineDeadError",
    "EngineError",
    "EngineStalledError",
    "InvalidRequestError",
    "RequestError",
    "RetryableRequestError",
]


class EngineError(Exception):
    """Base of the errors the engine raises on its own account."""


class EngineDeadError(EngineError):
    """The engine core is dead: it crashed, exited, hung past its step timeout or was killed.

    Raised by every in-flight and every later call. Not raised when the engine was closed on
    purpose by its owner (that is :class:`EngineClosedError`). ``__cause__`` holds the root cause
    where it is known.
    """


class EngineClosedError(EngineError):
    """The engine was closed by its owner and then used. Not raised when it died on its own."""


class EngineStalledError(EngineError):
    """The engine has requests queued and computed no token for ``stall_timeout_s``: its health
    check fails with this (``/health`` answers 503 with the reason). It is alive and may recover
    (a stall is a bug; the engine logs its queue state once)."""


class BackendError(EngineError, LookupError):
    """A backend could not be found, is not usable on this machine, or failed to start."""


class RequestError(EngineError):
    """One request failed; other requests and the engine are unaffected."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class InvalidRequestError(RequestError, ValueError):
    """The request does not fit this engine: prompt too long, token ids out of vocabulary..."""


class RetryableRequestError(RequestError):
    """The engine rejected the request for now (paused, or its queue is full); retry later."""
