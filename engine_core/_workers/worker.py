"""A worker's side: decode commands from rank 0, run them on a handler, report back."""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, Protocol

import msgspec
import zmq

from engine_core._workers.messages import (
    COMMAND_DECODER,
    Call,
    Failure,
    Ready,
    Result,
    Sampled,
    Scalar,
    Step,
)
from engine_core.config import EngineConfig

__all__ = ["PARENT_GONE_EXIT_CODE", "WorkerHandler", "serve"]

logger = logging.getLogger(__name__)

PARENT_GONE_EXIT_CODE = 3
"""Exit status of a worker whose parent (rank 0's process) is gone."""


class WorkerHandler(Protocol):
    """What a backend runs in a worker process."""

    def step(self, step: Step) -> None: ...

    def sampled(self, sampled: Sampled) -> None:
        """The ids rank 0 sampled in a step, for a backend that sends them as a message."""
        ...

    def call(self, method: str, args: list[Scalar]) -> Scalar:
        """Run a control call; raise ``ValueError`` for an unknown ``method``."""
        ...


HandlerFactory = Callable[[EngineConfig, int, int, str], WorkerHandler]
"""``(config, rank, size, private directory) -> handler``."""


def _exit_when_parent_dies(fd: int) -> None:
    while os.read(fd, 1):
        pass
    logging.getLogger(__name__).warning("the parent process is gone: exiting")
    os._exit(PARENT_GONE_EXIT_CODE)


def serve(make_handler: HandlerFactory) -> NoReturn:
    """A worker's main: ``argv`` is ``directory rank size parent_fd`` as
    :class:`~engine_core._workers.WorkerGroup` starts it. Exits 0 after ``close``, 1 after a
    failure (reported first)."""
    directory, rank_text, size_text, fd_text = sys.argv[1:5]
    rank, size = int(rank_text), int(size_text)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s [tp rank {rank}] %(name)s: %(message)s",
    )
    threading.Thread(
        target=_exit_when_parent_dies, args=(int(fd_text),), name="parent-watch", daemon=True
    ).start()
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(f"ipc://{directory}/rank{rank}")
    reports = context.socket(zmq.PUSH)
    reports.setsockopt(zmq.LINGER, 5000)
    reports.connect(f"ipc://{directory}/reports")

    def fail(seq: int, exc: BaseException) -> NoReturn:
        logger.error("failed", exc_info=exc)
        error = f"{type(exc).__name__}: {exc}"
        reports.send(msgspec.msgpack.encode(Failure(rank, seq, error)))
        reports.close()
        context.term()
        sys.stderr.write("".join(traceback.format_exception(exc)))
        os._exit(1)

    try:
        config = msgspec.msgpack.decode(Path(directory, "config").read_bytes(), type=EngineConfig)
        handler = make_handler(config, rank, size, directory)
    except Exception as exc:  # noqa: BLE001 (reported to rank 0)
        fail(-1, exc)
    reports.send(msgspec.msgpack.encode(Ready(rank)))
    while True:
        seq = -1
        try:
            command = COMMAND_DECODER.decode(commands.recv())
            if isinstance(command, Call):
                seq = command.seq
                value = handler.call(command.method, command.args)
                reports.send(msgspec.msgpack.encode(Result(rank, seq, value)))
                if command.method == "close":
                    break
            elif isinstance(command, Step):
                handler.step(command)
            else:
                handler.sampled(command)
        except Exception as exc:  # noqa: BLE001 (reported to rank 0)
            fail(seq, exc)
    commands.close()
    reports.close()
    context.term()
    logging.shutdown()
    os._exit(0)
