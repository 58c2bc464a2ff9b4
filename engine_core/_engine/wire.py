"""The wire protocol between a client and the engine-core process.

One tagged union of msgspec structs per direction, msgpack-encoded, one message per frame (a
length-prefixed frame on a Unix stream pipe, a ZMQ message over ZMQ; see ``pipes``):

- down (client -> engine, the input socket): :class:`Startup` (the configuration, first and
  once), then :class:`~engine_core._core.engine_io.EngineCoreRequest` (``"add"``),
  :class:`AbortRequests`, :class:`UtilityCall`, :class:`Shutdown`;
- up (engine -> client, the output socket): :class:`Hello` (the process runs and listens, first),
  :class:`Ready` (the engine core is built),
  :class:`~engine_core._core.engine_io.EngineCoreOutputs` (``"out"``, one per step, in columns),
  :class:`UtilityReply`, :class:`Heartbeat` (a sign of life while nothing else goes up) and
  :class:`EngineDead` (last); the client's own process watch posts :class:`EngineDead` and
  :class:`Silence` into the same socket.

Messages are ``array_like``: encoded as arrays, tag first, fields by position (no field names
on the wire; new fields go at the end), so a step's outputs for a whole batch are one compact
message. Decoders are typed, so a frame can only ever become one of these structs: a malformed,
truncated or unknown message is logged and dropped by :func:`decode`. The engine decodes with
:func:`decode_client_message`, which also reads the request id at the head of an ``"add"`` frame
it cannot decode, so that request is answered with an error instead of being waited on forever.
Nothing is pickled.
"""

from __future__ import annotations

import logging
import re
from typing import Any, NamedTuple, TypeAlias, TypeVar

import msgspec

from engine_core._core.checks import show
from engine_core._core.engine_io import (
    DPEngineCoreOutputs,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
)
from engine_core.config import EngineConfig

__all__ = [
    "AbortRequests",
    "ClientMessage",
    "EngineDead",
    "EngineMessage",
    "Heartbeat",
    "Hello",
    "Ready",
    "Shutdown",
    "Silence",
    "Startup",
    "UtilityCall",
    "UtilityReply",
    "RejectedRequest",
    "client_message_decoder",
    "decode",
    "decode_client_message",
    "read_add_request_id",
    "engine_message_decoder",
    "startup_decoder",
]

logger = logging.getLogger(__name__)

_MAX_LOGGED_BYTES = 64
_MAX_ERROR_CHARS = 500


# -- down: client -> engine ---------------------------------------------------------------------


class Startup(msgspec.Struct, array_like=True, tag="start"):
    """The client's answer to :class:`Hello`, sent once before anything else: the configuration
    the engine core is built from. Decoded on its own (:func:`startup_decoder`), before the
    engine serves; never part of :data:`ClientMessage`."""

    config: EngineConfig


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


class Hello(msgspec.Struct, array_like=True, tag="hello"):
    """The engine-core process runs: its input socket listens at ``input_address`` and it waits
    for the :class:`Startup` that configures it."""

    input_address: str
    """Where the engine's input socket listens (its bound endpoint)."""


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


class Heartbeat(msgspec.Struct, array_like=True, tag="beat"):
    """The engine is alive: sent while it has work (requests, a call) and nothing else went up
    for a while, so that a client waiting for it can tell a long step from a frozen process."""


class Silence(msgspec.Struct, array_like=True, tag="silence"):
    """Posted by the client's own process watch, never sent by the engine: nothing came from
    the engine for ``engine_heartbeat_timeout_s`` while the client waited for it. The reader
    declares the engine frozen unless a message of the engine's is queued after all."""


EngineMessage: TypeAlias = (
    Hello
    | Ready
    | EngineCoreOutputs
    | DPEngineCoreOutputs
    | UtilityReply
    | Heartbeat
    | EngineDead
    | Silence
)


def client_message_decoder() -> msgspec.msgpack.Decoder[ClientMessage]:
    """The typed decoder of the engine's input socket (create one per socket)."""
    return msgspec.msgpack.Decoder(ClientMessage)


