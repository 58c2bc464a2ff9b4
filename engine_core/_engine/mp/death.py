"""How the failures of the engine-core process are told to its callers: a control call that
raised, a start that failed, a death."""

from __future__ import annotations

import signal

import msgspec

from engine_core._engine.wire import EngineDead
from engine_core.errors import BackendError, EngineDeadError, EngineError, EngineStalledError
from engine_core.lora import LoRAError, UnknownLoRAError

__all__ = [
    "REMOTE_ERRORS",
    "RemoteEngineError",
    "call_error",
    "dead_error",
    "describe_exit",
    "startup_error",
]

REMOTE_ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "NotImplementedError": NotImplementedError,
    "BackendError": BackendError,
    "EngineStalledError": EngineStalledError,
}


class RemoteEngineError(Exception):
    """An exception raised inside the engine-core process, as reported across the process
    boundary; set as ``__cause__`` of the error that reports it. ``str()`` is the remote
    traceback."""

    def __init__(self, error_type: str, message: str, remote_traceback: str | None) -> None:
        super().__init__(remote_traceback or message)
        self.error_type = error_type
        self.message = message


def call_error(method: str, error_type: str | None, message: str) -> Exception:
    """The error for a control call that raised in the engine core: the same exception type
    where it is one callers know, else an :class:`EngineError` that names it."""
    error_type = error_type or "Exception"
    if error_type in ("LoRAError", "UnknownLoRAError"):
        cls = UnknownLoRAError if error_type == "UnknownLoRAError" else LoRAError
        try:
            detail = msgspec.json.decode(message)
            return cls(str(detail["lora_name"]), str(detail["reason"]))
        except (msgspec.DecodeError, KeyError, TypeError):
            return cls("?", message)
    if error_type in REMOTE_ERRORS:
        return REMOTE_ERRORS[error_type](message)
    return EngineError(f"{method} failed in the engine core: {error_type}: {message}")


def describe_exit(exit_code: int | None) -> str:
    if exit_code is None:
        return "ended"
    if exit_code < 0:
        try:
            return f"was killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"was killed by signal {-exit_code}"
    return f"exited with status {exit_code}"


def _remote_cause(notice: EngineDead | None) -> RemoteEngineError | None:
    if notice is None or notice.error_type is None:
        return None
    message = (notice.reason or "").removeprefix(f"{notice.error_type}: ")
    return RemoteEngineError(notice.error_type, message, notice.traceback)


def startup_error(notice: EngineDead | None, exit_code: int | None) -> Exception:
    """The error for a process that died before it was ready: the backend's exception type
    where it is one callers know (else :class:`BackendError`), with the remote traceback as
    its cause."""
    exit_text = f"its process {describe_exit(exit_code)}"
    if notice is not None and notice.reason is not None:
        message = f"the engine core failed to start ({exit_text}): {notice.reason}"
    else:
        message = f"the engine core failed to start: {exit_text}"
    error_type = notice.error_type if notice is not None else None
    error = REMOTE_ERRORS.get(error_type or "", BackendError)(message)
    error.__cause__ = _remote_cause(notice)
    return error


def dead_error(
    notice: EngineDead | None, exit_code: int | None, silent_s: float | None = None
) -> EngineDeadError:
    """The error for a process that died while serving, with the remote traceback as its
    cause where the engine sent one; or for one the client found silent for ``silent_s``
    seconds and killed, with a ``TimeoutError`` as its cause."""
    if silent_s is not None and (notice is None or notice.reason is None):
        error = EngineDeadError(
            f"the engine core is dead: it stopped answering for {silent_s:.1f} s "
            "(engine_heartbeat_timeout_s); its process was killed"
        )
        error.__cause__ = TimeoutError(
            f"the engine core sent nothing for {silent_s:.1f} s while requests or calls "
            "waited for it: it froze (a stopped or deadlocked process, a step holding the GIL)"
        )
        return error
    if notice is not None and notice.reason is not None:
        message = f"the engine core is dead: {notice.reason}"
        if exit_code is not None:
            message += f" (its process {describe_exit(exit_code)})"
    else:
        message = f"the engine core is dead: its process {describe_exit(exit_code)}"
    error = EngineDeadError(message)
    error.__cause__ = _remote_cause(notice)
    return error
