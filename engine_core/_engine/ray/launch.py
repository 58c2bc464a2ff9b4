"""Engines placed by Ray: ``data_parallel_backend="ray"``.

Ray does placement and lifecycle only. :class:`RayDeployment` joins the cluster (or starts a local
one), makes the deployment's CURVE keys and gives each engine a placement group of its own (one
bundle, see ``ray.placement``), waiting at most ``placement_timeout_s`` before failing with what was
asked and what the cluster has. :class:`RayLauncher` is the ``MPClient`` launcher of one engine: the
driver binds two TCP sockets (``pipes.dial``: CURVE servers that admit only the deployment's client
key), and an actor in the engine's placement group starts the usual engine-core process
(``python -m engine_core._engine``) on its node, which dials both sockets with the keys it got
through the actor's arguments. Requests, outputs and control calls then flow over ZMQ exactly as
with a local engine; Ray's object store and pickling carry only addresses and keys.

Liveness. The actor's ``run`` returns the engine process's exit status once it ends; a thread
waits on that ref (:class:`RayEngineHandle`). When the actor dies instead (its node is lost,
it is killed) the ref fails: the handle posts a death notice naming the actor's error into the
client's own output socket, and the client declares the engine dead as it would for a local
process; the data-parallel failover and restarts apply unchanged. The engine process exits by
itself once its actor is gone (its end of the socket pair reads end-of-file).

This module imports Ray; only ``DPClient`` imports it, and only for the Ray backend.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import ray
import zmq
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine_core._engine.main import DIAL_KEYS_ENV
from engine_core._engine.mp.launcher import EngineProcess, WatchedEngine
from engine_core._engine.pipes.addresses import deployment_keys
from engine_core._engine.pipes.dial import DialSockets
from engine_core._engine.ray.placement import (
    NodeView,
    PlacementError,
    engine_bundle,
    label_selector,
    placement_error_message,
)
from engine_core._engine.wire import EngineDead
from engine_core.config import EngineConfig

__all__ = ["RayDeployment", "RayEngineHandle", "RayLauncher"]

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 5.0
"""How long a stopping engine may take to exit by itself before its actor is killed."""
_KILL_TIMEOUT_S = 5.0
_MAX_LOOK_INTERVAL_S = 3600.0
_MAX_REASON_CHARS = 400


class _EngineActor:
    """The Ray actor of one engine: ``run`` starts the engine-core process on the actor's node
    and returns its exit status once it ends. The process ends when the actor dies."""

    def run(self, output_address: str, input_address: str, engine_keys: str) -> int:
        ended = threading.Event()
        status: list[int] = []

        def on_exit(exit_code: int) -> None:
            status.append(exit_code)
            ended.set()

        process = EngineProcess(
            output_address, input_address, on_exit, env={DIAL_KEYS_ENV: engine_keys}
        )
        ended.wait()
        process.close()
        return status[0]


@functools.cache
def _actor_class() -> Any:
    return ray.remote(_EngineActor)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    if len(text) > _MAX_REASON_CHARS:
        text = text[: _MAX_REASON_CHARS - 3] + "..."
    return f"{type(error).__name__}: {text}"


class RayEngineHandle(WatchedEngine):
    """One engine's actor and the thread that waits on its ``run`` ref (see the module's
    docstring): the :class:`~engine_core._engine.mp.launcher.EngineHandle` of a Ray engine."""

    pid: int | None = None
    """The engine runs on another machine: no local process id."""

    def __init__(
        self,
        actor: Any,
        run_ref: Any,
        sockets: DialSockets,
        on_exit: Callable[[int], None],
        look: Callable[[], float | None],
    ) -> None:
        self._actor = actor
        self._ref = run_ref
        self._sockets = sockets
        self._ended = threading.Event()
        self._watch = threading.Thread(
            target=self._watch_run, args=(on_exit, look), name="EngineCore-ray-watch", daemon=True
        )
        self._watch.start()

    def _watch_run(self, on_exit: Callable[[int], None], look: Callable[[], float | None]) -> None:
        while True:
            timeout = look()
            if timeout is not None:
                timeout = min(max(timeout, 0.0), _MAX_LOOK_INTERVAL_S)
            ready, _ = ray.wait([self._ref], timeout=timeout)
            if ready:
                break
        try:
            exit_code = int(ray.get(self._ref))
        except ray.exceptions.RayActorError as exc:  # the node was lost, the actor killed
            exit_code = self._died(f"its Ray actor died: {_one_line(exc)}", exc)
        except Exception as exc:  # run() raised: the engine process could not start
            exit_code = self._died(f"its Ray actor failed: {_one_line(exc)}", exc)
        self._ended.set()
        on_exit(exit_code)

    def _died(self, reason: str, error: BaseException) -> int:
        """Post the death notice the engine could not send; the exit status to report."""
        logger.error("the engine core is dead: %s", reason)
        with contextlib.suppress(zmq.ZMQError):
            self._sockets.post_to_self(
                msgspec.msgpack.encode(EngineDead(reason=reason, error_type=type(error).__name__))
            )
        return -signal.SIGKILL  # Ray kills a dead actor's worker; its engine follows

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            ray.kill(self._actor, no_restart=True)

    def _escalation(self) -> tuple[tuple[float, Callable[[], None]], ...]:
        return ((_SHUTDOWN_TIMEOUT_S, self._terminate), (_KILL_TIMEOUT_S, lambda: None))

    def _terminate(self) -> None:
        logger.warning("the engine core did not shut down in time: killing its Ray actor")
        self.kill()

    def exited(self, timeout: float | None) -> bool:
        return self._ended.wait(timeout)

    async def exited_async(self, timeout: float | None) -> bool:
        return await anyio.to_thread.run_sync(self._ended.wait, timeout, abandon_on_cancel=True)

    def close(self) -> None:
        """Kill the actor (its ``run`` may have returned: the actor still holds its bundle) and
        wait for the watch."""
        self.kill()
        self._watch.join()


class RayLauncher:
    """The launcher of one engine in its placement group (see the module's docstring)."""

    def __init__(self, deployment: RayDeployment, group: PlacementGroup) -> None:
        self._deployment = deployment
        self._group = group
        self._sockets: DialSockets | None = None

    def open_sockets(self) -> DialSockets:
        self._sockets = DialSockets(self._deployment.host, self._deployment.keys)
        return self._sockets

    def start(
        self, on_exit: Callable[[int], None], look: Callable[[], float | None]
    ) -> RayEngineHandle:
        sockets = self._sockets
        assert sockets is not None, "open_sockets() first"
        bundle = self._deployment.bundle
        actor = (
            _actor_class()
            .options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=0
                ),
            )
            .remote()
        )
        engine_keys = msgspec.json.encode(self._deployment.keys.for_engine()).decode()
        run_ref = actor.run.remote(sockets.output_endpoint, sockets.input_endpoint, engine_keys)
        return RayEngineHandle(actor, run_ref, sockets, on_exit, look)


