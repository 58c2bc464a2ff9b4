"""Failover of a data-parallel deployment: what happens to the requests of an engine that died,
and the restart of that engine.

``DPClient`` keeps a :class:`Tracked` record per request in flight (its engine, the tokens it
streamed). When an engine dies, each of its requests is :func:`moved_request` (sent to another
engine: as it was when nothing had streamed, or resumed from the streamed tokens with
``dp_failover="resume"`` when that is exact) or ends with :func:`lost_request_ending` (a retryable
error naming the engine). With ``dp_restart_engines`` :func:`restart_engine` starts the engine
again in a thread, with backoff; while every engine is dead and one restarts, the requests that
move (and new ones) wait for it, and one that waited ``dp_restart_wait_s`` ends with
:func:`restart_wait_ending`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import msgspec

from engine_core._core.engine_io import EngineCoreRequest, FinishedRequest

__all__ = [
    "RESTART_BACKOFF_S",
    "Tracked",
    "lost_request_ending",
    "moved_request",
    "restart_engine",
    "restart_wait_ending",
]

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
"""The waits before each attempt to restart a dead engine (then it is given up)."""


class _Client(Protocol):
    def shutdown(self) -> None: ...


_C = TypeVar("_C", bound=_Client)


class Tracked:
    """A request in flight, as the client needs it to move it to another engine."""

    __slots__ = ("request", "engine", "num_tokens", "tokens", "reason", "waits_until")

    def __init__(self, request: EngineCoreRequest, engine: int) -> None:
        self.request = request
        self.engine = engine
        """Its engine; -1 while it waits for one (every engine dead, one restarting)."""
        self.num_tokens = 0
        self.tokens: list[int] = list(request.resume_output_token_ids)
        self.reason: str | None = None
        """Why it goes where it goes next, while it waits (``"failover"``, or None: new)."""
        self.waits_until = 0.0
        """While it waits: when it stops waiting (``time.monotonic()``)."""


def resumable(request: EngineCoreRequest) -> bool:
    """Whether another engine can continue the request exactly from its tokens: greedy, or
    seeded (both shipped backends draw from a pure function of the seed and the position), with
    no grammar state or prompt logprobs that would not carry over."""
    params = request.sampling_params
    exact = params.is_greedy or params.seed is not None
    return exact and params.structured_outputs is None and params.prompt_logprobs is None


def moved_request(tracked: Tracked, mode: str) -> EngineCoreRequest | None:
    """What to send to another engine for a request whose engine died, under ``dp_failover``
    ``mode``: the request as it was when it had streamed nothing (unless ``"fail"``), the request
    resumed from its streamed tokens (``"resume"``, when :func:`resumable`), or None: it ends.
    A request pinned to its engine (``data_parallel_rank``) always ends."""
    request = tracked.request
    if request.data_parallel_rank is not None:
        return None
    if tracked.num_tokens == 0 and mode != "fail":
        return request
    if mode == "resume" and resumable(request):
        return msgspec.structs.replace(request, resume_output_token_ids=list(tracked.tokens))
    return None


def lost_request_ending(request_id: str, engine: int, cause: object) -> FinishedRequest:
    """The ending of a request that died with its engine: a retryable error naming it."""
    return FinishedRequest(
        request_id,
        "error",
        None,
        f"engine {engine} of the data-parallel deployment died ({cause}); "
        "the request may be sent again",
        retryable=True,
    )


def restart_wait_ending(request_id: str, wait_s: float) -> FinishedRequest:
    """The ending of a request that waited ``wait_s`` (``dp_restart_wait_s``) for an engine to
    come back while every engine was dead: a retryable error naming the setting."""
    return FinishedRequest(
        request_id,
        "error",
        None,
        "every engine of the data-parallel deployment is dead and none came back within "
        f"dp_restart_wait_s ({wait_s:g} s); the request may be sent again",
        retryable=True,
    )


def restart_engine(
    engine: int,
    start: Callable[[], _C],
    closing: Callable[[], bool],
    sleep: Callable[[float], object] = time.sleep,
) -> _C | None:
    """Start engine ``engine`` again (``start()``, blocking), waiting :data:`RESTART_BACKOFF_S`
    before each attempt (``sleep``, which a closing deployment may cut short); None when the
    deployment closes meanwhile or every attempt failed. Runs in a thread of its own."""
    for delay in RESTART_BACKOFF_S:
        sleep(delay)
        if closing():
            return None
        try:
            client = start()
        except Exception as exc:
            if closing():
                return None
            logger.error("restarting engine %d failed: %s", engine, exc)
            continue
        if closing():
            client.shutdown()
            return None
        return client
    logger.error("engine %d could not be restarted; giving up", engine)
    return None
