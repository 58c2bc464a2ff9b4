"""``MPClient``: the engine core in its own process, reached over two one-way pipes.

Construction launches the engine-core process through its launcher (``mp.launcher``: a child
process by default, a Ray actor with ``ray.launch``), answers its ``Hello`` with the
configuration (``Startup``) and waits for its ``Ready``;
:meth:`MPClient.start_async` does the same without blocking an event loop. Then requests and
control calls go down the input pipe; per-step outputs, call replies and finally a death notice
come up the output pipe (see ``wire``; the pipes are Unix stream sockets on one host, ZMQ over
tcp, see ``pipes``). Lifecycle, one table of allowed transitions (``_NEXT``): starting ->
ready -> closing -> closed; dead when the engine ends on its own (a dead client still closes);
a client that fails to start is closed from starting.

Reading. There is no reader task: whoever needs a message reads it (see ``inbox``).
``get_output[_async]`` reads until a step's outputs arrive, ``call_utility[_async]`` until its
reply arrives; so ``AsyncLLM``'s output handler, looping on :meth:`get_output_async`, also
delivers the replies its control calls wait for. A sync method and its async twin share all but
the send or the read.

Liveness. A thread watches the process. When the process ends it records the exit code (from then on
every call raises :class:`EngineDeadError`) and sends a death notice into the client's own output
pipe, which wakes whoever is reading. A process that dies of an error first sends its own notice
with the exception, which becomes the error's cause. Whatever the engine sent before it ended is
read before the end is (its last outputs, its notice), however far behind the reader is (see
``inbox``): a SIGTERM's final "abort" outputs reach their requests. Hung steps are caught in the
engine (``step_timeout_s``), which then dies the same way. A frozen process (stopped, deadlocked, a
step holding the GIL) cannot report anything: while requests are in flight or a call waits for its
reply, the engine sends something (outputs, else a heartbeat) at least every 2/5 of
``engine_heartbeat_timeout_s``, and the same watch thread keeps the clock (see ``inbox``). After a
silence that long the client declares the engine dead and SIGKILLs the process. ``AsyncLLM``
therefore needs no separate watch task: its output handler's :meth:`get_output_async` raises
:class:`EngineDeadError` within the grace period (0.1 s) of a death, and within
``engine_heartbeat_timeout_s`` of a freeze.
"""

from __future__ import annotations

import atexit
import enum
import functools
import itertools
import logging
import math
import threading
from collections.abc import Iterable
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import zmq

from engine_core._core.engine_io import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineStats,
    check_utility_call,
)
from engine_core._engine.client import EngineCoreClient
from engine_core._engine.mp.death import (
    RemoteEngineError,
    call_error,
    dead_error,
    describe_exit,
    startup_error,
)
from engine_core._engine.mp.inbox import EngineInbox
from engine_core._engine.mp.launcher import (
    EngineHandle,
    EngineLauncher,
    EngineSockets,
    LocalLauncher,
)
from engine_core._engine.pipes.addresses import TransportKind
from engine_core._engine.wire import (
    AbortRequests,
    ClientMessage,
    EngineDead,
    Hello,
    Shutdown,
    Startup,
    UtilityCall,
    UtilityReply,
)
from engine_core.config import EngineConfig
from engine_core.errors import EngineClosedError, EngineError

__all__ = ["MPClient", "RemoteEngineError"]

logger = logging.getLogger(__name__)

_DEATH_NOTICE_GRACE_S = 0.1
"""After the process ends, how long the watch lets a reader take the engine's own death notice
(which carries the root cause) before it moves the client to dead (new requests and calls are
refused from then on) and logs the exit. Reading is not cut short by it: the pipe is read to
its end first."""
_STARTUP_EXIT_TIMEOUT_S = 5.0
_RESULT_TYPES: dict[str, type[Any]] = {"get_stats": EngineStats}


class _State(enum.Enum):
    """Where a client is in its life."""

    STARTING = "starting"  # the process is launched; its Ready has not been read yet
    READY = "ready"
    CLOSING = "closing"  # a shutdown began; the engine's last outputs may still arrive
    CLOSED = "closed"  # the process and the sockets are released
    DEAD = "dead"  # the engine ended on its own


