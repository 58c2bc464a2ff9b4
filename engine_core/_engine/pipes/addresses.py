"""Where the pipes of a client / engine-core pair bind, and how an event loop awaits a ZMQ
socket under asyncio and trio alike.

Addresses. By default the pipes are Unix stream sockets (``unix://``, see ``pipes.unix``) at
paths in a private temporary directory (mode 0700, so other users cannot connect), removed when
the client shuts down; ``transport="zmq-ipc"`` (or ``ENGINE_CORE_IPC_TRANSPORT=zmq`` in the
environment, or a platform without epoll) makes them ZMQ ``ipc://`` sockets in the same
directory. With ``transport="tcp"`` they are ZMQ sockets bound on ``host`` (127.0.0.1 unless
told otherwise) on ports the OS picks.

Awaiting. pyzmq's async sockets are asyncio-only, so an event loop waits instead on the socket's
notification descriptor (``zmq.FD``) with :func:`anyio.wait_readable`. That descriptor is
edge-triggered and only ever readable: it signals that the socket's events *may* have changed.
The rule that makes it safe: try the non-blocking operation first and wait only after it failed
with ``EAGAIN``; a failed attempt re-arms the descriptor. ``bench/zmq_transport.py`` compares
this with blocking sockets in a worker thread (slower by one thread hop per message). One task at
a time may wait on a given socket.

Authentication. Sockets that leave the machine (the engines of a Ray deployment dial the driver
over TCP) use ZMQ CURVE, which authenticates and encrypts: :func:`deployment_keys` makes a
server and a client key pair for one deployment; the driver's sockets are CURVE servers
(:func:`curve_server`) whose context admits only the deployment's client key
(:func:`admit_only`, a ZAP handler); the engines' sockets are CURVE clients
(:func:`curve_client`). A peer without the keys never completes the handshake.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import tempfile
from typing import Any, Literal

import anyio
import msgspec
import zmq

__all__ = [
    "OUTPUT_HWM",
    "TRANSPORTS",
    "DeploymentKeys",
    "EngineKeys",
    "admit_only",
    "curve_client",
    "curve_server",
    "deployment_keys",
    "SocketAddresses",
    "TransportKind",
    "unix_stream_available",
    "make_socket",
    "recv_async",
    "send_async",
]

TransportKind = Literal["ipc", "zmq-ipc", "tcp"]
TRANSPORTS: tuple[TransportKind, ...] = ("ipc", "zmq-ipc", "tcp")

OUTPUT_HWM = 16
"""Step outputs ZMQ holds on each side of the engine -> client pipe. A client that stops reading
(its event loop blocked, say) then holds the engine back (see ``EngineCoreProc``) instead of
having every step's output pile up in both processes' memory."""


class SocketAddresses:
    """Where the client's output pipe and the engine's input pipe bind.

    ``output`` and ``input`` are bind addresses (``tcp://host:*`` picks a free port; the bound
    endpoint is read back from the socket); their scheme chooses the pipe (see ``pipes``).
    """

    def __init__(self, transport: TransportKind = "ipc", host: str = "127.0.0.1") -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "ipc" and not unix_stream_available():
            transport = "zmq-ipc"
        self.transport = transport
        self.directory: str | None = None
        if transport == "tcp":
            self.output = f"tcp://{host}:*"
            self.input = f"tcp://{host}:*"
        else:
            self.directory = tempfile.mkdtemp(prefix="engine-core-")
            os.chmod(self.directory, 0o700)  # mkdtemp's default; stated, not assumed
            scheme = "unix" if transport == "ipc" else "ipc"
            self.output = f"{scheme}://{self.directory}/output"
            self.input = f"{scheme}://{self.directory}/input"

    def remove(self) -> None:
        """Delete the private directory (idempotent)."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def unix_stream_available() -> bool:
    """Whether same-host pipes are Unix stream sockets: where there is epoll, unless
    ``ENGINE_CORE_IPC_TRANSPORT=zmq`` asks for ZMQ's ``ipc://`` sockets."""
    return hasattr(select, "epoll") and os.environ.get("ENGINE_CORE_IPC_TRANSPORT") != "zmq"


def make_socket(
    ctx: zmq.Context[zmq.Socket[bytes]], socket_type: int, *, linger_ms: int = 0, hwm: int = 0
) -> zmq.Socket[bytes]:
    """A socket whose queues hold ``hwm`` messages each way (0: unbounded, so sends never block
    on a connected pipe) with the given linger: how long closing waits for unsent messages."""
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, linger_ms)
    return sock


class EngineKeys(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine needs to dial its driver (Z85 text): the driver's public key and the
    deployment's client key pair."""

    server_public: str
    client_public: str
    client_secret: str


class DeploymentKeys(msgspec.Struct, frozen=True, kw_only=True):
    """One deployment's CURVE keys (Z85 text): the driver's server pair, the engines' client
    pair."""

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    def for_engine(self) -> EngineKeys:
        return EngineKeys(
            server_public=self.server_public,
            client_public=self.client_public,
            client_secret=self.client_secret,
        )


def deployment_keys() -> DeploymentKeys:
    """Fresh key pairs for one deployment (needs a libzmq built with CURVE)."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support: remote engines cannot be secured")
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return DeploymentKeys(
        server_public=server_public.decode(),
        server_secret=server_secret.decode(),
        client_public=client_public.decode(),
        client_secret=client_secret.decode(),
    )


def curve_server(sock: zmq.Socket[bytes], keys: DeploymentKeys) -> None:
    """Make ``sock`` (before it binds) a CURVE server with the deployment's server keys."""
    sock.curve_secretkey = keys.server_secret.encode()
    sock.curve_publickey = keys.server_public.encode()
    sock.curve_server = True


def curve_client(sock: zmq.Socket[bytes], keys: EngineKeys) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the deployment's server."""
    sock.curve_serverkey = keys.server_public.encode()
    sock.curve_publickey = keys.client_public.encode()
    sock.curve_secretkey = keys.client_secret.encode()


class _OneKey:
    """A ZAP credentials check that admits one client key."""

    def __init__(self, client_public: str) -> None:
        self.key = client_public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


def admit_only(ctx: zmq.Context[zmq.Socket[bytes]], client_public: str) -> Any:
    """Start a ZAP handler in ``ctx`` that admits CURVE clients with ``client_public`` alone
    (without one, a CURVE server admits any client that knows its public key). Stop it (its
    ``stop()``) before terminating the context."""
    from zmq.auth.thread import ThreadAuthenticator

    authenticator = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
    authenticator.start()
    authenticator.configure_curve_callback("*", _OneKey(client_public))
    return authenticator


async def recv_async(sock: zmq.Socket[bytes]) -> bytes:
    """The next frame of ``sock``. Returns without yielding when one is already queued;
    cancelling it loses nothing."""
    while True:
        try:
            return sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            await anyio.wait_readable(sock.FD)


async def send_async(sock: zmq.Socket[bytes], frame: bytes) -> None:
    """Send ``frame``, waiting while the socket cannot take it (before a bound peer connects, or
    while a bounded queue is full)."""
    while True:
        try:
            sock.send(frame, zmq.NOBLOCK)
            return
        except zmq.Again:
            await anyio.wait_readable(sock.FD)
