"""The wire protocol between a client and the engine-core process.

One tagged union of msgspec structs per direction, msgpack-encoded, one message per ZMQ frame:

- down (client -> engine, the input socket): :class:`~engine_core._core.protocol.EngineCoreRequest`
  (``"add"``), :class:`AbortRequests`, :class:`UtilityCall`, :class:`Shutdown`;
- up (engine -> client, the output socket): :class:`Ready` (the startup handshake, first),
  :class:`~engine_core._core.protocol.EngineCoreOutputs` (``"out"``, one per step, in columns),
  :class:`UtilityReply` and :class:`EngineDead` (last).

Messages are ``array_like``: encoded as arrays, tag first, fields by position (no field names
on the wire; new fields go at the end), so a step's outputs for a whole batch are one compact
message. Decoders are typed, so a frame can only ever become one of these structs: a malformed,
truncated or unknown message is logged and dropped by :func:`decode`. Nothing is pickled.
"""

from __future__ import annotations

import logging
from typing import Any, TypeAlias, TypeVar

import msgspec

from engine_core._core.protocol import EngineCoreOutputs, EngineCoreRequest, EngineInfo

__all__ = [
    "AbortRequests",
    "ClientMessage",
    "EngineDead",
    "EngineMessage",
    "Ready",
    "Shutdown",
    "UtilityCall",
    "UtilityReply",
    "client_message_decoder",
    "decode",
    "engine_message_decoder",
]

logger = logging.getLogger(__name__)

_MAX_LOGGED_BYTES = 64


# -- down: client -> engine ---------------------------------------------------------------------


class AbortRequests(msgspec.Struct, array_like=True, tag="abort"):
    """End these requests now; unknown or finished ids are ignored. The engine reports nothing
    for them (the client already knows)."""

    request_ids: list[str]


class UtilityCall(msgspec.Struct, array_like=True, omit_defaults=True, tag="call"):
    """Run the control method ``method`` (one of ``UTILITY_METHODS``) between two steps."""

    call_id: int
    method: str
    args: list[Any] = []
    """Positional arguments; plain msgpack values only."""


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    """End every in-flight request with finish_reason "abort", report them, then exit."""


ClientMessage: TypeAlias = EngineCoreRequest | AbortRequests | UtilityCall | Shutdown


# -- up: engine -> client -----------------------------------------------------------------------


class Ready(msgspec.Struct, array_like=True, tag="ready"):
    """The engine core started: its backend is loaded and its KV cache allocated."""

    info: EngineInfo
    input_address: str
    """Where the engine's input socket listens (its bound endpoint)."""


class UtilityReply(msgspec.Struct, array_like=True, omit_defaults=True, tag="reply"):
    """The result of a :class:`UtilityCall`, or the error it raised."""

    call_id: int
    result: Any = None
    error: str | None = None
    error_type: str | None = None
    """Name of the exception class that ``error`` came from."""


class EngineDead(msgspec.Struct, array_like=True, omit_defaults=True, tag="dead"):
    """The engine core stopped; nothing follows. Sent by the engine (with the reason: a fatal
    error, a failed startup, a shutdown or SIGTERM) and by the client's own process watch (with
    the exit code), which is how a waiting reader learns of a process that died silently."""

    reason: str | None = None
    error_type: str | None = None
    traceback: str | None = None
    exit_code: int | None = None


EngineMessage: TypeAlias = Ready | EngineCoreOutputs | UtilityReply | EngineDead


def client_message_decoder() -> msgspec.msgpack.Decoder[ClientMessage]:
    """The typed decoder of the engine's input socket (create one per socket)."""
    return msgspec.msgpack.Decoder(ClientMessage)


def engine_message_decoder() -> msgspec.msgpack.Decoder[EngineMessage]:
    """The typed decoder of the client's output socket (create one per socket)."""
    return msgspec.msgpack.Decoder(EngineMessage)


_T = TypeVar("_T")


def decode(decoder: msgspec.msgpack.Decoder[_T], frame: bytes | memoryview) -> _T | None:
    """``frame`` decoded, or None (and a warning logged) when it is not a valid message."""
    try:
        return decoder.decode(frame)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        head = bytes(frame[:_MAX_LOGGED_BYTES])
        logger.warning("dropped an invalid message of %d bytes (%r...): %s", len(frame), head, exc)
        return None
