"""The typed messages between rank 0 and its workers (msgspec msgpack, tagged unions)."""

from __future__ import annotations

import msgspec

from engine_core._core.scheduler_output import SchedulerOutput

__all__ = ["COMMAND_DECODER", "REPORT_DECODER", "Call", "Failure", "Ready", "Result", "Step"]

Scalar = int | float | str | bool | None


class Step(msgspec.Struct, tag="step", array_like=True):
    """One step: the scheduler's batch, and the ids rank 0 sampled in the previous step (one
    list per request of the previous batch, in its order; None when the previous step sampled
    nothing or there was none)."""

    scheduler_output: SchedulerOutput
    previous_sampled: list[list[int]] | None = None


class Call(msgspec.Struct, tag="call", array_like=True):
    """A control call (``initialize_kv_cache``, ``sleep``, ``profile``, ``close``...) that every
    worker answers with a :class:`Result` (or a :class:`Failure`)."""

    seq: int
    method: str
    args: list[Scalar] = []


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """A worker finished starting."""

    rank: int


class Result(msgspec.Struct, tag="result", array_like=True):
    rank: int
    seq: int
    value: Scalar = None


class Failure(msgspec.Struct, tag="failure", array_like=True):
    """A worker failed (it exits after sending this); ``seq`` is the call's, or -1."""

    rank: int
    seq: int
    error: str


COMMAND_DECODER = msgspec.msgpack.Decoder(Step | Call)
REPORT_DECODER = msgspec.msgpack.Decoder(Ready | Result | Failure)
