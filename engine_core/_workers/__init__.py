"""Worker processes of a multi-process backend (tensor parallelism): rank 0 is the backend in the
engine-core process, ranks 1..N-1 are processes it starts. Each step rank 0 broadcasts one typed
msgspec message (the scheduler output) over private ipc sockets; the sampled ids travel device to
device (the mock sends them as a message once its step has run); control calls ride the same
channel; workers report readiness, results and errors on a socket of their own. No pickle on any
channel. No torch here: the mock uses the same machinery.
"""

from engine_core._workers.group import WorkerDiedError, WorkerGroup
from engine_core._workers.messages import Call, Failure, Ready, Result, Sampled, Step
from engine_core._workers.worker import WorkerHandler, serve

__all__ = [
    "Call",
    "Failure",
    "Ready",
    "Result",
    "Sampled",
    "Step",
    "WorkerDiedError",
    "WorkerGroup",
    "WorkerHandler",
    "serve",
]
