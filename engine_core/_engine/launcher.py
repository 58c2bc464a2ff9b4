"""How ``MPClient`` gets its engine: the seam between the client and where the engine runs.

An :class:`EngineLauncher` is used once: :meth:`~EngineLauncher.open_sockets` makes the client's
sockets (the output socket the engine sends to, the input socket requests go down, the in-process
wake-up), then :meth:`~EngineLauncher.start` starts the engine and returns an
:class:`EngineHandle`, which watches it in a thread and stops or kills it. The client's protocol,
inbox, liveness and failover logic do not depend on which launcher it got.

:class:`LocalLauncher` (the default) starts a child process on this machine (``launch``);
``ray_launch`` places the engine on a Ray cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine_core._engine.launch import ClientSockets, EngineProcess
from engine_core._engine.pipes.addresses import Transport
from engine_core._engine.pipes.pipes import Receiver, Sender

__all__ = ["EngineHandle", "EngineLauncher", "EngineSockets", "LocalLauncher"]


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

    def __init__(self, transport: Transport = "ipc", host: str = "127.0.0.1") -> None:
        self.transport: Transport = transport
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
