"""``DPClient``: data parallelism, N engine-core processes behind one front end.

Each engine is an :class:`MPClient` of its own (its process, its private sockets, its liveness
watch), started with its ``data_parallel_rank``; the engines send their KV events and load with
every step's outputs, which feed the :class:`~engine_core._core.router.Router` that places each
new request. Aborts go to the request's engine; control calls fan out to every live engine at
once and their answers combine (``get_stats`` sums, ``is_paused`` and ``reset_prefix_cache`` are
true when true everywhere).

Reading. As with one engine, there is no reader task: :meth:`DPClient.get_output_async` takes the
next queued step outputs of any engine (in turn), else waits until one engine has some.

An engine's death is not the deployment's. Its requests move as ``dp_failover`` says: those
that had streamed nothing go to another engine (``"retry"``, ``"resume"``), started ones end with
a retryable error naming the engine, except that ``"resume"`` continues the greedy ones on
another engine from the tokens already streamed (the client sees one stream). Those endings
come back as ordinary outputs. :class:`EngineDeadError` is raised only once no engine is alive.
With ``dp_restart_engines`` a dead engine is restarted in a thread, with backoff, and rejoins;
while every engine is dead and one is restarting, the deployment waits instead of dying: the
requests that would move (and new ones) wait for the first engine back, each for at most
``dp_restart_wait_s`` (then it ends with a retryable error), and :class:`EngineDeadError` comes
only once no restart is left.

Where the engines run is the launchers' business (``launcher``): child processes of this one by
default; with ``data_parallel_backend="ray"`` a :class:`~engine_core._engine.ray.launch.
RayDeployment` places each engine on a Ray cluster first (a restart gets a new placement group).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import msgspec
import zmq

from engine_core._core.engine_io import (
    DPEngineCoreOutputs,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    FinishedRequest,
    check_utility_call,
)
from engine_core._core.router import Router
from engine_core._engine.client import EngineCoreClient
from engine_core._engine.dp.disagg import Disaggregation
from engine_core._engine.dp.failover import (
    Tracked,
    lost_request_ending,
    moved_request,
    restart_engine,
    restart_wait_ending,
)
from engine_core._engine.dp.stats import RouterMetrics, aggregate_stats
from engine_core._engine.mp.client import MPClient
from engine_core.config import EngineConfig
from engine_core.errors import EngineClosedError, EngineDeadError, EngineError

if TYPE_CHECKING:
    from engine_core._engine.mp.launcher import EngineLauncher
    from engine_core._engine.ray.launch import RayDeployment

__all__ = ["DPClient"]

logger = logging.getLogger(__name__)

_RESTART_POLL_S = 0.05
_RESTART_JOIN_S = 10.0
"""At shutdown, how long the restart threads have to finish an engine's start."""
"""While an engine restarts, how often a waiting reader looks whether it is back (the restart
thread cannot wake an event loop)."""


