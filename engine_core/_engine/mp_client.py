"""``MPClient``: the engine core in its own process, reached over ZMQ.

Construction spawns the engine-core process (``multiprocessing`` spawn method) and waits for its
``Ready`` message; :meth:`MPClient.start_async` does the same without blocking an event loop.
Then requests and control calls go down the input socket and per-step outputs, call replies and
finally a death notice come up the output socket (see ``_messages``).

Reading. There is no reader task: whoever needs a message reads it. ``get_output[_async]`` reads
until a step's outputs arrive; ``call_utility[_async]`` reads until its reply arrives; anything
else read meanwhile is kept for its owner. In an event loop one task reads at a time and the
others wait for it (so ``AsyncLLM``'s output handler, looping on :meth:`get_output_async`,
also delivers the replies its control calls wait for). Sync and async reads must not be mixed
across threads: a client belongs to one thread.

Liveness. A thread watches the process sentinel. When the process ends it records the exit code
(from then on every call raises :class:`EngineDeadError`) and sends a death notice into the
client's own output socket, which wakes whoever is reading. A process that dies of an error first
sends its own notice with the exception, which becomes the error's cause. Hung steps are caught
in the engine (``step_timeout_s``), which then dies the same way. ``AsyncLLM`` therefore needs
no separate watch task: its output handler's :meth:`get_output_async` raises
:class:`EngineDeadError` within the grace period (0.1 s) of a death.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import zmq

from engine_core._core.protocol import EngineCoreOutputs, EngineCoreRequest, EngineInfo, EngineStats
from engine_core._engine.client import UTILITY_METHODS, EngineCoreClient
from engine_core._engine.core import PauseMode
from engine_core._engine.death import (
    REMOTE_ERRORS,
    RemoteEngineError,
    dead_error,
    describe_exit,
    startup_error,
)
from engine_core._engine.main import run_engine_core
from engine_core._engine.sockets import SocketAddresses, Transport, make_socket, recv_async
from engine_core._engine.wire import (
    AbortRequests,
    ClientMessage,
    EngineDead,
    Ready,
    Shutdown,
    UtilityCall,
    UtilityReply,
    decode,
    engine_message_decoder,
)
from engine_core.config import EngineConfig
from engine_core.errors import EngineClosedError, EngineError

__all__ = ["MPClient", "RemoteEngineError"]

logger = logging.getLogger(__name__)

_DEATH_NOTICE_GRACE_S = 0.1
"""After the process ends, how long the watch lets a reader take the engine's own death notice
(which carries the root cause) before declaring the death itself."""
_SHUTDOWN_TIMEOUT_S = 5.0
_TERMINATE_TIMEOUT_S = 2.0
_STARTUP_EXIT_TIMEOUT_S = 5.0
_RESULT_TYPES: dict[str, type[Any]] = {"get_stats": EngineStats}


class MPClient(EngineCoreClient):
    """Runs the engine core in a child process; same interface as ``InprocClient``.

    ``MPClient(config)`` starts the process and blocks until it is ready (or raises: the error
    names the backend's exception and the exit status; ``TimeoutError`` after
    ``config.startup_timeout_s``). Sockets are ``ipc://`` paths in a private directory, or with
    ``transport="tcp"`` ports on ``host``. Use it as a (async) context manager, or call
    :meth:`shutdown` / :meth:`shutdown_async`: in-flight requests then end with finish_reason
    "abort" and the process exits.
    """

    info: EngineInfo

    def __init__(
        self, config: EngineConfig, *, transport: Transport = "ipc", host: str = "127.0.0.1"
    ) -> None:
        self._launch(config, transport, host)
        try:
            self._read_until_sync(self._is_ready, config.startup_timeout_s)
            if self._ready is None and self._engine_gone:
                self._monitor.join(_STARTUP_EXIT_TIMEOUT_S)  # for the exit status
            self._finish_startup()
        except BaseException:
            self._discard()
            raise

    @classmethod
    async def start_async(
        cls, config: EngineConfig, *, transport: Transport = "ipc", host: str = "127.0.0.1"
    ) -> MPClient:
        """Like ``MPClient(config)``, waiting for the engine without blocking the event loop."""
        client = cls.__new__(cls)
        client._launch(config, transport, host)
        try:
            with anyio.move_on_after(config.startup_timeout_s):
                await client._read_until(client._is_ready)
            if client._ready is None and client._engine_gone:
                await anyio.to_thread.run_sync(client._monitor.join, _STARTUP_EXIT_TIMEOUT_S)
            client._finish_startup()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(client._discard)
            raise
        return client

    # -- startup --------------------------------------------------------------------------------

    def _launch(self, config: EngineConfig, transport: Transport, host: str) -> None:
        self.config = config
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = engine_message_decoder()
        self._ready: Ready | None = None
        self._outputs: deque[EngineCoreOutputs] = deque()
        self._replies: dict[int, UtilityReply | None] = {}
        self._call_ids = itertools.count(1)
        self._reading = False
        self._read_waiters: list[anyio.Event] = []
        self._notice: EngineDead | None = None
        self._notice_seen = threading.Event()
        self._exit_code: int | None = None
        self._process_ended = False
        self._closing = False
        self._closed = False
        self._addresses = SocketAddresses(transport, host)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._output = make_socket(self._ctx, zmq.PULL)
        self._input = make_socket(self._ctx, zmq.PUSH)  # connected once the engine is ready
        try:
            self._output.bind(self._addresses.output)
            output_endpoint = self._output.getsockopt_string(zmq.LAST_ENDPOINT)
            self._output.bind(self._addresses.wake)
            self._process = multiprocessing.get_context("spawn").Process(
                target=run_engine_core,
                args=(msgspec.msgpack.encode(config), output_endpoint, self._addresses.input),
                name="EngineCore",
                daemon=True,  # terminated (SIGTERM: a clean shutdown) if the interpreter exits
            )
            self._process.start()
        except BaseException:
            self._input.close()
            self._output.close()
            self._ctx.term()
            self._addresses.remove()
            raise
        self._monitor = threading.Thread(
            target=self._watch_process, name="EngineCore-watch", daemon=True
        )
        self._monitor.start()

    def _is_ready(self) -> bool:
        return self._ready is not None

    def _finish_startup(self) -> None:
        if self._ready is None:
            if not self._engine_gone:
                raise TimeoutError(
                    "the engine core did not start within startup_timeout_s "
                    f"({self.config.startup_timeout_s} s)"
                )
            raise self._startup_error()
        self.info = self._ready.info
        self._input.connect(self._ready.input_address)

    def _startup_error(self) -> Exception:
        return startup_error(self._notice, self._exit_code)

    # -- state ----------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The engine-core process id."""
        return self._process.pid

    @property
    def _engine_gone(self) -> bool:
        return self._notice is not None or self._process_ended

    @property
    def is_dead(self) -> bool:
        """Whether the engine core stopped on its own (not through :meth:`shutdown`)."""
        return self._engine_gone and not self._closing

    def _error(self) -> EngineError:
        if self._closing:
            return EngineClosedError("the engine was shut down")
        return dead_error(self._notice, self._exit_code)

    def _check_usable(self) -> None:
        if self._closing or self._engine_gone:
            raise self._error()

    # -- sending --------------------------------------------------------------------------------

    def _send(self, message: ClientMessage) -> None:
        # The input socket connects with an unbounded queue: sending never blocks.
        self._input.send(self._encoder.encode(message), zmq.NOBLOCK)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send ``request`` to the engine core. Raises :class:`EngineDeadError` once it died."""
        self._check_usable()
        self._send(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests (no output follows for them); a no-op once the engine is gone."""
        request_ids = list(request_ids)
        if request_ids and not (self._closing or self._engine_gone):
            self._send(AbortRequests(request_ids))

    def send_raw(self, frame: bytes) -> None:
        """Send ``frame`` as it is to the engine's input socket (for tests of its decoding)."""
        self._check_usable()
        self._input.send(frame, zmq.NOBLOCK)

    # -- receiving ------------------------------------------------------------------------------

    def _dispatch(self, frame: bytes) -> None:
        message = decode(self._decoder, frame)
        match message:
            case EngineCoreOutputs():
                self._outputs.append(message)
            case UtilityReply(call_id=call_id):
                if call_id in self._replies:
                    self._replies[call_id] = message
                elif message.error is not None:  # its caller stopped waiting
                    logger.warning("utility call %d failed: %s", call_id, message.error)
            case Ready():
                self._ready = message
            case EngineDead(exit_code=None):
                if self._notice is None:
                    self._notice = message
                self._notice_seen.set()
            case EngineDead():
                # From the process watch: what the engine sent before it ended comes first.
                while True:
                    try:
                        frame = self._output.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._dispatch(frame)

    def _read_until_sync(self, done: Callable[[], bool], timeout: float | None = None) -> None:
        if self._reading:
            raise RuntimeError("a task of an event loop is reading; use the *_async methods")
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = self._output
        while not done() and not self._engine_gone:
            timeout_ms = None
            if deadline is not None:
                timeout_ms = int((deadline - time.monotonic()) * 1000)
                if timeout_ms <= 0:
                    return
            if sock.poll(timeout_ms, zmq.POLLIN):
                self._dispatch(sock.recv(zmq.NOBLOCK))

    async def _read_until(self, done: Callable[[], bool]) -> None:
        while not done() and not self._engine_gone:
            if self._reading:  # another task reads: wait for it to take one message
                event = anyio.Event()
                self._read_waiters.append(event)
                await event.wait()
                continue
            self._reading = True
            try:
                self._dispatch(await recv_async(self._output))
            finally:
                self._reading = False
                if self._read_waiters:
                    waiters, self._read_waiters = self._read_waiters, []
                    for event in waiters:
                        event.set()

    def _has_output(self) -> bool:
        return bool(self._outputs)

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs, blocking until they arrive. Raises
        :class:`EngineDeadError` once the engine died (after the outputs it sent before)."""
        if not self._outputs:
            if self._closed:
                raise self._error()
            self._read_until_sync(self._has_output)
        if self._outputs:
            return self._outputs.popleft()
        raise self._error()

    async def get_output_async(self) -> EngineCoreOutputs:
        """Like :meth:`get_output`, waiting in the event loop. Returns without yielding when an
        output is already there, so a loop around it should checkpoint."""
        if not self._outputs:
            if self._closed:
                raise self._error()
            await self._read_until(self._has_output)
        if self._outputs:
            return self._outputs.popleft()
        raise self._error()

    # -- control calls --------------------------------------------------------------------------

    def _start_call(self, method: str, args: tuple[Any, ...]) -> int:
        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}")
        if method == "pause_generation" and args:
            PauseMode.parse(args[0])  # refused here, before it reaches the engine
        self._check_usable()
        call_id = next(self._call_ids)
        self._replies[call_id] = None
        self._send(UtilityCall(call_id, method, list(args)))
        return call_id

    def _finish_call(self, method: str, call_id: int) -> Any:
        reply = self._replies.pop(call_id)
        if reply is None:
            raise self._error()
        if reply.error is not None:
            error_type = reply.error_type or "Exception"
            if error_type in REMOTE_ERRORS:
                raise REMOTE_ERRORS[error_type](reply.error)
            raise EngineError(f"{method} failed in the engine core: {error_type}: {reply.error}")
        result_type = _RESULT_TYPES.get(method)
        return reply.result if result_type is None else msgspec.convert(reply.result, result_type)

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run a control call in the engine core and return its result. Calls run between two
        steps, so one waits for the step executing when it arrives."""
        call_id = self._start_call(method, args)
        try:
            self._read_until_sync(lambda: self._replies[call_id] is not None)
        except BaseException:
            self._replies.pop(call_id, None)
            raise
        return self._finish_call(method, call_id)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Like :meth:`call_utility`, waiting in the event loop."""
        call_id = self._start_call(method, args)
        try:
            await self._read_until(lambda: self._replies[call_id] is not None)
        except BaseException:
            self._replies.pop(call_id, None)
            raise
        return self._finish_call(method, call_id)

    # -- liveness -------------------------------------------------------------------------------

    def _watch_process(self) -> None:
        process = self._process
        multiprocessing.connection.wait([process.sentinel])
        process.join()  # this thread alone reaps the process
        if not self._closing:
            self._notice_seen.wait(_DEATH_NOTICE_GRACE_S)
        self._exit_code = process.exitcode
        self._process_ended = True
        if not self._closing and self._notice is None:
            logger.error("the engine-core process %s", describe_exit(self._exit_code))
        wake = make_socket(self._ctx, zmq.PUSH, linger_ms=1000)
        try:
            wake.connect(self._addresses.wake)
            wake.send(msgspec.msgpack.encode(EngineDead(exit_code=self._exit_code)))
        finally:
            wake.close()

    # -- shutdown -------------------------------------------------------------------------------

    def _exited(self, timeout: float | None) -> bool:
        return bool(multiprocessing.connection.wait([self._process.sentinel], timeout))

    async def _exited_async(self, timeout: float | None) -> bool:
        with anyio.move_on_after(timeout):
            await anyio.wait_readable(self._process.sentinel)
            return True
        return False

    def shutdown(self) -> None:
        """Abort in-flight requests (finish_reason "abort"), stop the process and release the
        sockets and their directory. Idempotent."""
        if self._closing:
            return
        self._closing = True
        try:
            if not self._engine_gone:
                self._send(Shutdown())
            if not self._exited(_SHUTDOWN_TIMEOUT_S):
                logger.warning("the engine core did not shut down in time: terminating it")
                self._process.terminate()
                if not self._exited(_TERMINATE_TIMEOUT_S):
                    self._process.kill()
        finally:
            self._discard()

    async def shutdown_async(self) -> None:
        """Like :meth:`shutdown`, without blocking the event loop. Tasks reading meanwhile get
        the final outputs, then :class:`EngineClosedError`."""
        if self._closing:
            return
        self._closing = True
        with anyio.CancelScope(shield=True):
            if not self._engine_gone:
                self._send(Shutdown())
            if not await self._exited_async(_SHUTDOWN_TIMEOUT_S):
                logger.warning("the engine core did not shut down in time: terminating it")
                self._process.terminate()
                if not await self._exited_async(_TERMINATE_TIMEOUT_S):
                    self._process.kill()
            await anyio.to_thread.run_sync(self._monitor.join)
            while self._reading:  # readers end on the watch's notice; let them finish
                event = anyio.Event()
                self._read_waiters.append(event)
                await event.wait()
            self._discard()

    def _discard(self) -> None:
        """Kill the process if it still runs and release everything (idempotent)."""
        self._closing = True
        if self._closed:
            return
        self._closed = True
        if not self._exited(0):
            self._process.kill()
        self._monitor.join()
        self._input.close()
        self._output.close()
        self._ctx.term()
        self._addresses.remove()
        self._process.close()

    def __enter__(self) -> MPClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> MPClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown_async()
