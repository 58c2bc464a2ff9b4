"""Rank 0's side of tensor parallelism in the CUDA backend: the workers (ranks 1..N-1, started
here), the process group, and the calls that must reach every rank."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine_core._workers import WorkerDiedError, WorkerGroup
from engine_core._workers.messages import Scalar
from engine_core.abc import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput
from engine_core.config import EngineConfig
from engine_core_cuda._model_runner import AsyncSampled
from engine_core_cuda._options import CudaOptions
from engine_core_cuda._tp.parallel import TensorParallel, init_distributed, share_cpu

__all__ = ["Coordinator", "rank_options"]

logger = logging.getLogger(__name__)

WORKER_MODULE = "engine_core_cuda._tp.worker"


class _Watched(AsyncModelRunnerOutput):
    __slots__ = ("_handle", "_coordinator", "device_time_s")

    def __init__(self, handle: AsyncSampled, coordinator: Coordinator) -> None:
        self._handle = handle
        self._coordinator = coordinator
        self.device_time_s: float | None = None

    def get_output(self) -> ModelRunnerOutput:
        self._coordinator.wait_ready(self._handle)
        output = self._handle.get_output()
        self.device_time_s = self._handle.device_time_s
        return output


def rank_options(options: CudaOptions, rank: int) -> CudaOptions:
    """A rank's options: with NCCL, rank r runs on the r-th GPU from the one asked for; gloo
    ranks share the device (a correctness check on one GPU)."""
    device = options.device
    if not device.startswith("cuda") or options.distributed_backend == "gloo":
        return options
    base = int(device.partition(":")[2] or 0)
    return dataclasses.replace(options, device=f"cuda:{base + rank}")


def join(options: CudaOptions, rank: int, size: int, directory: str) -> TensorParallel:
    device = torch.device(options.device)
    return init_distributed(rank, size, directory, device, options.distributed_backend)


class Coordinator:
    """Starts the workers; ``parallel`` is rank 0's membership of the group."""

    def __init__(self, config: EngineConfig, options: CudaOptions) -> None:
        size = config.tensor_parallel_size
        device = torch.device(options.device)
        if device.type == "cuda" and options.distributed_backend != "gloo":
            last = (device.index or 0) + size - 1
            if last >= torch.cuda.device_count():
                raise RuntimeError(
                    f"tensor_parallel_size={size} from {device} needs cuda:{last}; this machine "
                    f"has {torch.cuda.device_count()} CUDA device(s)"
                )
        self.parallel: TensorParallel | None = None
        self.died = threading.Event()
        """Set on the watcher thread when a worker dies (a pending step's handle then fails)."""
        self._dead_rank = 0
        self.workers = WorkerGroup(WORKER_MODULE, size, config, on_death=self._abort)
        self.mid_step = False
        """A step was broadcast whose collectives rank 0 has not all joined (it failed before
        sampling): the workers may wait in one forever, so closing kills them."""
        try:
            self.workers.wait_ready()
            share_cpu(device, size, options.cpu_threads)
            self._loading = self.workers.start_call("load")
            self.parallel = self._join(options, size)
        except BaseException:
            self.workers.close()
            raise

    def _join(self, options: CudaOptions, size: int) -> TensorParallel:
        """Join the group on a thread, watching the workers meanwhile: a worker that fails
        before joining must not leave rank 0 waiting for the rendezvous's timeout."""
        joined: list[TensorParallel] = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                joined.append(join(options, 0, size, self.workers.directory))
            except BaseException as exc:  # noqa: BLE001 (re-raised by the caller)
                errors.append(exc)

        thread = threading.Thread(target=run, name="tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            self.workers.check()
        if errors:
            raise errors[0]
        return joined[0]

    def loaded(self) -> None:
        """Wait for the workers' model loads (after rank 0's own)."""
        self.workers.finish_call(self._loading)

    def _abort(self, rank: int) -> None:
        self._dead_rank = rank
        self.died.set()
        if self.parallel is not None:
            self.parallel.abort()

    @contextmanager
    def on_every_rank(self, method: str, *args: Scalar) -> Iterator[list[Scalar]]:
        """Run ``method`` on the workers while rank 0 runs its own part in the ``with`` block;
        the workers' results are in the yielded list once the block ends."""
        results: list[Scalar] = []
        seq = self.workers.start_call(method, *args)
        yield results
        results.extend(self.workers.finish_call(seq))

    def step(self, scheduler_output: SchedulerOutput) -> None:
        self.workers.step(scheduler_output)
        self.mid_step = True

    def sampled(self) -> None:
        """Rank 0 joined the last step's collectives, its sampled ids' broadcast included."""
        self.mid_step = False

    def blame(self, exc: BaseException) -> None:
        """Re-raise a failed step as the death of the worker that caused it, if one died."""
        failure = self.workers.failure()
        if failure is not None:
            raise failure from exc

    def watch(self, handle: AsyncSampled) -> AsyncModelRunnerOutput:
        """A step's handle that fails when a worker dies before the step's results are ready
        (a collective waiting for a dead peer would otherwise never end on the device)."""
        return _Watched(handle, self)

    def wait_ready(self, handle: AsyncSampled) -> None:
        """Until ``handle``'s results are ready; ``WorkerDiedError`` if a worker dies first."""
        delay = 20e-6
        while not handle.ready():
            if self.died.wait(delay):
                # Recorded before ``died`` is set, with the exit status or the worker's report.
                raise self.workers.failure() or WorkerDiedError(self._dead_rank, "died")
            delay = min(2 * delay, 2e-4)

    def close(self) -> None:
        self.workers.close(graceful=not self.mid_step)
        if self.parallel is not None:
            self.parallel.destroy()