class RayDeployment:
    """The Ray side of one data-parallel deployment: the cluster connection, the keys and one
    placement group per engine. :meth:`place` the engines, take each one's :meth:`launcher`;
    :meth:`replace` moves a dead engine into a new group; :meth:`close` removes the groups (and
    stops Ray when it started it)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            ray.init(address=config.ray_address)
        self.keys = deployment_keys()
        self.host = config.ray_driver_host or ray.util.get_node_ip_address()
        self.bundle = engine_bundle(config.gpus_per_engine)
        self._groups: dict[int, PlacementGroup] = {}
        self._nodes: dict[int, str] = {}
        self._lock = threading.Lock()

    def place(self, ranks: Iterable[int]) -> None:
        """Give each engine of ``ranks`` its placement group, one after the other (where each
        goes depends on where the others went), all within ``placement_timeout_s``."""
        deadline = time.monotonic() + self.config.placement_timeout_s
        for rank in ranks:
            self._place(rank, deadline)

    def _place(self, rank: int, deadline: float) -> None:
        with self._lock:
            nodes = [
                NodeView(node["NodeID"], node["Resources"]) for node in ray.nodes() if node["Alive"]
            ]
            engines_on = collections.Counter(
                node for other, node in self._nodes.items() if other != rank
            )
            selector = label_selector(
                self.config.ray_placement_strategy, self.bundle, nodes, engines_on
            )
            group = placement_group(
                [self.bundle],
                strategy="STRICT_PACK",
                name=f"engine-core-{rank}-{uuid.uuid4().hex[:8]}",
                bundle_label_selector=[selector] if selector else None,
            )
            self._groups[rank] = group
            self._nodes.pop(rank, None)
        ready, _ = ray.wait([group.ready()], timeout=max(deadline - time.monotonic(), 0.0))
        if not ready:
            raise PlacementError(self._placement_error(rank, len(nodes)))
        try:
            ray.get(ready[0])
            node = placement_group_table(group)["bundles_to_node_id"][0]
        except Exception as exc:  # removed meanwhile (the deployment closed)
            raise PlacementError(f"the placement group of engine {rank} is gone: {exc}") from exc
        with self._lock:
            self._nodes[rank] = node
        logger.info("data-parallel engine %d placed on Ray node %s", rank, node)

    def _placement_error(self, rank: int, num_nodes: int) -> str:
        def plain(resources: dict[str, float]) -> dict[str, float]:
            return {k: v for k, v in resources.items() if "_group_" not in k}

        return placement_error_message(
            rank=rank,
            num_engines=self.config.data_parallel_size,
            bundle=self.bundle,
            strategy=self.config.ray_placement_strategy,
            timeout_s=self.config.placement_timeout_s,
            num_nodes=num_nodes,
            total=plain(ray.cluster_resources()),
            available=plain(ray.available_resources()),
            engines_placed=len(self._nodes),
        )

    def launcher(self, rank: int) -> RayLauncher:
        return RayLauncher(self, self._groups[rank])

    def replace(self, rank: int) -> RayLauncher:
        """A new placement group for engine ``rank`` (its old one removed), and its launcher."""
        with self._lock:
            old = self._groups.pop(rank, None)
        if old is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(old)
        self._place(rank, time.monotonic() + self.config.placement_timeout_s)
        return self.launcher(rank)

    def node_of(self, rank: int) -> str | None:
        """The Ray node id holding engine ``rank``'s placement group."""
        return self._nodes.get(rank)

    def close(self) -> None:
        """Remove the placement groups; stop Ray if this deployment started it."""
        with self._lock:
            groups = list(self._groups.values())
            self._groups.clear()
        for group in groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        if self._own_ray:
            ray.shutdown()
