"""The engine-core process: one :class:`EngineCore` served over two pipes (see ``pipes``) by
an anyio event loop.

:class:`EngineCoreProc` runs three tasks. The input task decodes what arrives and applies it at
once: new requests join the waiting queue, aborts end requests (or, while a step executes, are
deferred to just after it, before its outputs are applied, so an aborted request gets no more
tokens and its blocks are freed at once), control calls are queued for the stepping task. The
stepping task runs control calls and steps between each other, with the blocking model call in
a worker thread so input keeps flowing meanwhile; with nothing to do it sleeps until input
arrives. The output task encodes and sends. All three share the event loop's thread, so engine
state is only ever touched by one of them at a time and by no one while a step's model call
runs (it touches only the backend). With a heartbeat interval, a fourth task sends a
:class:`~engine_core._engine.wire.Heartbeat` whenever the engine has work (requests, a step, a
control call) and sent nothing since its last look: a client waiting for the engine hears from
it at least every two intervals for as long as the event loop runs, however long a step takes
in its worker thread.

With async scheduling the stepping task keeps one step in flight: it schedules step n+1 while
step n runs, and in one worker-thread call launches step n+1 and waits for step n's results,
which it then applies and sends while step n+1 runs. Control calls and a shutdown first let the
steps in flight end (their outputs are sent), so they see the engine between steps as before.

The process around it (entry point, handshake, signals, parent watch) is in ``main``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import os
import threading
from collections import deque

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from engine_core._core.engine_io import (
    EngineCoreOutputs,
    EngineCoreRequest,
    PauseMode,
    check_utility_call,
)
from engine_core._engine.core import EngineCore, StepResults
from engine_core._engine.pipes.pipes import Receiver, Sender
from engine_core._engine.wire import (
    AbortRequests,
    EngineMessage,
    Heartbeat,
    RejectedRequest,
    Shutdown,
    UtilityCall,
    UtilityReply,
    client_message_decoder,
    decode_client_message,
)
from engine_core.abc import SchedulerOutput
from engine_core.lora import LoRAError

__all__ = ["EngineCoreProc"]

logger = logging.getLogger(__name__)

_MAX_MESSAGES_PER_WAKE = 256
"""Input messages handled in one go before the other tasks get a turn."""
_MAX_QUEUED_OUTPUTS = 4
"""Messages waiting for room in the output pipe (its buffers full: the client is not reading) at
which the engine stops stepping until the client catches up."""
_FINAL_DRAIN_S = 2.0
"""At shutdown, how long the last messages may wait for a client that stopped reading."""

_BACKEND_CALLS = frozenset({"profile", "sleep", "wake_up"})
"""Control calls that reach the backend: they run in a worker thread, like a step."""


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


def _error_reply(call_id: int, exc: BaseException) -> UtilityReply:
    """A call's error; a :class:`LoRAError` carries its adapter and reason as JSON, so the
    client raises the same error."""
    if isinstance(exc, LoRAError):
        detail = msgspec.json.encode({"lora_name": exc.lora_name, "reason": exc.reason}).decode()
        return UtilityReply(call_id, error=detail, error_type=type(exc).__name__)
    return UtilityReply(call_id, error=str(exc), error_type=type(exc).__name__)


class EngineCoreProc:
    """Serves one :class:`EngineCore` over an input and a (bounded) output pipe.

    ``step_timeout_s``: a model call running longer than this fails :meth:`run` with
    ``TimeoutError`` (the thread is abandoned; the process must exit). ``heartbeat_interval_s``:
    how often to look whether a heartbeat is due (None: never send one).
    """

    def __init__(
        self,
        core: EngineCore,
        input_pipe: Receiver,
        output_pipe: Sender,
        *,
        step_timeout_s: float | None = None,
        heartbeat_interval_s: float | None = None,
    ) -> None:
        self.core = core
        self._input = input_pipe
        self._output = output_pipe
        self._step_timeout_s = step_timeout_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._decoder = client_message_decoder()
        self._encoder = msgspec.msgpack.Encoder()
        self._executing = False
        self._in_call = False
        self._num_queued = 0
        """Messages handed to the output task and not yet sent (a message the task is sending
        included). Counted here: a message handed to a task already waiting on the stream never
        shows in its buffer, and a direct send while one is on its way would overtake it."""
        self._backlogged = False
        """The stepping task waits for the client to take queued outputs."""
        self._num_sent = 0
        """Messages sent or queued so far: the heartbeat task looks whether it moved."""
        self._calls: deque[UtilityCall] = deque()
        self._waiting_pauses: list[int] = []
        self._lora_calls: list[tuple[int, concurrent.futures.Future[None]]] = []
        """``add_lora`` calls answered once their adapter is loaded (steps go on meanwhile)."""
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
        send, receive = anyio.create_memory_object_stream[EngineMessage | None](math.inf)
        doorbell = _Doorbell()
        self.core.set_grammar_waker(doorbell.ring)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._output_loop, receive)
                with send:  # closing it lets the output task drain and end
                    async with anyio.create_task_group() as inner:
                        inner.start_soon(self._input_loop)
                        inner.start_soon(self._grammar_loop, doorbell)
                        if self._heartbeat_interval_s is not None:
                            inner.start_soon(self._heartbeat_loop, send, self._heartbeat_interval_s)
                        await self._step_loop(send)
                        inner.cancel_scope.cancel()
                # The last outputs go out unless the client stopped reading for good.
                tg.cancel_scope.deadline = anyio.current_time() + _FINAL_DRAIN_S
        finally:
            self.core.set_grammar_waker(None)
            doorbell.close()

    # -- stepping -------------------------------------------------------------------------------

    async def _step_loop(self, out: MemoryObjectSendStream[EngineMessage | None]) -> None:
        while await self._step_once(out):
            pass

    async def _step_once(self, out: MemoryObjectSendStream[EngineMessage | None]) -> bool:
        """One turn of the stepping task: control calls, then a step or a wait for input.
        False once a shutdown has been carried out."""
        core = self.core
        # 1. Control calls run between steps: the step below already sees what they changed
        #    (a pause, a reset prefix cache).
        if self._calls:
            await self._run_calls(out)
        if self._lora_calls:
            self._answer_lora_calls(out)
        # 2. A shutdown, after the calls that came before it: end every request, report them.
        if self.stop_reason is not None:
            await self._drain(out)
            core.abort_all()
            self._emit(out, core.outputs_between_steps())
            self._answer_pauses(out, drained=True)
            return False
        # 3. Nothing to run or report: a pause("wait") may be answerable; sleep until input.
        if not core.has_work:
            self._answer_pauses(out)
            await self._wait_for_input()
            return True
        # 4. Back-pressure: while the client has not taken what is queued, step no further
        #    (outputs would pile up in both processes); input is still handled meanwhile.
        if self._num_queued >= _MAX_QUEUED_OUTPUTS:
            await self._wait_for_output_room()
            return True
        # 5. The step: schedule here, launch it in the worker thread (only the model call
        #    leaves the event loop's thread), complete it here. With async scheduling the step
        #    completed is the one launched before (it ran while this one was scheduled).
        #    Aborts that arrived meanwhile are applied by complete_step before its outputs.
        scheduler_output = core.schedule()
        done = await self._launch(scheduler_output)
        outputs = core.complete_step(done)
        # 6. The outputs go out before the pause("wait") replies that their requests' ends allow.
        self._emit(out, outputs)
        self._answer_pauses(out)
        # 7. A step that neither ran nor reported anything waits for input (requests waiting
        #    for their grammar, say); else the input and output tasks get a turn.
        if scheduler_output is None and done is None and outputs.is_empty:
            await self._wait_for_input()
        else:
            await anyio.lowlevel.checkpoint()
        return True

    async def _drain(self, out: MemoryObjectSendStream[EngineMessage | None]) -> None:
        """Let the steps in flight end and send their outputs (async scheduling)."""
        core = self.core
        while core.num_in_flight:
            self._emit(out, core.complete_step(await self._launch(None)))

    async def _launch(self, scheduler_output: SchedulerOutput | None) -> StepResults | None:
        """``EngineCore.launch_step`` in the worker thread when the backend's step blocks (the
        one thread hop of a step), else here; none at all when there is nothing to launch or
        wait for. A step longer than ``step_timeout_s`` raises ``TimeoutError``."""
        core = self.core
        if scheduler_output is None and not core.num_in_flight:
            return None
        if not core.backend.step_in_thread:
            return core.launch_step(scheduler_output)
        self._executing = True
        try:
            with anyio.move_on_after(self._step_timeout_s) as scope:
                return await anyio.to_thread.run_sync(
                    core.launch_step, scheduler_output, abandon_on_cancel=True
                )
        finally:
            self._executing = False
        assert scope.cancelled_caught
        raise TimeoutError(f"a step ran longer than step_timeout_s ({self._step_timeout_s} s)")

    async def _wait_for_input(self) -> None:
        # No await between the caller's check and this wait, so no wake-up is lost. A request
        # waiting for its grammar ends at its deadline if no compilation wakes the loop first.
        self._wake = wake = anyio.Event()
        deadline = self.core.grammar_wait_s()
        stall = self.core.stall_wait_s()  # woken once at a stall's deadline, to log it
        if stall is not None and (deadline is None or stall < deadline):
            deadline = stall
        if deadline is None:
            await wake.wait()
            return
        with anyio.move_on_after(deadline):
            await wake.wait()

    async def _wait_for_output_room(self) -> None:
        """Until the output task has sent enough of the queue, or input arrived (a control
        call or a shutdown must not wait for a client that stopped reading)."""
        self._wake = wake = anyio.Event()
        self._backlogged = True
        try:
            await wake.wait()
        finally:
            self._backlogged = False

    async def _grammar_loop(self, doorbell: _Doorbell) -> None:
        while True:
            await doorbell.wait()
            self._wake.set()

    def _send(
        self, out: MemoryObjectSendStream[EngineMessage | None], message: EngineMessage
    ) -> None:
        """Send ``message`` right away when nothing is queued before it and the pipe takes it;
        else queue it for the output task (which waits while the pipe is full). A message the
        pipe took only in part queues None: the output task writes the rest."""
        self._num_sent += 1
        queued: EngineMessage | None = message
        if self._num_queued == 0:
            pipe = self._output
            if pipe.send_nowait(self._encoder.encode(message)):
                if not pipe.needs_flush:
                    return
                queued = None
        self._num_queued += 1
        out.send_nowait(queued)

    def _emit(
        self, out: MemoryObjectSendStream[EngineMessage | None], outputs: EngineCoreOutputs
    ) -> None:
        if not outputs.is_empty:
            self._send(out, outputs)

    # -- control calls --------------------------------------------------------------------------

    async def _run_calls(self, out: MemoryObjectSendStream[EngineMessage | None]) -> None:
        await self._drain(out)
        while self._calls:
            call = self._calls.popleft()
            self._in_call = True
            try:
                reply = await self._call(call)
            finally:
                self._in_call = False
            # Requests a call ended (pause "abort") are reported before its reply.
            self._emit(out, self.core.outputs_between_steps())
            if reply is not None:
                self._send(out, reply)

    async def _call(self, call: UtilityCall) -> UtilityReply | None:
        method, args = call.method, call.args
        try:
            check_utility_call(method, args)
            if method == "add_lora":
                # Loaded on the loader thread while steps go on; answered when it is done.
                self._lora_calls.append((call.call_id, self.core.add_lora_async(*args)))
                return None
            if method in _BACKEND_CALLS:
                result = await anyio.to_thread.run_sync(lambda: getattr(self.core, method)(*args))
            else:
                result = getattr(self.core, method)(*args)
        except Exception as exc:
            return _error_reply(call.call_id, exc)
        if method == "pause_generation" and self.core.pause_mode is PauseMode.WAIT:
            self._waiting_pauses.append(call.call_id)  # answered once in-flight requests end
            return None
        return UtilityReply(call.call_id, result=result)

    def _answer_lora_calls(self, out: MemoryObjectSendStream[EngineMessage | None]) -> None:
        """Answer the ``add_lora`` calls whose load ended."""
        self.core.poll_lora()
        pending = []
        for call_id, future in self._lora_calls:
            if not future.done():
                pending.append((call_id, future))
                continue
            error = future.exception()
            if error is None:
                self._send(out, UtilityReply(call_id, result=True))
            else:
                self._send(out, _error_reply(call_id, error))
        self._lora_calls = pending

    def _answer_pauses(
        self, out: MemoryObjectSendStream[EngineMessage | None], *, drained: bool = False
    ) -> None:
        """Answer pause("wait") calls once nothing is in flight, or once the mode changed."""
        if not self._waiting_pauses:
            return
        core = self.core
        if (
            drained
            or core.pause_mode is not PauseMode.WAIT
            or not core.scheduler.has_unfinished_requests()
        ):
            for call_id in self._waiting_pauses:
                self._send(out, UtilityReply(call_id))
            self._waiting_pauses = []

    # -- liveness -------------------------------------------------------------------------------

    def _has_work(self) -> bool:
        """Whether a client may be waiting for this engine: requests in flight (running,
        waiting, paused, or ended and not yet reported), a step or a control call running, calls
        queued, pause("wait") replies owed."""
        return (
            self._executing
            or self._in_call
            or bool(self._calls)
            or bool(self._waiting_pauses)
            or bool(self._lora_calls)
            or self.core.has_unfinished_requests()
        )

    async def _heartbeat_loop(
        self, out: MemoryObjectSendStream[EngineMessage | None], interval_s: float
    ) -> None:
        """Every ``interval_s``: a heartbeat when the engine has work and nothing was sent since
        the last look. A message at most every two intervals, and none while idle or busy
        sending anyway; one wake-up per interval costs nothing measurable."""
        num_sent = -1
        while True:
            await anyio.sleep(interval_s)
            if self._num_sent == num_sent and self._has_work():
                self._send(out, Heartbeat())
            num_sent = self._num_sent

    # -- input and output -----------------------------------------------------------------------

    async def _input_loop(self) -> None:
        pipe = self._input
        handle = self._handle
        while True:
            frame: bytes | None = await pipe.recv()
            num_handled = 0
            while frame is not None:
                handle(frame)
                num_handled += 1
                if num_handled == _MAX_MESSAGES_PER_WAKE:
                    break
                frame = pipe.recv_ready()  # the socket is asked again after the step's turn
            self._wake.set()
            # Let the step task act on what arrived before re-arming the wait on the socket:
            # the re-arm is then off the path from a request's arrival to its step.
            await anyio.lowlevel.checkpoint()

    def _handle(self, frame: bytes) -> None:
        message = decode_client_message(self._decoder, frame)
        core = self.core
        match message:
            case EngineCoreRequest():
                try:
                    core.add_request(message)
                except Exception as exc:
                    logger.exception("dropped request %r", message.request_id)
                    core.reject_request(message.request_id, f"{type(exc).__name__}: {exc}")
            case RejectedRequest(request_id=request_id, error=error):
                core.num_malformed_messages += 1
                core.reject_request(request_id, error)
            case None:
                core.num_malformed_messages += 1
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

    async def _output_loop(self, receive: MemoryObjectReceiveStream[EngineMessage | None]) -> None:
        encode = self._encoder.encode
        pipe = self._output
        async with receive:
            async for message in receive:
                if message is None:  # the rest of a message the pipe took in part
                    await pipe.flush()
                else:
                    await pipe.send(encode(message))
                self._num_queued -= 1
                if self._backlogged and self._num_queued < _MAX_QUEUED_OUTPUTS // 2:
                    self._wake.set()
