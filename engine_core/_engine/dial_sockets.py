"""The driver's ends of the pipe to an engine that dials in (one on another machine).

Unlike a local engine, whose input socket the client connects to, a remote engine connects both
sockets to the driver, so that only the driver accepts connections: :class:`DialSockets` binds
the output socket (PULL) and the input socket (PUSH) on TCP ports of ``host``, both CURVE servers
in a context that admits only the deployment's client key (see ``sockets``). The engine-core
process dials them when it is given the keys (``main``).

A bound PUSH socket queues nothing while no engine is connected: :meth:`DialSockets.connect_input`
(the client's answer to the engine's ``Hello``) waits until the engine's input connection is
admitted, and a message sent after that connection is gone (the engine's machine lost) is
dropped by the client (``MPClient``).
"""

from __future__ import annotations

import uuid

import zmq

from engine_core._engine.sockets import (
    OUTPUT_HWM,
    DeploymentKeys,
    admit_only,
    curve_server,
    make_socket,
)

__all__ = ["DialSockets"]

_PEER_TIMEOUT_S = 10.0
"""After an engine's Hello, how long its input connection may take to be admitted."""
_WAKE_LINGER_MS = 1000


class DialSockets:
    """The driver's ends of one remote engine's pipe: both sockets bound on ``host`` (TCP, a
    port each), CURVE servers in a context that admits only the deployment's client key."""

    def __init__(self, host: str, keys: DeploymentKeys) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth = admit_only(self._ctx, keys.client_public)
        self.output = make_socket(self._ctx, zmq.PULL, hwm=OUTPUT_HWM)
        self.input = make_socket(self._ctx, zmq.PUSH)
        self.wake = f"inproc://engine-core-wake-{uuid.uuid4().hex}"
        try:
            for sock in (self.output, self.input):
                curve_server(sock, keys)
                sock.bind(f"tcp://{_bracketed(host)}:*")
            self.output_endpoint = self.output.getsockopt_string(zmq.LAST_ENDPOINT)
            self.input_endpoint = self.input.getsockopt_string(zmq.LAST_ENDPOINT)
            self.output.bind(self.wake)  # in process: no handshake, no CURVE
        except BaseException:
            self.close()
            raise

    def connect_input(self, address: str) -> None:
        """The engine dials the input socket: wait until its connection is admitted (it is
        under way when its Hello arrives), so that sending never blocks."""
        if not self.input.poll(int(_PEER_TIMEOUT_S * 1000), zmq.POLLOUT):
            raise ConnectionError(
                f"the engine said Hello but its input connection to {self.input_endpoint} was "
                f"not admitted within {_PEER_TIMEOUT_S:g} s"
            )

    def post_to_self(self, frame: bytes) -> None:
        wake = make_socket(self._ctx, zmq.PUSH, linger_ms=_WAKE_LINGER_MS)
        try:
            wake.connect(self.wake)
            wake.send(frame)
        finally:
            wake.close()

    def close(self) -> None:
        self.input.close()
        self.output.close()
        self._auth.stop()
        self._ctx.term()


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host
