"""The engine-core process: one :class:`EngineCore` served over ZMQ by an anyio event loop.

:class:`EngineCoreProc` runs three tasks. The input task decodes what arrives and applies it at
once: new requests join the waiting queue, aborts end requests (or, while a step executes, are
deferred to just after it, before its outputs are applied, so an aborted request gets no more
tokens and its blocks are freed at once), control calls are queued for the stepping task. The
stepping task runs control calls and steps between each other, with the blocking model call in
a worker thread so input keeps flowing meanwhile; with nothing to do it sleeps until input
arrives. The output task encodes and sends. All three share the event loop's thread, so engine
state is only ever touched by one of them at a time and by no one while a step's model call
runs (it touches only the backend).

:func:`run_engine_core` is the process entry point: it connects the output socket, binds the
input socket, builds the engine core (backend, KV spec, block count, allocation) in a worker
thread, sends ``Ready`` and serves. It exits by itself when its parent dies, shuts down cleanly
on SIGTERM or a ``Shutdown`` message, and reports a fatal error as an ``EngineDead`` message
before exiting with status 1.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import traceback
from collections import deque

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec
import zmq
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine_core._client import UTILITY_METHODS
from engine_core._engine_core import EngineCore
from engine_core._messages import (
    AbortRequests,
    EngineDead,
    EngineMessage,
    Ready,
    Shutdown,
    UtilityCall,
    UtilityReply,
    client_message_decoder,
    decode,
)
from engine_core._protocol import EngineCoreOutputs, EngineCoreRequest, EngineInfo
from engine_core._zmq import make_socket, recv_async, send_async
from engine_core.abc import ModelRunnerOutput, SchedulerOutput
from engine_core.config import EngineConfig

__all__ = ["EngineCoreProc", "run_engine_core"]

logger = logging.getLogger(__name__)

_MAX_MESSAGES_PER_WAKE = 256
"""Input messages handled in one go before the other tasks get a turn."""
_BACKEND_CALLS = frozenset({"profile", "sleep", "wake_up"})
"""Control calls that reach the backend: they run in a worker thread, like a step."""
_OUTPUT_LINGER_MS = 2000
"""How long exiting waits for the last messages (the death notice) to leave."""
PARENT_GONE_EXIT_CODE = 3
"""Exit status of an engine-core process whose parent died."""


class _Doorbell:
    """A pipe that other threads ring without blocking and the event loop waits on (under
    asyncio and trio alike): how a finished grammar compilation wakes an idle engine."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()
        self._closed = False

    def ring(self) -> None:
        """Thread-safe; a full pipe means a wake-up is pending already."""
        with self._lock:  # so a ring never writes to a closed (maybe reused) descriptor
            if not self._closed:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._write_fd, b"\0")

    async def wait(self) -> None:
        """Until rung at least once since the last wait."""
        while True:
            try:
                if os.read(self._read_fd, 4096):
                    return
            except BlockingIOError:
                pass
            await anyio.wait_readable(self._read_fd)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._read_fd)
                os.close(self._write_fd)