_NEXT: dict[_State, frozenset[_State]] = {
    _State.STARTING: frozenset({_State.READY, _State.DEAD, _State.CLOSED}),
    _State.READY: frozenset({_State.CLOSING, _State.DEAD}),
    _State.DEAD: frozenset({_State.CLOSING, _State.CLOSED}),
    _State.CLOSING: frozenset({_State.CLOSED}),
    _State.CLOSED: frozenset(),
}
"""The moves each state allows; any other is ignored (a death noticed while closing, say)."""


class MPClient(EngineCoreClient):
    """Runs the engine core in a child process; same interface as ``InprocClient``.

    ``MPClient(config)`` starts the process and blocks until it is ready (or raises: the error
    names the backend's exception and the exit status; ``TimeoutError`` after
    ``config.startup_timeout_s``). The pipes are Unix stream sockets at paths in a private directory
    (``transport="zmq-ipc"``: ZMQ ``ipc://`` sockets there), or with ``transport="tcp"`` ZMQ sockets
    on ports of ``host``. Use it as a (async) context manager, or call :meth:`shutdown` /
    :meth:`shutdown_async`: in-flight requests then end with finish_reason "abort" and the process
    exits.
    """

    info: EngineInfo

    def __init__(
        self,
        config: EngineConfig,
        *,
        transport: TransportKind = "ipc",
        host: str = "127.0.0.1",
        launcher: EngineLauncher | None = None,
    ) -> None:
        self._launch(config, launcher or LocalLauncher(transport, host))
        try:
            self._inbox.read_until_sync(self._got_ready, config.startup_timeout_s)
            if self._startup_failed():
                self._process.wait_watch(_STARTUP_EXIT_TIMEOUT_S)  # for the exit status
            self._finish_startup()
        except BaseException:
            self._discard()
            raise

    @classmethod
    async def start_async(
        cls,
        config: EngineConfig,
        *,
        transport: TransportKind = "ipc",
        host: str = "127.0.0.1",
        launcher: EngineLauncher | None = None,
    ) -> MPClient:
        """Like ``MPClient(config)``, waiting for the engine without blocking the event loop."""
        client = cls.__new__(cls)
        client._launch(config, launcher or LocalLauncher(transport, host))
        try:
            with anyio.move_on_after(config.startup_timeout_s):
                await client._inbox.read_until(client._got_ready)
            if client._startup_failed():
                await client._process.wait_watch_async(_STARTUP_EXIT_TIMEOUT_S)
            client._finish_startup()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(client._discard)
            raise
        return client

    # -- startup --------------------------------------------------------------------------------

    def _launch(self, config: EngineConfig, launcher: EngineLauncher) -> None:
        self.config = config
        self._state = _State.STARTING
        self._state_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._call_ids = itertools.count(1)
        self._exit_code: int | None = None
        """The process's exit status, from the watch (the inbox has it once it read the end)."""
        # All that the process watch uses exists before the process starts.
        self._sockets: EngineSockets = launcher.open_sockets()
        heartbeat_timeout_s = config.engine_heartbeat_timeout_s
        if heartbeat_timeout_s is not None and math.isinf(heartbeat_timeout_s):
            heartbeat_timeout_s = None
        self._inbox = EngineInbox(
            self._sockets.output,
            on_notice=self._on_notice,
            on_hello=self._on_hello,
            heartbeat_timeout_s=heartbeat_timeout_s,
            on_silence=self._on_silence,
            post=self._sockets.post_to_self,
        )
        try:
            self._process: EngineHandle = launcher.start(self._on_exit, self._inbox.look)
        except BaseException:
            self._sockets.close()
            raise
        # A client still open when the interpreter exits shuts its engine down (and removes
        # the socket directory) rather than leave the engine to find its parent gone.
        atexit.register(self.shutdown)

    def _on_hello(self, hello: Hello) -> None:
        """The process runs and listens: connect to it and send it the configuration."""
        self._sockets.connect_input(hello.input_address)
        self._send(Startup(self.config))

    def _got_ready(self) -> bool:
        return self._inbox.ready is not None

    def _startup_failed(self) -> bool:
        return self._inbox.ready is None and self._inbox.gone

    def _finish_startup(self) -> None:
        ready = self._inbox.ready
        if ready is None:
            if not self._inbox.gone:
                raise TimeoutError(
                    "the engine core did not start within startup_timeout_s "
                    f"({self.config.startup_timeout_s} s)"
                )
            exit_code = self._inbox.exit_code
            raise startup_error(
                self._inbox.notice, self._exit_code if exit_code is None else exit_code
            )
        self.info = ready.info
        if self._move(_State.READY):
            self._inbox.listening = True

    # -- state ----------------------------------------------------------------------------------

    def _move(self, to: _State) -> bool:
        """Move to ``to`` where the current state allows it; whether it moved. The process
        watch moves the client too (to dead), hence the lock."""
        with self._state_lock:
            if to not in _NEXT[self._state]:
                return False
            self._state = to
            return True

    @property
    def pid(self) -> int | None:
        """The engine-core process id."""
        return self._process.pid

    @property
    def _closing(self) -> bool:
        return self._state in (_State.CLOSING, _State.CLOSED)

    @property
    def is_dead(self) -> bool:
        """Whether the engine core stopped on its own (not through :meth:`shutdown`)."""
        return self._state is _State.DEAD

    def _error(self) -> EngineError:
        if self._closing:
            return EngineClosedError("the engine was shut down")
        exit_code = self._inbox.exit_code
        if exit_code is None:
            exit_code = self._exit_code  # ended, its last frames not read yet
        return dead_error(self._inbox.notice, exit_code, self._inbox.silent_s)

    def _check_usable(self) -> None:
        if self._state is not _State.READY:
            raise self._error()

    # -- sending --------------------------------------------------------------------------------

    def _send(self, message: ClientMessage | Startup) -> None:
        self._send_frame(self._encoder.encode(message))

    def _send_frame(self, frame: bytes) -> None:
        # The input pipe never blocks (unbounded); it exists from the engine's Hello on. A
        # remote engine dials a bound socket instead, which has no queue once its connection is
        # gone (its node lost): the message is dropped, and the engine's death comes from its
        # launcher's watch or, for requests waiting, from its silence.
        pipe = self._sockets.input
        assert pipe is not None
        if not pipe.send_nowait(frame):
            logger.warning("the engine core's connection is gone: a message was dropped")

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send ``request`` to the engine core. Raises :class:`EngineDeadError` once it died."""
        self._check_usable()
        self._send(request)
        # NOTE: tracking after the send is safe: outputs are routed on this thread only, later.
        self._inbox.track(request.request_id)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests (no output follows for them); a no-op once the engine is gone."""
        request_ids = list(request_ids)
        self._inbox.untrack(request_ids)
        if request_ids and self._state is _State.READY:
            self._send(AbortRequests(request_ids))

    def send_raw(self, frame: bytes) -> None:
        """Send ``frame`` as it is to the engine's input socket (for tests of its decoding)."""
        self._check_usable()
        self._send_frame(frame)

    # -- outputs --------------------------------------------------------------------------------

    def _must_read_output(self) -> bool:
        """Whether ``get_output`` has to read (none is queued); raises once the client closed."""
        if self._inbox.outputs:
            return False
        if self._state is _State.CLOSED:
            raise self._error()
        return True

    def _next_output(self) -> EngineCoreOutputs:
        """The oldest queued output, or the error that says why none will come."""
        if self._inbox.outputs:
            return self._inbox.outputs.popleft()
        raise self._error()

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs, blocking until they arrive. Raises
        :class:`EngineDeadError` once the engine died (after the outputs it sent before)."""
        if self._must_read_output():
            self._inbox.read_until_sync(self._inbox.has_output)
        return self._next_output()

    async def get_output_async(self) -> EngineCoreOutputs:
        """Like :meth:`get_output`, waiting in the event loop. Returns without yielding when an
        output is already there, so a loop around it should checkpoint."""
        if self._must_read_output():
            await self._inbox.read_until(self._inbox.has_output)
        return self._next_output()

    # -- for a client of several engines (data parallelism) -------------------------------------

    @property
    def has_output(self) -> bool:
        """Whether a step's outputs are queued (:meth:`take_output` returns them)."""
        return bool(self._inbox.outputs)

    def take_output(self) -> EngineCoreOutputs:
        return self._inbox.outputs.popleft()

    @property
    def gone(self) -> bool:
        """Whether no more output comes: the engine's end has been read (what it sent before,
        too), or the client closed."""
        return self._state is _State.CLOSED or self._inbox.gone

    def error(self) -> EngineError:
        """Why no more output comes (:class:`EngineDeadError` or :class:`EngineClosedError`)."""
        return self._error()

    async def wait_for_output(self) -> None:
        """Until outputs are queued or the engine is gone (cancellable)."""
        await self._inbox.read_until(self._inbox.has_output)

    @property
    def output_pollable(self) -> zmq.Socket[bytes] | int:
        """What ``zmq.Poller`` waits on before :meth:`read_pending`."""
        return self._sockets.output.pollable

    def read_pending(self) -> None:
        """Sort what the output socket holds now, without waiting."""
        self._inbox.read_pending_sync()

    # -- control calls --------------------------------------------------------------------------

    def _start_call(self, method: str, args: tuple[Any, ...]) -> int:
        """Check and send a control call; its id, whose reply the inbox keeps."""
        check_utility_call(method, args)  # refused here, before it reaches the engine
        self._check_usable()
        call_id = next(self._call_ids)
        self._inbox.expect_reply(call_id)
        self._send(UtilityCall(call_id, method, list(args)))
        return call_id

    def _result(self, method: str, reply: UtilityReply | None) -> Any:
        """The result a reply carries, or the error it (or its absence) stands for."""
        if reply is None:
            raise self._error()
        if reply.error is not None:
            raise call_error(method, reply.error_type, reply.error)
        result_type = _RESULT_TYPES.get(method)
        return reply.result if result_type is None else msgspec.convert(reply.result, result_type)

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run a control call in the engine core and return its result. Calls run between two
        steps, so one waits for the step executing when it arrives."""
        call_id = self._start_call(method, args)
        try:
            self._inbox.read_until_sync(functools.partial(self._inbox.has_reply, call_id))
        finally:
            reply = self._inbox.take_reply(call_id)
        return self._result(method, reply)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Like :meth:`call_utility`, waiting in the event loop."""
        call_id = self._start_call(method, args)
        try:
            await self._inbox.read_until(functools.partial(self._inbox.has_reply, call_id))
        finally:
            reply = self._inbox.take_reply(call_id)
        return self._result(method, reply)

    # -- liveness -------------------------------------------------------------------------------

    def _on_notice(self) -> None:
        self._move(_State.DEAD)

    def _on_silence(self, silent_s: float) -> None:
        """From the reader that found the engine silent for ``silent_s`` while waited for: the
        engine is dead, and its frozen process is killed so that it does not linger."""
        if not self._move(_State.DEAD):
            return
        logger.error(
            "the engine core sent nothing for %.1f s while requests or calls waited for it "
            "(engine_heartbeat_timeout_s %s s): killing its process %s",
            silent_s,
            self._inbox.heartbeat_timeout_s,
            self._process.pid,
        )
        self._process.kill()

    def _on_exit(self, exit_code: int) -> None:
        """From the process watch, once the process has ended: record its exit and wake whoever
        reads with a death notice of the client's own."""
        if not self._closing and self._inbox.silent_s is None:
            self._inbox.notice_seen.wait(_DEATH_NOTICE_GRACE_S)
        self._exit_code = exit_code
        if self._move(_State.DEAD) and self._inbox.notice is None:
            logger.error("the engine-core process %s", describe_exit(exit_code))
        self._sockets.post_to_self(msgspec.msgpack.encode(EngineDead(exit_code=exit_code)))

    # -- shutdown -------------------------------------------------------------------------------

    def _begin_shutdown(self) -> bool:
        """Start closing and ask a live engine to shut down; False when closing already."""
        if not self._move(_State.CLOSING):
            return False
        self._inbox.listening = False  # a shutdown has its own time limits
        if not self._inbox.gone:
            self._send(Shutdown())
        return True

    def shutdown(self) -> None:
        """Abort in-flight requests (finish_reason "abort"), stop the process and release the
        sockets and their directory. Idempotent."""
        if not self._begin_shutdown():
            return
        try:
            self._process.stop()
        finally:
            self._discard()

    async def shutdown_async(self) -> None:
        """Like :meth:`shutdown`, without blocking the event loop. Tasks reading meanwhile get
        the final outputs, then :class:`EngineClosedError`."""
        if not self._begin_shutdown():
            return
        with anyio.CancelScope(shield=True):
            await self._process.stop_async()
            await self._process.wait_watch_async()  # the readers end on the watch's notice
            await self._inbox.wait_for_readers()  # before the socket closes
            self._discard()

    def _discard(self) -> None:
        """Kill the process if it still runs and release everything (idempotent)."""
        if not self._move(_State.CLOSED):
            return
        atexit.unregister(self.shutdown)
        self._process.close()
        self._sockets.close()

    def __enter__(self) -> MPClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> MPClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown_async()
