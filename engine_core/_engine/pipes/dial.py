"""The driver's ends of the pipe to an engine that dials in (one on another machine).

Unlike a local engine, whose input socket the client connects to, a remote engine connects both
sockets to the driver, so that only the driver accepts connections: :class:`DialSockets` binds
the output socket (PULL) and the input socket (PUSH) on TCP ports of ``host``, both CURVE servers
in a context that admits only the deployment's client key (see ``pipes.addresses``). The engine-core
process dials them when it is given the keys (``main``).

A bound PUSH socket queues nothing while no engine is connected: :meth:`DialSockets.connect_input`
(the client's answer to the engine's ``Hello``) waits until the engine's input connection is
admitted, and a message sent after that connection is gone (the engine's machine lost) is
dropped by the client (``MPClient``).
"""

from __future__ import annotations

import zmq

from engine_core._engine.pipes.addresses import (
    OUTPUT_HWM,
    DeploymentKeys,
    admit_only,
    curve_server,
    make_socket,
)
from engine_core._engine.pipes.pipes import Sender, ZmqReceiver, ZmqSender

__all__ = ["DialSockets"]

_PEER_TIMEOUT_S = 10.0
"""After an engine's Hello, how long its input connection may take to be admitted."""


class DialSockets:
    """The driver's ends of one remote engine's pipe: both sockets bound on ``host`` (TCP, a
    port each), CURVE servers in a context that admits only the deployment's client key."""

    def __init__(self, host: str, keys: DeploymentKeys) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth = admit_only(self._ctx, keys.client_public)
        self.output = ZmqReceiver(make_socket(self._ctx, zmq.PULL, hwm=OUTPUT_HWM), self._ctx)
        self._input = ZmqSender(make_socket(self._ctx, zmq.PUSH))
        self.input: Sender | None = None
        try:
            curve_server(self.output.sock, keys)
            self.output.bind(f"tcp://{_bracketed(host)}:*")  # and its in-process wake-up
            curve_server(self._input.sock, keys)
            self._input.sock.bind(f"tcp://{_bracketed(host)}:*")
            self.output_endpoint = self.output.endpoint
            self.input_endpoint = self._input.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self.close()
            raise

    def connect_input(self, address: str) -> None:
        """The engine dials the input socket: wait until its connection is admitted (it is
        under way when its Hello arrives), so that sending never blocks."""
        if not self._input.sock.poll(int(_PEER_TIMEOUT_S * 1000), zmq.POLLOUT):
            raise ConnectionError(
                f"the engine said Hello but its input connection to {self.input_endpoint} was "
                f"not admitted within {_PEER_TIMEOUT_S:g} s"
            )
        self.input = self._input

    def post_to_self(self, frame: bytes) -> None:
        self.output.post(frame)

    def close(self) -> None:
        self._input.close()
        self.output.close()
        self._auth.stop()
        self._ctx.term()


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host
