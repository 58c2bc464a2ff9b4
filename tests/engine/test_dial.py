"""An engine that dials its driver (as a remote one does, without Ray): the engine-core process
given the deployment's keys connects both sockets to the driver's CURVE servers and serves; one
given other keys never gets in."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
import zmq

from engine_core._core.engine_io import EngineCoreRequest
from engine_core._engine.main import DIAL_KEYS_ENV
from engine_core._engine.mp.client import MPClient
from engine_core._engine.mp.launcher import EngineProcess
from engine_core._engine.pipes.addresses import DeploymentKeys, EngineKeys, deployment_keys
from engine_core._engine.pipes.dial import DialSockets
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


def config(**options: object) -> EngineConfig:
    return EngineConfig(backend="mock", num_kv_blocks=64, **options)  # type: ignore[arg-type]


class DialingEngine:
    """A launcher: a local engine-core process that dials the driver's sockets with ``given``
    keys."""

    def __init__(self, keys: DeploymentKeys, given: EngineKeys) -> None:
        self.keys = keys
        self.given = given
        self.sockets: DialSockets | None = None

    def open_sockets(self) -> DialSockets:
        self.sockets = DialSockets("127.0.0.1", self.keys)
        return self.sockets

    def start(
        self, on_exit: Callable[[int], None], look: Callable[[], float | None]
    ) -> EngineProcess:
        assert self.sockets is not None
        env = {DIAL_KEYS_ENV: msgspec.json.encode(self.given).decode()}
        return EngineProcess(
            self.sockets.output_endpoint, self.sockets.input_endpoint, on_exit, look, env=env
        )


def test_an_engine_with_the_keys_dials_in_and_serves() -> None:
    keys = deployment_keys()
    launcher = DialingEngine(keys, keys.for_engine())
    with MPClient(config(), launcher=launcher) as client:
        assert launcher.sockets is not None
        assert launcher.sockets.input_endpoint.startswith("tcp://127.0.0.1:")
        params = SamplingParams(temperature=0.0, max_tokens=4)
        client.add_request(EngineCoreRequest("r", [1, 2, 3], params))
        tokens: list[int] = []
        while not (outputs := client.get_output()).finished:
            tokens += [t for new in outputs.new_token_ids for t in new]
        tokens += [t for new in outputs.new_token_ids for t in new]
        assert tokens == [4, 5, 6, 7]
        assert [(f.req_id, f.finish_reason) for f in outputs.finished] == [("r", "length")]


def test_an_engine_with_other_keys_never_gets_in() -> None:
    keys = deployment_keys()
    public, secret = zmq.curve_keypair()
    stranger = EngineKeys(
        server_public=keys.server_public,
        client_public=public.decode(),
        client_secret=secret.decode(),
    )
    with pytest.raises(TimeoutError, match="did not start within startup_timeout_s"):
        MPClient(config(startup_timeout_s=1.5), launcher=DialingEngine(keys, stranger))