def startup_decoder() -> msgspec.msgpack.Decoder[Startup]:
    """The typed decoder of the first message on the engine's input socket."""
    return msgspec.msgpack.Decoder(Startup)


def engine_message_decoder() -> msgspec.msgpack.Decoder[EngineMessage]:
    """The typed decoder of the client's output socket (create one per socket)."""
    return msgspec.msgpack.Decoder(EngineMessage)


_T = TypeVar("_T")


def decode(decoder: msgspec.msgpack.Decoder[_T], frame: bytes | memoryview) -> _T | None:
    """``frame`` decoded, or None (and a warning logged) when it is not a valid message."""
    try:
        return decoder.decode(frame)
    except Exception as exc:  # a DecodeError, or RecursionError for deeply nested input
        _log_invalid(frame, exc)
        return None


class RejectedRequest(NamedTuple):
    """An ``"add"`` frame that could not be decoded but whose request id could be read: the
    engine ends that request with finish_reason "error" and ``error``. Never sent."""

    request_id: str
    error: str


def decode_client_message(
    decoder: msgspec.msgpack.Decoder[ClientMessage], frame: bytes | memoryview
) -> ClientMessage | RejectedRequest | None:
    """``frame`` decoded by the engine's ``decoder``. A frame that is not a valid message is
    logged, and becomes a :class:`RejectedRequest` when it starts like an ``"add"`` message
    with a readable request id, else None (dropped)."""
    try:
        return decoder.decode(frame)
    except Exception as exc:  # a DecodeError, or RecursionError for deeply nested input
        request_id = read_add_request_id(frame)
        if request_id is None:
            _log_invalid(frame, exc)
            return None
        _log_invalid(frame, exc, f"rejected request {show(request_id)}:")
        return RejectedRequest(request_id, f"the engine could not decode the request: {_why(exc)}")


def _log_invalid(frame: bytes | memoryview, exc: Exception, what: str = "dropped") -> None:
    head = bytes(frame[:_MAX_LOGGED_BYTES])
    logger.warning("%s an invalid message of %d bytes (%r...): %s", what, len(frame), head, exc)


_REQUEST_FIELDS = EngineCoreRequest.__struct_fields__
_AT_INDEX = re.compile(r"`\$\[(\d+)\]")


def _why(exc: Exception) -> str:
    """What was wrong, with the positions msgspec reports (``$[3]``) named after the fields of
    :class:`EngineCoreRequest` (``$.sampling_params``)."""
    if isinstance(exc, msgspec.DecodeError):
        text = _AT_INDEX.sub(_field_at, str(exc))
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def _field_at(match: re.Match[str]) -> str:
    index = int(match.group(1))  # 0 is the tag
    if 1 <= index <= len(_REQUEST_FIELDS):
        return f"`$.{_REQUEST_FIELDS[index - 1]}"
    return match.group(0)


_ADD_TAG = b"\xa3add"  # msgpack fixstr "add"


def read_add_request_id(frame: bytes | memoryview) -> str | None:
    """The request id of a frame that starts like an ``"add"`` message (an array whose first
    items are the tag and a str), read from its first bytes only, so a truncated or deeply
    nested rest does not matter; None when there is none."""
    view = memoryview(frame)
    if not view:
        return None
    head = view[0]
    pos = 1 if 0x91 <= head <= 0x9F else 3 if head == 0xDC else 5 if head == 0xDD else 0
    if not pos or view[pos : pos + 4] != _ADD_TAG:
        return None
    pos += 4
    kind = view[pos] if len(view) > pos else -1
    if 0xA0 <= kind <= 0xBF:  # fixstr
        length, pos = kind - 0xA0, pos + 1
    elif kind in (0xD9, 0xDA, 0xDB):  # str 8, 16, 32
        size = 1 << (kind - 0xD9)
        length = int.from_bytes(view[pos + 1 : pos + 1 + size], "big")
        pos += 1 + size
    else:
        return None
    raw = bytes(view[pos : pos + length])
    if len(raw) != length:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
