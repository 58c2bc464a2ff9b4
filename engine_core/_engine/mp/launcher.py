"""How ``MPClient`` gets its engine: the seam between the client and where the engine runs.

An :class:`EngineLauncher` is used once: :meth:`~EngineLauncher.open_sockets` makes the client's
sockets (the output socket the engine sends to, the input socket requests go down, the in-process
wake-up), then :meth:`~EngineLauncher.start` starts the engine and returns an
:class:`EngineHandle`, which watches it in a thread and stops or kills it. The client's protocol,
inbox, liveness and failover logic do not depend on which launcher it got.

:class:`LocalLauncher` (the default) starts a child process on this machine (below);
``ray.launch`` places the engine on a Ray cluster.

What the local launcher starts: :class:`ClientSockets` binds the client's output pipe (the engine
connects to it); :class:`EngineProcess` starts a fresh interpreter running
``python -m engine_core._engine`` (see ``main``): unlike ``multiprocessing``'s spawn it never
imports the caller's ``__main__``, so a script without an ``if __name__ == "__main__":`` guard,
``python -c``, a script on standard input, a notebook and the REPL all work. Its command line holds
only addresses; the configuration goes over the socket (``Hello``, ``Startup``). The interpreter
gets the caller's ``sys.path`` (as ``PYTHONPATH``), so it imports the same ``engine_core`` and
backends.

Each process holds one end of a socket pair: it reads end-of-file when the other process is gone,
so the engine exits when its parent dies and a thread here learns of the engine's exit. That
thread reaps the process and hands its exit status to the client; meanwhile it wakes when the
client's ``look`` asks to (to keep the clock of the engine's silences). Stopping waits for the
clean exit that a ``Shutdown`` message asks for, then escalates to SIGTERM and SIGKILL.
"""

from __future__ import annotations

import logging
import math
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Protocol

import anyio
import anyio.to_thread

from engine_core._engine.pipes.addresses import OUTPUT_HWM, SocketAddresses, TransportKind
from engine_core._engine.pipes.pipes import Pipes, Receiver, Sender

__all__ = [
    "ClientSockets",
    "EngineHandle",
    "EngineLauncher",
    "EngineProcess",
    "EngineSockets",
    "LocalLauncher",
    "WatchedEngine",
]

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 5.0
"""How long a stopping process may take to exit by itself before it is terminated."""
_TERMINATE_TIMEOUT_S = 2.0
"""How long a terminated process may take to exit before it is killed."""
_MAX_LOOK_INTERVAL_S = 3600.0


class ClientSockets:
    """The client's ends of the pipes: the output pipe (bound: the engine connects to it, and the
    client's own process watch posts into it) and the input pipe (connected to the engine's once
    it said where it listens, see :meth:`connect_input`)."""

    def __init__(self, transport: TransportKind, host: str) -> None:
        self.addresses = SocketAddresses(transport, host)
        self._pipes = Pipes()
        self.input: Sender | None = None
        try:
            self.output = self._pipes.receiver(self.addresses.output, hwm=OUTPUT_HWM, postable=True)
            self.output_endpoint = self.output.endpoint
        except BaseException:
            self.close()
            raise

    def connect_input(self, address: str) -> None:
        """Connect the input pipe to the engine's, bound at ``address``."""
        self.input = self._pipes.sender(address)

    def post_to_self(self, frame: bytes) -> None:
        """Put ``frame`` into the output pipe as the engine would (from any thread)."""
        self.output.post(frame)

    def close(self) -> None:
        """Close the pipes and delete their private directory."""
        self._pipes.close()
        self.addresses.remove()


def _engine_command(output_address: str, input_address: str, fd: int) -> list[str]:
    # -P: the working directory is not put first on the path (a local "zmq.py" would shadow
    # zmq); the caller's path comes in PYTHONPATH instead.
    return [
        sys.executable,
        "-P",
        "-m",
        "engine_core._engine",
        output_address,
        input_address,
        str(fd),
    ]


def _engine_env() -> dict[str, str]:
    """The caller's environment, with its ``sys.path`` as ``PYTHONPATH`` (entries added at run
    time, such as a script's directory or a test runner's, included)."""
    path = [entry or os.getcwd() for entry in sys.path]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    return env


