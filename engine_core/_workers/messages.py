"""The typed messages between rank 0 and its workers (msgspec msgpack, tagged unions)."""

from __future__ import annotations

import msgspec

from engine_core._core.scheduler_output import SchedulerOutput

__all__ = [
    "COMMAND_DECODER",
    "REPORT_DECODER",
    "Call",
    "Failure",
    "Ready",
    "Result",
    "Sampled",
    "Step",
]

Scalar = int | float | str | bool | None


class Step(msgspec.Struct, tag="step", array_like=True):
    """One step: the scheduler's batch. The ids rank 0 samples do not ride here: under async
    scheduling the next step is launched before they are known on the host. A real backend
    broadcasts them device to device on the step's stream; the mock sends :class:`Sampled`."""

    scheduler_output: SchedulerOutput


class Sampled(msgspec.Struct, tag="sampled", array_like=True):
    """The ids rank 0 sampled in step ``step`` (the count of steps broadcast so far, from 1):
    one list per request of that step's batch, in its order. The mock's model of a device
    broadcast: sent only once the step's results exist on its device timeline, so a worker
    must hold back the next step until they arrive."""

    step: int
    token_ids: list[list[int]]


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


COMMAND_DECODER = msgspec.msgpack.Decoder(Step | Sampled | Call)
REPORT_DECODER = msgspec.msgpack.Decoder(Ready | Result | Failure)
