"""Rank 0's side: start the workers, broadcast steps and calls, notice deaths and failures."""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from engine_core._core.scheduler_output import SchedulerOutput
from engine_core._workers.messages import (
    REPORT_DECODER,
    Call,
    Failure,
    Ready,
    Result,
    Sampled,
    Scalar,
    Step,
)
from engine_core.config import EngineConfig

__all__ = ["WorkerDiedError", "WorkerGroup", "describe_exit"]

logger = logging.getLogger(__name__)

_POLL_MS = 20
CLOSE_TIMEOUT_S = 10.0


class WorkerDiedError(RuntimeError):
    """A worker process exited, or reported an error (it exits after reporting)."""

    def __init__(self, rank: int, what: str, *, exited: bool = False) -> None:
        super().__init__(f"tensor-parallel worker rank {rank} {what}")
        self.rank = rank
        self.exited = exited
        """The process ended (rather than reporting an error)."""


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with status {returncode}"


def _address(directory: str, name: str) -> str:
    return f"ipc://{directory}/{name}"


class WorkerGroup:
    """Workers of ranks 1..size-1, each running ``python -m module`` (which calls
    :func:`engine_core._workers.serve`). ``on_death(rank)`` runs on a watcher thread as soon as a
    worker process ends unexpectedly (e.g. to abort a collective rank 0 is blocked in)."""

    def __init__(
        self,
        module: str,
        size: int,
        config: EngineConfig,
        *,
        env: dict[str, str] | None = None,
        on_death: Callable[[int], None] | None = None,
    ) -> None:
        if size < 2:
            raise ValueError(f"a worker group needs size >= 2, got {size}")
        self.size = size
        self.directory = tempfile.mkdtemp(prefix="engine-core-tp-")  # mode 0700
        self._on_death = on_death
        self._seq = 0
        self._closing = False
        self._stopping = False
        """``close`` was sent: a worker exiting with status 0 is expected."""
        self._failure: WorkerDiedError | None = None
        self._pending: list[Ready | Result] = []
        self._lock = threading.Lock()
        self._context = zmq.Context()
        self._reports = self._context.socket(zmq.PULL)
        self._reports.setsockopt(zmq.LINGER, 0)
        self._reports.bind(_address(self.directory, "reports"))
        Path(self.directory, "config").write_bytes(msgspec.msgpack.encode(config))
        self._pushes: dict[int, zmq.Socket[bytes]] = {}
        for rank in range(1, size):
            push = self._context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, 0)  # lossless and ordered: never drop a step
            push.bind(_address(self.directory, f"rank{rank}"))
            self._pushes[rank] = push
        # Each worker holds the read end of this pipe: it reads EOF when this process is gone.
        read_end, self._parent_pipe = os.pipe()
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for rank in range(1, size):
                self.processes[rank] = subprocess.Popen(
                    [sys.executable, "-m", module, self.directory, str(rank), str(size),
                     str(read_end)],
                    pass_fds=(read_end,),
                    env={**os.environ, **(env or {})},
                )  # fmt: skip
        except BaseException:
            os.close(read_end)
            self.close()
            raise
        os.close(read_end)
        self._pidfds = {rank: os.pidfd_open(p.pid) for rank, p in self.processes.items()}
        self._wake_read, self._wake_write = os.pipe()
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()

    # -- deaths ---------------------------------------------------------------------------------

    @property
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.processes.items()}

    def _watch(self) -> None:
        waiting = dict(self._pidfds)
        while waiting:
            ready, _, _ = select.select([*waiting.values(), self._wake_read], [], [])
            if self._wake_read in ready:
                return
            for rank, fd in list(waiting.items()):
                if fd not in ready:
                    continue
                del waiting[rank]
                code = self.processes[rank].wait()
                if self._closing or (self._stopping and code == 0):
                    continue
                self._fail(WorkerDiedError(rank, describe_exit(code), exited=True))
                if self._on_death is not None:
                    try:
                        self._on_death(rank)
                    except Exception:  # noqa: BLE001 (best effort: the step fails anyway)
                        logger.exception("aborting after the death of rank %d failed", rank)

    def _fail(self, error: WorkerDiedError, *, reported: bool = False) -> None:
        """Record the first failure; a worker's own report replaces the exit it caused."""
        with self._lock:
            current = self._failure
            if current is None or (reported and current.rank == error.rank and current.exited):
                self._failure = error
                logger.error("%s", error)

    def _check_dead(self) -> None:
        """Raise the first failure noticed: a report received, or a process gone."""
        if self._failure is not None and self._failure.exited:
            self._drain(0)  # the worker may have said why before it exited
        if self._failure is not None:
            raise self._failure
        for rank, process in self.processes.items():
            code = process.poll()
            if code is not None and not self._closing and not (self._stopping and code == 0):
                self._fail(WorkerDiedError(rank, describe_exit(code), exited=True))
                raise self._failure or WorkerDiedError(rank, describe_exit(code))

    def check(self) -> None:
        """Raise :class:`WorkerDiedError` if a worker died or reported a failure."""
        self._drain(0)
        self._check_dead()

    def raise_failure(self) -> None:
        """Raise the death or failure already recorded (by the watcher thread, or a report
        read earlier), without polling: cheap enough for every step's results."""
        if self._failure is not None:
            self._check_dead()

    def failure(self) -> WorkerDiedError | None:
        """The first death or failure noticed (after waiting briefly for the watcher, so that a
        collective broken by a death is blamed on the dead rank)."""
        deadline = time.monotonic() + 1.0
        while self._failure is None and time.monotonic() < deadline:
            self._drain(0)
            if any(p.poll() is not None for p in self.processes.values()):
                break
            time.sleep(0.01)
        try:
            self._check_dead()
        except WorkerDiedError as exc:
            return exc
        return None

    # -- reports --------------------------------------------------------------------------------

    def _drain(self, timeout_ms: int) -> None:
        """Receive the reports that arrive within ``timeout_ms``: failures are recorded, the
        others kept for :meth:`_gather` (a result may arrive while rank 0 waits for another)."""
        if not self._reports.poll(timeout_ms):
            return
        while True:
            try:
                frame = self._reports.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            report = REPORT_DECODER.decode(frame)
            if isinstance(report, Failure):
                self._fail(WorkerDiedError(report.rank, f"failed: {report.error}"), reported=True)
            else:
                self._pending.append(report)

    def _gather(self, match: Callable[[Ready | Result], bool], timeout_s: float | None) -> list:
        """One matching report from every worker, in rank order."""
        found: dict[int, Ready | Result] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            for report in [r for r in self._pending if match(r)]:
                self._pending.remove(report)
                found[report.rank] = report
            if len(found) == self.size - 1:
                break
            self._check_dead()
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(set(self.processes) - set(found))
                raise TimeoutError(f"tensor-parallel workers {missing} did not answer")
            self._drain(_POLL_MS)
        self._check_dead()
        return [found[rank] for rank in sorted(found)]

    def wait_ready(self, timeout_s: float | None = None) -> None:
        self._gather(lambda r: isinstance(r, Ready), timeout_s)

    # -- commands -------------------------------------------------------------------------------

    def _send(self, frame: bytes) -> None:
        """To every worker. A PUSH socket blocks once its worker's connection is gone (no
        unlimited queue is left to take the frame): wait for room while watching for deaths
        instead, so that a worker dying just before a send fails it rather than hanging it."""
        for rank, push in self._pushes.items():
            deadline = time.monotonic() + CLOSE_TIMEOUT_S
            while True:
                try:
                    push.send(frame, zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    self._check_dead()
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"tensor-parallel worker rank {rank} takes no messages"
                        ) from None
                    push.poll(_POLL_MS, zmq.POLLOUT)

    def step(self, scheduler_output: SchedulerOutput) -> None:
        """Broadcast one step (workers answer nothing; a failure surfaces at the next check)."""
        self._drain(0)
        self._check_dead()
        self._send(msgspec.msgpack.encode(Step(scheduler_output)))

    def sampled(self, step: int, token_ids: list[list[int]]) -> None:
        """Send the ids sampled in ``step`` (the mock's model of a device broadcast)."""
        self._send(msgspec.msgpack.encode(Sampled(step, token_ids)))

    def call(self, method: str, *args: Scalar, timeout_s: float | None = None) -> list[Scalar]:
        """Run ``method`` on every worker; their results in rank order."""
        return self.finish_call(self.start_call(method, *args), timeout_s)

    def start_call(self, method: str, *args: Scalar) -> int:
        """Send a call without waiting (rank 0 then does its own part, e.g. joining the
        collectives the workers run); :meth:`finish_call` collects the results."""
        self._seq += 1
        self._drain(0)
        self._check_dead()
        self._send(msgspec.msgpack.encode(Call(self._seq, method, list(args))))
        return self._seq

    def finish_call(self, seq: int, timeout_s: float | None = None) -> list[Scalar]:
        results = self._gather(lambda r: isinstance(r, Result) and r.seq == seq, timeout_s)
        return [r.value for r in results]

    def close(self, *, graceful: bool = True) -> None:
        """Ask the workers to close, then end those that do not within a few seconds.
        ``graceful=False`` kills them at once (e.g. they may wait in a collective that rank 0
        will never join)."""
        if self._closing:
            return
        if not graceful:
            self._closing = True
            for process in self.processes.values():
                process.kill()
        elif self._failure is None and getattr(self, "_pidfds", None):
            self._stopping = True
            try:
                self.call("close", timeout_s=CLOSE_TIMEOUT_S)
            except (WorkerDiedError, TimeoutError) as exc:
                logger.warning("closing the tensor-parallel workers: %s", exc)
        self._closing = True
        for process in self.processes.values():
            try:
                process.wait(CLOSE_TIMEOUT_S if self._failure is None else 0.5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if getattr(self, "_pidfds", None):
            os.write(self._wake_write, b"x")
            self._watcher.join()
            for fd in (*self._pidfds.values(), self._wake_read, self._wake_write):
                os.close(fd)
            self._pidfds = {}
        os.close(self._parent_pipe)
        for push in self._pushes.values():
            push.close()
        self._reports.close()
        self._context.term()
        shutil.rmtree(self.directory, ignore_errors=True)