class EngineCoreProc:
    """Serves one :class:`EngineCore` over an input (PULL) and an output (PUSH) socket.

    ``step_timeout_s``: a model call running longer than this fails :meth:`run` with
    ``TimeoutError`` (the thread is abandoned; the process must exit).
    """

    def __init__(
        self,
        core: EngineCore,
        input_socket: zmq.Socket[bytes],
        output_socket: zmq.Socket[bytes],
        *,
        step_timeout_s: float | None = None,
    ) -> None:
        self.core = core
        self._input = input_socket
        self._output = output_socket
        self._step_timeout_s = step_timeout_s
        self._decoder = client_message_decoder()
        self._encoder = msgspec.msgpack.Encoder()
        self._executing = False
        self._output_busy = False
        self._calls: deque[UtilityCall] = deque()
        self._waiting_pauses: list[int] = []
        self._wake = anyio.Event()
        self.stop_reason: str | None = None
        """Why the engine is shutting down (None while serving)."""

    def request_shutdown(self, reason: str) -> None:
        """End every in-flight request as aborted, report them and return from :meth:`run`
        (after the step now executing, if any). ``reason`` names who asked ("SIGTERM")."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self._wake.set()

    async def run(self) -> None:
        """Serve until a shutdown is requested (returns once everything is sent), or until a
        step fails or exceeds the step timeout (raises that error, in an exception group)."""
        send, receive = anyio.create_memory_object_stream[EngineMessage](math.inf)
        doorbell = _Doorbell()
        self.core.set_grammar_waker(doorbell.ring)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._output_loop, receive)
                with send:  # closing it lets the output task drain and end
                    async with anyio.create_task_group() as inner:
                        inner.start_soon(self._input_loop)
                        inner.start_soon(self._grammar_loop, doorbell)
                        await self._step_loop(send)
                        inner.cancel_scope.cancel()
        finally:
            self.core.set_grammar_waker(None)
            doorbell.close()

    # -- stepping -------------------------------------------------------------------------------

    async def _step_loop(self, out: MemoryObjectSendStream[EngineMessage]) -> None:
        core = self.core
        while True:
            if self._calls:
                await self._run_calls(out)
            if self.stop_reason is not None:
                core.abort_all()
                self._emit(out, core.finish_step(None, None))
                self._answer_pauses(out, drained=True)
                return
            if not core.has_work:
                self._answer_pauses(out)
                await self._wait_for_input()
                continue
            scheduler_output = core.schedule()
            runner_output = None
            if scheduler_output is not None:
                runner_output = await self._execute(scheduler_output)
            outputs = core.finish_step(scheduler_output, runner_output)
            produced = not outputs.is_empty
            if produced:
                self._send(out, outputs)
            self._answer_pauses(out)
            if scheduler_output is None and not produced:
                await self._wait_for_input()  # nothing can run until something arrives
            else:
                await anyio.lowlevel.checkpoint()  # let the output and input tasks run

    async def _wait_for_input(self) -> None:
        # No await between the caller's check and this wait, so no wake-up is lost. A request
        # waiting for its grammar ends at its deadline if no compilation wakes the loop first.
        self._wake = wake = anyio.Event()
        deadline = self.core.grammar_wait_s()
        if deadline is None:
            await wake.wait()
            return
        with anyio.move_on_after(deadline):
            await wake.wait()

    async def _grammar_loop(self, doorbell: _Doorbell) -> None:
        while True:
            await doorbell.wait()
            self._wake.set()

    async def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not self.core.backend.step_in_thread:
            return self.core.execute(scheduler_output)
        self._executing = True
        try:
            with anyio.move_on_after(self._step_timeout_s) as scope:
                return await anyio.to_thread.run_sync(
                    self.core.execute, scheduler_output, abandon_on_cancel=True
                )
        finally:
            self._executing = False
        assert scope.cancelled_caught
        raise TimeoutError(f"a step ran longer than step_timeout_s ({self._step_timeout_s} s)")

    def _send(self, out: MemoryObjectSendStream[EngineMessage], message: EngineMessage) -> None:
        """Send ``message`` right away when nothing is queued before it and the socket takes it;
        else queue it for the output task (which waits while the socket is full)."""
        if not self._output_busy and out.statistics().current_buffer_used == 0:
            try:
                self._output.send(self._encoder.encode(message), zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
        out.send_nowait(message)

    def _emit(self, out: MemoryObjectSendStream[EngineMessage], outputs: EngineCoreOutputs) -> None:
        if not outputs.is_empty:
            self._send(out, outputs)

    # -- control calls --------------------------------------------------------------------------

    async def _run_calls(self, out: MemoryObjectSendStream[EngineMessage]) -> None:
        while self._calls:
            call = self._calls.popleft()
            reply = await self._call(call)
            # Requests a call ended (pause "abort") are reported before its reply.
            self._emit(out, self.core.finish_step(None, None))
            if reply is not None:
                self._send(out, reply)

    async def _call(self, call: UtilityCall) -> UtilityReply | None:
        method, args = call.method, call.args
        try:
            if method not in UTILITY_METHODS:
                raise ValueError(f"unknown utility method {method!r}")
            if method == "check_health":
                result = None
            elif method in _BACKEND_CALLS:
                result = await anyio.to_thread.run_sync(lambda: getattr(self.core, method)(*args))
            else:
                result = getattr(self.core, method)(*args)
        except Exception as exc:
            return UtilityReply(call.call_id, error=str(exc), error_type=type(exc).__name__)
        if method == "pause_generation" and self.core.pause_mode == "wait":
            self._waiting_pauses.append(call.call_id)  # answered once in-flight requests end
            return None
        return UtilityReply(call.call_id, result=result)

    def _answer_pauses(
        self, out: MemoryObjectSendStream[EngineMessage], *, drained: bool = False
    ) -> None:
        """Answer pause("wait") calls once nothing is in flight, or once the mode changed."""
        if not self._waiting_pauses:
            return
        core = self.core
        if drained or core.pause_mode != "wait" or not core.scheduler.has_unfinished_requests():
            for call_id in self._waiting_pauses:
                self._send(out, UtilityReply(call_id))
            self._waiting_pauses = []

    # -- input and output -----------------------------------------------------------------------

    async def _input_loop(self) -> None:
        sock = self._input
        handle = self._handle
        while True:
            frame = await recv_async(sock)
            num_handled = 0
            while True:
                handle(frame)
                num_handled += 1
                if num_handled == _MAX_MESSAGES_PER_WAKE:
                    break
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
            self._wake.set()
            # Let the step task act on what arrived before re-arming the wait on the socket:
            # the re-arm is then off the path from a request's arrival to its step.
            await anyio.lowlevel.checkpoint()

    def _handle(self, frame: bytes) -> None:
        message = decode(self._decoder, frame)
        core = self.core
        match message:
            case EngineCoreRequest():
                try:
                    core.add_request(message)
                except Exception:
                    logger.exception("dropped request %r", message.request_id)
            case AbortRequests(request_ids=request_ids):
                if self._executing:
                    for request_id in request_ids:
                        core.defer_abort(request_id)
                else:
                    core.abort_requests(request_ids)
            case UtilityCall():
                self._calls.append(message)
            case Shutdown():
                self.request_shutdown("the client")

    async def _output_loop(self, receive: MemoryObjectReceiveStream[EngineMessage]) -> None:
        encode = self._encoder.encode
        sock = self._output
        async with receive:
            async for message in receive:
                self._output_busy = True
                try:
                    await send_async(sock, encode(message))
                finally:
                    self._output_busy = False


# -- the process ------------------------------------------------------------------------------


def run_engine_core(config_msgpack: bytes, output_address: str, input_address: str) -> None:
    """Entry point of the engine-core process (a ``multiprocessing`` spawn target).

    ``config_msgpack`` is the msgpack-encoded :class:`EngineConfig`; the process connects its
    output socket to ``output_address`` and binds its input socket to ``input_address``.
    """
    # Ctrl-C reaches the whole process group; the parent decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.WARNING,
            format="%(asctime)s engine-core[%(process)d] %(levelname)s %(name)s: %(message)s",
        )
    exit_code = 1
    try:
        config = msgspec.msgpack.decode(config_msgpack, type=EngineConfig)
        server = _Server(config, output_address, input_address)
        exit_code = anyio.run(server.serve, backend=config.engine_runtime)
    except BaseException:
        logger.exception("the engine-core process failed")
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # Not sys.exit: a model thread abandoned by the step timeout would keep the process
        # alive at interpreter shutdown.
        os._exit(exit_code)


def _root_cause(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


class _Server:
    """Startup handshake, signals and the final notice around one :class:`EngineCoreProc`."""

    def __init__(self, config: EngineConfig, output_address: str, input_address: str) -> None:
        self.config = config
        self.output_address = output_address
        self.input_address = input_address
        self.encoder = msgspec.msgpack.Encoder()
        self.proc: EngineCoreProc | None = None
        self.stop_reason: str | None = None
        self.startup_scope: anyio.CancelScope | None = None

    async def serve(self) -> int:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        output = make_socket(ctx, zmq.PUSH, linger_ms=_OUTPUT_LINGER_MS)
        input_ = make_socket(ctx, zmq.PULL)
        try:
            output.connect(self.output_address)
            try:
                input_.bind(self.input_address)
            except zmq.ZMQError as exc:
                return self._die(output, exc)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._exit_when_parent_dies)
                tg.start_soon(self._watch_signals)
                exit_code = await self._serve(input_, output)
                tg.cancel_scope.cancel()
            return exit_code
        finally:
            input_.close()
            output.close()  # lingers until the last messages are out
            ctx.term()

    async def _serve(self, input_: zmq.Socket[bytes], output: zmq.Socket[bytes]) -> int:
        core: EngineCore | None = None
        with anyio.CancelScope() as self.startup_scope:
            try:
                core = await anyio.to_thread.run_sync(
                    EngineCore, self.config, abandon_on_cancel=True
                )
            except Exception as exc:
                return self._die(output, exc)
        self.startup_scope = None
        if core is None or self.stop_reason is not None:
            self._send(output, EngineDead(reason=f"stopped during startup by {self.stop_reason}"))
            return 0
        endpoint = input_.getsockopt_string(zmq.LAST_ENDPOINT)
        info = EngineInfo(
            num_kv_blocks=core.num_kv_blocks,
            block_size=core.config.block_size,
            max_model_len=core.max_model_len,
            vocab_size=core.vocab_size,
            backend=self.config.backend,
        )
        logger.info("ready: %s, input at %s", info, endpoint)
        self._send(output, Ready(info, endpoint))
        proc = self.proc = EngineCoreProc(
            core, input_, output, step_timeout_s=self.config.step_timeout_s
        )
        if self.stop_reason is not None:
            proc.request_shutdown(self.stop_reason)
        try:
            await proc.run()
        except Exception as exc:
            return self._die(output, exc)  # the backend may be mid-call: do not close it
        try:
            core.close()
        finally:
            self._send(output, EngineDead(reason=f"shut down by {proc.stop_reason}"))
        return 0

    def _send(self, output: zmq.Socket[bytes], message: EngineMessage) -> None:
        # The output socket connects, so its queue exists at once and sending never blocks.
        output.send(self.encoder.encode(message))

    def _die(self, output: zmq.Socket[bytes], exc: BaseException) -> int:
        root = _root_cause(exc)
        logger.error("fatal error", exc_info=root)
        self._send(
            output,
            EngineDead(
                reason=f"{type(root).__name__}: {root}",
                error_type=type(root).__name__,
                traceback="".join(traceback.format_exception(root)),
            ),
        )
        return 1

    async def _exit_when_parent_dies(self) -> None:
        """Exit as soon as the parent is gone (its end of a pipe closes), removing the private
        socket directory that the parent can no longer remove."""
        parent = multiprocessing.parent_process()
        if parent is None:
            return
        await anyio.wait_readable(parent.sentinel)
        logger.warning("the parent process is gone: exiting")
        if self.input_address.startswith("ipc://"):
            shutil.rmtree(os.path.dirname(self.input_address.removeprefix("ipc://")), True)
        logging.shutdown()
        os._exit(PARENT_GONE_EXIT_CODE)

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                logger.info("SIGTERM: shutting down")
                self.stop_reason = "SIGTERM"
                if self.proc is not None:
                    self.proc.request_shutdown("SIGTERM")
                elif self.startup_scope is not None:
                    self.startup_scope.cancel()
