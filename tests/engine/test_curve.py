"""The CURVE helpers of ``pipes.addresses``: a driver's sockets admit the deployment's engines and
refuse every other peer (no keys, another client key, a wrong server key), both ways."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from engine_core._engine.pipes.addresses import (
    DeploymentKeys,
    EngineKeys,
    admit_only,
    curve_client,
    curve_server,
    deployment_keys,
    make_socket,
)

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")

REFUSED_WAIT_MS = 500
"""How long a refused peer's message is waited for (it never comes)."""


class Driver:
    """A driver's two bound sockets (CURVE servers admitting one client key)."""

    def __init__(self, keys: DeploymentKeys) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.auth = admit_only(self.ctx, keys.client_public)
        self.output = make_socket(self.ctx, zmq.PULL)
        self.input = make_socket(self.ctx, zmq.PUSH)
        for sock in (self.output, self.input):
            curve_server(sock, keys)
            sock.bind("tcp://127.0.0.1:*")

    def endpoint(self, sock: zmq.Socket[bytes]) -> str:
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        self.output.close()
        self.input.close()
        self.auth.stop()
        self.ctx.term()


@pytest.fixture
def keys() -> DeploymentKeys:
    return deployment_keys()


@pytest.fixture
def driver(keys: DeploymentKeys) -> Iterator[Driver]:
    d = Driver(keys)
    yield d
    d.close()


class Peers:
    """Sockets of the other side, in a context of their own, all closed at the end."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sockets: list[zmq.Socket[bytes]] = []

    def socket(self, socket_type: int) -> zmq.Socket[bytes]:
        sock = make_socket(self.ctx, socket_type)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.ctx.term()


@pytest.fixture
def peers() -> Iterator[Peers]:
    p = Peers()
    yield p
    p.close()


def _stranger(keys: DeploymentKeys) -> EngineKeys:
    public, secret = zmq.curve_keypair()
    return EngineKeys(
        server_public=keys.server_public,
        client_public=public.decode(),
        client_secret=secret.decode(),
    )


def _wrong_server(keys: DeploymentKeys) -> EngineKeys:
    return EngineKeys(
        server_public=zmq.curve_keypair()[0].decode(),
        client_public=keys.client_public,
        client_secret=keys.client_secret,
    )


def test_keys_are_fresh_per_deployment(keys: DeploymentKeys) -> None:
    other = deployment_keys()
    assert (
        len({keys.server_public, keys.client_public, other.server_public, other.client_public}) == 4
    )
    assert keys.for_engine() == EngineKeys(
        server_public=keys.server_public,
        client_public=keys.client_public,
        client_secret=keys.client_secret,
    )
    assert keys.server_secret not in repr(keys.for_engine())


def test_the_engines_keys_are_admitted_both_ways(
    keys: DeploymentKeys, driver: Driver, peers: Peers
) -> None:
    push = peers.socket(zmq.PUSH)
    pull = peers.socket(zmq.PULL)
    for sock, bound in ((push, driver.output), (pull, driver.input)):
        curve_client(sock, keys.for_engine())
        sock.connect(driver.endpoint(bound))
    push.send(b"up")
    assert driver.output.poll(5000) and driver.output.recv() == b"up"
    assert driver.input.poll(5000, zmq.POLLOUT)
    driver.input.send(b"down")
    assert pull.poll(5000) and pull.recv() == b"down"


@pytest.mark.parametrize("who", ["no keys", "another client key", "a wrong server key"])
def test_a_peer_without_the_keys_is_refused(
    who: str, keys: DeploymentKeys, driver: Driver, peers: Peers
) -> None:
    push = peers.socket(zmq.PUSH)
    pull = peers.socket(zmq.PULL)
    if who != "no keys":
        bad = _stranger(keys) if who == "another client key" else _wrong_server(keys)
        curve_client(push, bad)
        curve_client(pull, bad)
    push.connect(driver.endpoint(driver.output))
    pull.connect(driver.endpoint(driver.input))
    push.send(b"forged", zmq.NOBLOCK)  # queued on the peer's side: it never gets through
    assert driver.output.poll(REFUSED_WAIT_MS) == 0
    # Nothing can be sent to it: the driver's input socket has no admitted peer.
    assert driver.input.poll(0, zmq.POLLOUT) == 0
    # An admitted engine still gets in beside it.
    good = peers.socket(zmq.PUSH)
    curve_client(good, keys.for_engine())
    good.connect(driver.endpoint(driver.output))
    good.send(b"real")
    assert driver.output.poll(5000) and driver.output.recv() == b"real"
    assert driver.output.poll(0) == 0