def _wait_readable(fd: int, timeout: float | None) -> bool:
    """Whether ``fd`` becomes readable within ``timeout`` seconds (None: no limit). poll, not
    select: a process serving many connections has descriptors past select's 1024."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else math.ceil(max(timeout, 0.0) * 1000)))


class WatchedEngine:
    """Stopping an engine and waiting for its watch thread (``_watch``), as every engine handle
    does: a subclass says how the end is awaited (:meth:`exited`, :meth:`exited_async`) and what
    is done, in turn, when it does not come in time (:meth:`_escalation`)."""

    _watch: threading.Thread

    def exited(self, timeout: float | None) -> bool:
        """Whether the engine ends within ``timeout`` seconds (None: no limit)."""
        raise NotImplementedError

    async def exited_async(self, timeout: float | None) -> bool:
        """Like :meth:`exited`, waiting in the event loop."""
        raise NotImplementedError

    def _escalation(self) -> tuple[tuple[float, Callable[[], None]], ...]:
        """How long to wait for the end, and what to do when it did not come, step by step."""
        raise NotImplementedError

    def stop(self) -> None:
        """Wait for the end that a ``Shutdown`` asked for; escalate when it does not come in
        time (a process: terminate, then kill)."""
        for timeout, escalate in self._escalation():
            if self.exited(timeout):
                return
            escalate()

    async def stop_async(self) -> None:
        """Like :meth:`stop`, waiting in the event loop."""
        for timeout, escalate in self._escalation():
            if await self.exited_async(timeout):
                return
            escalate()

    def wait_watch(self, timeout: float | None = None) -> None:
        """Until the watch has handed over the exit status (or ``timeout`` seconds passed)."""
        self._watch.join(timeout)

    async def wait_watch_async(self, timeout: float | None = None) -> None:
        """Like :meth:`wait_watch`, waiting in a worker thread."""
        await anyio.to_thread.run_sync(self._watch.join, timeout)


class EngineProcess(WatchedEngine):
    """One engine-core process and the thread that watches it.

    ``on_exit(exit_code)`` runs in the watch thread once the process has ended and been reaped
    (negative: killed by that signal). ``look()`` runs in the watch thread first and then
    whenever the number of seconds it returned has passed (None: only the exit wakes the thread
    again). ``env`` adds to the process's environment.
    """

    def __init__(
        self,
        output_address: str,
        input_address: str,
        on_exit: Callable[[int], None],
        look: Callable[[], float | None] = lambda: None,
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        # Each end reads end-of-file once the process holding the other one is gone.
        ours, theirs = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                _engine_command(output_address, input_address, theirs.fileno()),
                stdin=subprocess.DEVNULL,
                env=_engine_env() | dict(env or {}),
                pass_fds=(theirs.fileno(),),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sentinel = ours
        self._watch = threading.Thread(
            target=self._watch_exit, args=(on_exit, look), name="EngineCore-watch", daemon=True
        )
        self._watch.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _watch_exit(self, on_exit: Callable[[int], None], look: Callable[[], float | None]) -> None:
        while True:
            timeout = look()
            if timeout is not None:
                timeout = min(timeout, _MAX_LOOK_INTERVAL_S)  # poll() takes no huge timeouts
            if _wait_readable(self._sentinel.fileno(), timeout):
                break
        on_exit(self._process.wait())  # this thread alone reaps the process

    def exited(self, timeout: float | None) -> bool:
        """Whether the process ends within ``timeout`` seconds (None: no limit)."""
        return _wait_readable(self._sentinel.fileno(), timeout)

    async def exited_async(self, timeout: float | None) -> bool:
        """Like :meth:`exited`, waiting in the event loop."""
        with anyio.move_on_after(timeout):
            await anyio.wait_readable(self._sentinel)
            return True
        return False

    def _escalation(self) -> tuple[tuple[float, Callable[[], None]], ...]:
        # How long to wait for the exit, and what to do when it did not come.
        return ((_SHUTDOWN_TIMEOUT_S, self._terminate), (_TERMINATE_TIMEOUT_S, self.kill))

    def kill(self) -> None:
        """SIGKILL the process (a no-op once it has been reaped)."""
        self._process.kill()  # Popen signals no process it has reaped

    def _terminate(self) -> None:
        logger.warning("the engine core did not shut down in time: terminating it")
        self._process.terminate()

    def close(self) -> None:
        """Kill the process if it still runs, wait for the watch, release the process."""
        if not self.exited(0):
            self.kill()
        self._watch.join()
        self._sentinel.close()


class EngineSockets(Protocol):
    """The client's ends of the pipe to one engine."""

    @property
    def output(self) -> Receiver: ...

    @property
    def input(self) -> Sender | None:
        """None until :meth:`connect_input`."""

    def connect_input(self, address: str) -> None:
        """Make the input socket reach the engine whose ``Hello`` named ``address``; sending
        never blocks afterwards."""

    def post_to_self(self, frame: bytes) -> None: ...

    def close(self) -> None: ...


class EngineHandle(Protocol):
    """A started engine and the thread that watches it: ``on_exit(exit_code)`` runs in that
    thread once the engine has ended; ``look()`` runs there first and then whenever the seconds
    it returned have passed."""

    @property
    def pid(self) -> int | None: ...

    def kill(self) -> None: ...

    def stop(self) -> None:
        """Wait for the exit a ``Shutdown`` asked for; escalate when it does not come."""

    async def stop_async(self) -> None: ...

    def wait_watch(self, timeout: float | None = None) -> None: ...

    async def wait_watch_async(self, timeout: float | None = None) -> None: ...

    def close(self) -> None:
        """Kill the engine if it still runs and release it (idempotent)."""


class EngineLauncher(Protocol):
    def open_sockets(self) -> EngineSockets: ...

    def start(
        self, on_exit: Callable[[int], None], look: Callable[[], float | None]
    ) -> EngineHandle: ...


class LocalLauncher:
    """An engine-core process on this machine, on ``ipc://`` (or ``tcp`` on ``host``) sockets."""

    def __init__(self, transport: TransportKind = "ipc", host: str = "127.0.0.1") -> None:
        self.transport: TransportKind = transport
        self.host = host
        self._sockets: ClientSockets | None = None

    def open_sockets(self) -> ClientSockets:
        self._sockets = ClientSockets(self.transport, self.host)
        return self._sockets

    def start(
        self, on_exit: Callable[[int], None], look: Callable[[], float | None]
    ) -> EngineProcess:
        assert self._sockets is not None, "open_sockets() first"
        return EngineProcess(
            self._sockets.output_endpoint, self._sockets.addresses.input, on_exit, look
        )