class DPClient(EngineCoreClient):
    """``config.data_parallel_size`` engine-core processes, one front end. Same interface as
    :class:`MPClient`."""

    info: EngineInfo

    def __init__(self, config: EngineConfig) -> None:
        self._setup(config)
        clients: list[MPClient] = []
        try:
            self._open_deployment()
            for rank in range(self.num_engines):
                clients.append(MPClient(self._engine_config(rank), launcher=self._launcher(rank)))
        except BaseException:
            for client in clients:
                client.shutdown()
            self._close_deployment()
            raise
        self._finish_setup(clients)

    @classmethod
    async def start_async(cls, config: EngineConfig) -> DPClient:
        """Like ``DPClient(config)``: the engines start at once, without blocking the loop."""
        client = cls.__new__(cls)
        client._setup(config)
        started: dict[int, MPClient] = {}
        errors: list[BaseException] = []

        async def start(rank: int) -> None:
            try:
                started[rank] = await MPClient.start_async(
                    client._engine_config(rank), launcher=client._launcher(rank)
                )
            except Exception as exc:
                errors.append(exc)

        try:
            await anyio.to_thread.run_sync(client._open_deployment)
            async with anyio.create_task_group() as tg:
                for rank in range(client.num_engines):
                    tg.start_soon(start, rank)
            if errors:
                raise errors[0]
        except BaseException:
            with anyio.CancelScope(shield=True):
                for engine in started.values():
                    await engine.shutdown_async()
                await anyio.to_thread.run_sync(client._close_deployment)
            raise
        client._finish_setup([started[r] for r in range(client.num_engines)])
        return client

    def _setup(self, config: EngineConfig) -> None:
        self.config = config
        self.num_engines = config.data_parallel_size
        self._closing = False
        self._turn = 0
        self._tracked: dict[str, Tracked] = {}
        self._ended: list[FinishedRequest] = []
        """Endings the client decided itself (failover), returned as the next outputs."""
        self._wakeup: anyio.Event | None = None
        self._rejoined: collections.deque[tuple[int, MPClient]] = collections.deque()
        self._restart_threads: list[threading.Thread] = []
        self._closed = threading.Event()
        """Set when the shutdown begins: wakes the restart threads from their backoff."""
        self._restarting: set[int] = set()
        """Engines whose restart thread still tries (it leaves once it rejoined or gave up)."""
        self._waiting: dict[str, Tracked] = {}
        """Requests waiting for an engine to come back, in arrival order."""
        self._last_death: EngineDeadError | None = None
        self.metrics = RouterMetrics(self.num_engines)
        self._keep_tokens = config.dp_failover == "resume"
        self._deployment: RayDeployment | None = None
        self._disagg = Disaggregation(config.roles) if config.disaggregated else None
        """Prefill/decode disaggregation (None: every engine takes whole requests)."""
        if self._disagg is not None:
            self.metrics.disagg = self._disagg.metrics

    def _open_deployment(self) -> None:
        """With the Ray backend: join the cluster and place every engine (blocking)."""
        if self.config.data_parallel_backend != "ray":
            return
        try:
            from engine_core._engine.ray.launch import RayDeployment
        except ModuleNotFoundError as exc:
            if exc.name != "ray":
                raise
            raise ModuleNotFoundError(
                "data_parallel_backend='ray' needs Ray: pip install 'engine-core[ray]'",
                name="ray",
            ) from exc

        deployment = RayDeployment(self.config)
        try:
            deployment.place(range(self.num_engines))
        except BaseException:
            deployment.close()
            raise
        self._deployment = deployment

    def _launcher(self, rank: int) -> EngineLauncher | None:
        """Where engine ``rank`` runs: None for a child process of this one."""
        return None if self._deployment is None else self._deployment.launcher(rank)

    def _close_deployment(self) -> None:
        if self._deployment is not None:
            self._deployment.close()
            self._deployment = None

    def _engine_config(self, rank: int) -> EngineConfig:
        return msgspec.structs.replace(self.config, data_parallel_rank=rank)

    def _finish_setup(self, clients: list[MPClient]) -> None:
        self._clients = clients
        self._alive = [True] * self.num_engines
        self.info = clients[0].info
        config = self.config
        self.router = Router(
            self.num_engines,
            block_size=self.info.block_size,
            policy=config.router_policy,
            balance_abs=config.balance_abs,
            balance_rel=config.router_balance_rel,
            caching=config.enable_prefix_caching,
        )

    # -- engines --------------------------------------------------------------------------------

    @property
    def engines_alive(self) -> list[int]:
        return [e for e in range(self.num_engines) if self._alive[e]]

    @property
    def pids(self) -> list[int | None]:
        """Each engine's process id (by rank)."""
        return [c.pid for c in self._clients]

    def engine_status(self) -> list[dict[str, Any]]:
        """Each engine's rank, liveness and pid (and Ray node, with the Ray backend)."""
        status: list[dict[str, Any]] = []
        for e in range(self.num_engines):
            entry: dict[str, Any] = {
                "rank": e,
                "alive": self._alive[e],
                "pid": self._clients[e].pid,
                "role": self.config.roles[e],
            }
            if self._deployment is not None:
                entry["node"] = self._deployment.node_of(e)
            status.append(entry)
        return status

    def _check_usable(self) -> None:
        if self._closing:
            raise EngineClosedError("the engine was shut down")
        if self._rejoined:
            self._take_rejoined()
        if not any(self._alive) and not self._recovering:
            raise self._all_dead()

    @property
    def _recovering(self) -> bool:
        """Whether a dead engine may still come back (a restart under way or done)."""
        return bool(self._restarting or self._rejoined)

    def _all_dead(self) -> EngineDeadError:
        if self._recovering:
            error = EngineDeadError(
                f"all {self.num_engines} engine cores are dead for now; "
                f"{len(self._restarting)} restarting"
            )
        else:
            error = EngineDeadError(f"all {self.num_engines} engine cores are dead")
        error.__cause__ = self._last_death
        return error

    def _engine_died(self, engine: int) -> None:
        """Take ``engine`` out and move its requests as ``dp_failover`` says."""
        if not self._alive[engine] or self._closing:
            return
        self._alive[engine] = False
        cause = self._clients[engine].error()
        if isinstance(cause, EngineDeadError):
            self._last_death = cause
        lost = self.router.remove_engine(engine)
        logger.error(
            "engine %d died (%s); %d request(s) were in flight there; %d engine(s) left",
            engine,
            cause,
            len(lost),
            sum(self._alive),
        )
        if self.config.dp_restart_engines:
            self._start_restart(engine)
        if not any(self._alive) and not self._recovering:
            # The deployment's death: every request in flight gets EngineDeadError.
            if self._wakeup is not None:
                self._wakeup.set()
            return
        mode = self.config.dp_failover
        for request_id in lost:
            if not any(self._alive) and not self._recovering:
                break  # a later death took the last engine: EngineDeadError for the rest
            tracked = self._tracked.get(request_id)
            if tracked is None or tracked.engine != engine:
                continue
            moved = moved_request(tracked, mode)
            if moved is not None:
                self._send(tracked, moved, "failover")
                continue
            del self._tracked[request_id]
            if self._disagg is not None:
                self._disagg.gone(request_id)
            self._ended.append(lost_request_ending(request_id, engine, cause))
        if self._wakeup is not None:
            self._wakeup.set()

    def _send(self, tracked: Tracked, request: EngineCoreRequest, reason: str | None) -> None:
        """Route ``request`` and send it to its engine (another one if that one died); while
        every engine is dead and one restarts, it waits for an engine to come back."""
        while True:
            if not any(self._alive):
                self._wait_for_engine(tracked, request, reason)
                return
            engines: list[int] | None = None
            least_loaded = False
            if self._disagg is not None:
                request, engines, least_loaded = self._disagg.plan(request, reason, self._alive)
            decision = self.router.route(
                request.request_id,
                request.prompt_token_ids,
                cache_salt=request.cache_salt,
                lora_key=(
                    b"" if request.lora_request is None else request.lora_request.key_bytes()
                ),
                rank=request.data_parallel_rank,
                engines=engines,
                least_loaded=least_loaded,
            )
            engine = decision.engine
            self.metrics.requests[engine, reason or decision.reason] += 1
            self.metrics.predicted_hit_tokens[engine] += decision.predicted_hit_tokens
            tracked.engine = engine
            tracked.request = request
            try:
                self._clients[engine].add_request(request)
                return
            except EngineDeadError:
                self._engine_died(engine)  # moves this request too, or ends it
                return

    # -- waiting for an engine to come back ----------------------------------------------------

    def _wait_for_engine(
        self, tracked: Tracked, request: EngineCoreRequest, reason: str | None
    ) -> None:
        """Keep ``request`` until an engine rejoins (or ``dp_restart_wait_s`` passed)."""
        if tracked.engine >= 0 or request.request_id not in self._waiting:
            tracked.waits_until = time.monotonic() + self.config.dp_restart_wait_s
        tracked.engine = -1
        tracked.request = request
        tracked.reason = reason
        self._waiting[request.request_id] = tracked

    def _send_waiting(self) -> None:
        """An engine is back: send the requests that waited for one, in their order."""
        waiting, self._waiting = self._waiting, {}
        for request_id, tracked in waiting.items():
            if self._tracked.get(request_id) is not tracked:
                continue  # aborted meanwhile
            try:
                self._send(tracked, tracked.request, tracked.reason)
            except ValueError as exc:  # pinned to an engine that is not back
                del self._tracked[request_id]
                if self._disagg is not None:
                    self._disagg.gone(request_id)
                self._ended.append(
                    FinishedRequest(request_id, "error", None, str(exc), retryable=True)
                )

    def _end_long_waits(self) -> None:
        """End the requests that waited ``dp_restart_wait_s`` for an engine, retryable."""
        now = time.monotonic()
        for request_id, tracked in list(self._waiting.items()):
            if tracked.waits_until > now:
                break  # the rest came later
            del self._waiting[request_id]
            if self._tracked.pop(request_id, None) is not None:
                if self._disagg is not None:
                    self._disagg.gone(request_id)
                self._ended.append(restart_wait_ending(request_id, self.config.dp_restart_wait_s))

    def _next_wait_s(self) -> float | None:
        """How long a reader may wait before it must look again (a restart to take in, a wait
        to end); None: no limit."""
        if not self._recovering:
            return None
        wait_s = _RESTART_POLL_S
        if self._waiting:
            first = next(iter(self._waiting.values()))
            wait_s = min(wait_s, max(first.waits_until - time.monotonic(), 0.0))
        return wait_s

    # -- restarts -------------------------------------------------------------------------------

    def _start_restart(self, engine: int) -> None:
        thread = threading.Thread(
            target=self._restart, args=(engine,), name=f"EngineCore-restart-{engine}", daemon=True
        )
        self._restart_threads.append(thread)
        self._restarting.add(engine)
        thread.start()

    def _restart(self, engine: int) -> None:
        try:
            self._restart_engine(engine)
        finally:
            self._restarting.discard(engine)  # after it rejoined: never both empty between

    def _restart_engine(self, engine: int) -> None:
        deployment = self._deployment  # the same one, even while shutting down

        def start() -> MPClient:
            launcher = None if deployment is None else deployment.replace(engine)
            return MPClient(self._engine_config(engine), launcher=launcher)

        client = restart_engine(engine, start, self._closed.is_set, sleep=self._closed.wait)
        if client is not None:
            self._rejoined.append((engine, client))

    def _take_rejoined(self) -> None:
        if not self._rejoined:
            return
        while self._rejoined:
            engine, client = self._rejoined.popleft()
            old = self._clients[engine]
            self._clients[engine] = client
            self._alive[engine] = True
            self.router.add_engine(engine)
            self.metrics.engine_restarts[engine] += 1
            logger.info("engine %d restarted and rejoined", engine)
            old.shutdown()
        if self._waiting:
            self._send_waiting()
        if self._wakeup is not None:  # a reader waiting for the others reads this one too
            self._wakeup.set()

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Route ``request`` to an engine and send it there. A pin to an engine that is not
        alive ends the request with a retryable error."""
        self._check_usable()
        tracked = Tracked(request, -1)
        self._tracked[request.request_id] = tracked
        try:
            self._send(tracked, request, None)
        except ValueError as exc:  # a pin to a dead or unknown engine
            del self._tracked[request.request_id]
            # A dead engine may come back (restarts), or the request may go elsewhere.
            rank = request.data_parallel_rank
            dead = rank is not None and 0 <= rank < self.num_engines and not self._alive[rank]
            self._ended.append(
                FinishedRequest(request.request_id, "error", None, str(exc), retryable=dead)
            )
            if self._wakeup is not None:
                self._wakeup.set()

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            tracked = self._tracked.pop(request_id, None)
            if self._disagg is not None:
                self._disagg.aborted(request_id)
            if tracked is None:
                continue
            if tracked.engine < 0:  # waiting for an engine: nowhere to abort
                self._waiting.pop(request_id, None)
                continue
            self.router.finished(request_id)
            by_engine.setdefault(tracked.engine, []).append(request_id)
        for engine, ids in by_engine.items():
            if self._alive[engine]:
                self._clients[engine].abort_requests(ids)

    # -- outputs --------------------------------------------------------------------------------

    def _next_output(self) -> EngineCoreOutputs | None:
        """The next outputs of any engine (in turn), or of the client's own failover; None
        when nothing is queued. Notices deaths on the way."""
        n = self.num_engines
        for i in range(n):
            engine = (self._turn + i) % n
            if not self._alive[engine]:
                continue
            client = self._clients[engine]
            if client.has_output:
                self._turn = engine + 1
                return self._observe(engine, client.take_output())
            if client.gone:
                if self._closing:
                    continue
                self._engine_died(engine)
        if self._waiting:
            self._end_long_waits()
        if self._ended:
            ended, self._ended = self._ended, []
            return EngineCoreOutputs(finished=ended)
        if self._closing:
            raise EngineClosedError("the engine was shut down")
        if not any(self._alive) and not self._recovering:
            raise self._all_dead()
        return None

    def _observe(self, engine: int, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Feed the router with what an engine's step outputs say."""
        router = self.router
        if isinstance(outputs, DPEngineCoreOutputs):
            if outputs.kv_events is not None:
                router.apply_events(engine, outputs.kv_events)
            if outputs.load is not None:
                router.update_load(engine, outputs.load)
        tracked = self._tracked
        cached = outputs.num_cached_tokens
        for request_id, tokens in zip(outputs.req_ids, outputs.new_token_ids, strict=True):
            entry = tracked.get(request_id)
            if entry is None:
                continue
            if request_id in cached:
                router.started(request_id)
                self.metrics.actual_hit_tokens[engine] += cached[request_id]
            entry.num_tokens += len(tokens)
            if self._keep_tokens:
                entry.tokens.extend(tokens)
            if self._disagg is not None:
                self._disagg.record_tokens(request_id, tokens)
        if self._disagg is not None and outputs.finished:
            outputs.finished = self._hand_off(engine, outputs.finished)
        for finished in outputs.finished:
            if tracked.pop(finished.req_id, None) is not None:
                router.finished(finished.req_id)
        return outputs

    def _hand_off(self, engine: int, finished: list[FinishedRequest]) -> list[FinishedRequest]:
        """Disaggregation: a prefill leg's ending becomes its decode leg, sent to a decode
        engine (the caller sees no ending); the other endings stand."""
        disagg = self._disagg
        assert disagg is not None
        kept: list[FinishedRequest] = []
        for ending in finished:
            tracked = self._tracked.get(ending.req_id)
            if tracked is not None and tracked.engine != engine:
                kept.append(ending)
                continue
            decode = disagg.on_finished(ending)
            if decode is None or tracked is None:
                kept.append(ending)
                continue
            self.router.finished(ending.req_id)
            try:
                self._send(tracked, decode, "handoff")
            except (ValueError, LookupError) as exc:
                del self._tracked[ending.req_id]
                disagg.gone(ending.req_id)
                kept.append(FinishedRequest(ending.req_id, "error", None, str(exc), retryable=True))
        return kept

    def get_output(self) -> EngineCoreOutputs:
        """The next outputs of any engine, blocking until there are some."""
        while True:
            self._take_rejoined()
            outputs = self._next_output()
            if outputs is not None:
                return outputs
            poller = zmq.Poller()
            for engine in self.engines_alive:
                poller.register(self._clients[engine].output_pollable, zmq.POLLIN)
            wait_s = self._next_wait_s()
            if wait_s is None:
                poller.poll()
            elif self.engines_alive:
                poller.poll(max(1, int(wait_s * 1000)))
            else:
                time.sleep(wait_s)
            for engine in self.engines_alive:
                self._clients[engine].read_pending()

    async def get_output_async(self) -> EngineCoreOutputs:
        """Like :meth:`get_output`, waiting in the event loop."""
        while True:
            self._take_rejoined()
            outputs = self._next_output()
            if outputs is not None:
                return outputs
            await self._wait_for_any()

    async def _wait_for_any(self) -> None:
        """Until an engine has outputs or is gone, or the client ended requests itself."""
        wait_s = self._next_wait_s()
        if self.num_engines == 1 and wait_s is None:  # nothing to fail over to or take in
            await self._clients[0].wait_for_output()
            return
        self._wakeup = wakeup = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:

                async def first(wait: Callable[[], Any]) -> None:
                    await wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(first, wakeup.wait)
                if wait_s is not None:  # a restart to take in, a wait to end
                    tg.start_soon(first, functools.partial(anyio.sleep, wait_s))
                for engine in self.engines_alive:
                    tg.start_soon(first, self._clients[engine].wait_for_output)
        finally:
            self._wakeup = None

    # -- control calls --------------------------------------------------------------------------

    def _combine(self, method: str, results: dict[int, Any]) -> Any:
        if method == "get_stats":
            return aggregate_stats(results, self.num_engines)
        if method in ("is_paused", "reset_prefix_cache"):
            return all(results.values())
        if method == "kv_cache_snapshot":
            return [results.get(e) for e in range(self.num_engines)]
        return None

    def _check_call(self, method: str, args: tuple[Any, ...]) -> None:
        check_utility_call(method, args)
        self._check_usable()

    def _gather(self, method: str, outcomes: dict[int, Any]) -> Any:
        """The combined result of a call, from each engine's result or error; engines that
        died meanwhile are left out (and failed over)."""
        results: dict[int, Any] = {}
        for engine, outcome in sorted(outcomes.items()):
            if isinstance(outcome, EngineDeadError):
                self._engine_died(engine)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                results[engine] = outcome
        if not results:
            if method == "get_stats" and self._recovering:  # an outage, seen as such
                return aggregate_stats({}, self.num_engines)
            raise self._all_dead()
        return self._combine(method, results)

    def call_utility(self, method: str, *args: Any) -> Any:
        self._check_call(method, args)
        outcomes: dict[int, Any] = {}
        for engine in self.engines_alive:
            try:
                outcomes[engine] = self._clients[engine].call_utility(method, *args)
            except EngineError as exc:
                outcomes[engine] = exc
        return self._gather(method, outcomes)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Run the call in every live engine at once and combine the answers."""
        self._check_call(method, args)
        outcomes: dict[int, Any] = {}

        async def call(engine: int) -> None:
            try:
                outcomes[engine] = await self._clients[engine].call_utility_async(method, *args)
            except Exception as exc:
                outcomes[engine] = exc

        async with anyio.create_task_group() as tg:
            for engine in self.engines_alive:
                tg.start_soon(call, engine)
        return self._gather(method, outcomes)

    # -- shutdown -------------------------------------------------------------------------------

    def _begin_shutdown(self) -> bool:
        if self._closing:
            return False
        self._closing = True
        self._closed.set()
        if self._wakeup is not None:
            self._wakeup.set()
        return True

    def shutdown(self) -> None:
        if not self._begin_shutdown():
            return
        for client in self._clients:
            client.shutdown()
        self._take_rejoined_for_shutdown()
        self._close_deployment()

    async def shutdown_async(self) -> None:
        if not self._begin_shutdown():
            return
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for client in self._clients:
                    tg.start_soon(client.shutdown_async)
            await anyio.to_thread.run_sync(self._take_rejoined_for_shutdown)
            await anyio.to_thread.run_sync(self._close_deployment)

    def _take_rejoined_for_shutdown(self) -> None:
        # A restart under way finishes its start, sees the shutdown and stops its engine (an
        # engine left starting would find its client gone).
        deadline = time.monotonic() + _RESTART_JOIN_S
        for thread in self._restart_threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        while self._rejoined:
            self._rejoined.popleft()[1].shutdown()

    def __enter__(self) -> DPClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> DPClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown_async()
