"""``EngineCoreProc`` served in this process over Unix stream pipes (ZMQ in-process sockets
where a test says so; no spawn: fast and deterministic). The process entry point and the client
are tested in test_mp_client.py."""

from __future__ import annotations

import itertools
import logging
import random
import socket
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import pytest
from engine_core_mock import MockBackend

from engine_core._core.engine_io import EngineCoreOutputs, EngineCoreRequest, FinishedRequest
from engine_core._engine.core import EngineCore
from engine_core._engine.pipes.addresses import OUTPUT_HWM
from engine_core._engine.pipes.pipes import Pipes, Receiver, Sender
from engine_core._engine.pipes.unix import StreamSender
from engine_core._engine.proc import EngineCoreProc
from engine_core._engine.wire import (
    AbortRequests,
    ClientMessage,
    EngineMessage,
    Heartbeat,
    Shutdown,
    UtilityCall,
    UtilityReply,
    engine_message_decoder,
)
from engine_core.abc import SchedulerOutput
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

_TIMEOUT_S = 5.0


class GatedMock(MockBackend):
    """A mock whose steps wait for the test: ``step()`` lets one through, ``open()`` all."""

    supports_async_scheduling = False  # one step at a time: the gate is the whole step

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.step_in_thread = True  # its steps block on the test's gate
        self.started = threading.Semaphore(0)
        self._gate = threading.Semaphore(0)
        self._open = False

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.started.release()
        if not self._open and not self._gate.acquire(timeout=10):
            raise RuntimeError("the test never let this step through")
        super().execute_model(scheduler_output)

    async def wait_started(self) -> None:
        """Until a step is executing (blocked at the gate unless it is open)."""
        assert await anyio.to_thread.run_sync(self.started.acquire, True, _TIMEOUT_S)

    def step(self) -> None:
        self._gate.release()

    def open(self) -> None:
        self._open = True
        self._gate.release()


Row = tuple[list[str], list[list[int]], list[FinishedRequest]]


def rows(messages: list[EngineCoreOutputs]) -> list[Row]:
    return [(m.req_ids, m.new_token_ids, m.finished) for m in messages]


def request(request_id: str, prompt: list[int], max_tokens: int = 16) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)
    )


class Peer:
    """The client's side of the sockets, speaking the wire protocol by hand."""

    def __init__(self, proc: EngineCoreProc, to_engine: Sender, from_engine: Receiver) -> None:
        self.proc = proc
        self.core = proc.core
        self._to_engine = to_engine
        self._from_engine = from_engine
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoder = engine_message_decoder()
        self._call_ids = itertools.count(1)
        self.num_heartbeats = 0
        """Heartbeats that :meth:`recv` skipped."""

    def send(self, *messages: ClientMessage) -> None:
        for message in messages:
            self._to_engine.send_nowait(self._encode(message))

    def send_raw(self, frame: bytes) -> None:
        self._to_engine.send_nowait(frame)

    async def recv_any(self) -> EngineMessage:
        with anyio.fail_after(_TIMEOUT_S):
            return self._decoder.decode(await self._from_engine.recv())

    async def recv(self) -> EngineMessage:
        """The next message other than a heartbeat."""
        while isinstance(message := await self.recv_any(), Heartbeat):
            self.num_heartbeats += 1
        return message

    async def outputs(self, count: int) -> list[EngineCoreOutputs]:
        """The next ``count`` messages, which must all be step outputs."""
        received = [await self.recv() for _ in range(count)]
        assert all(isinstance(m, EngineCoreOutputs) for m in received), received
        return received  # type: ignore[return-value]

    async def outputs_until_finished(self, request_id: str) -> list[EngineCoreOutputs]:
        received: list[EngineCoreOutputs] = []
        while not any(f.req_id == request_id for m in received for f in m.finished):
            received.extend(await self.outputs(1))
        return received

    def start_call(self, method: str, *args: Any) -> int:
        call_id = next(self._call_ids)
        self.send(UtilityCall(call_id, method, list(args)))
        return call_id

    async def reply(self, call_id: int) -> tuple[list[EngineCoreOutputs], UtilityReply]:
        """Step outputs received before the reply to ``call_id``, and the reply."""
        before: list[EngineCoreOutputs] = []
        while True:
            message = await self.recv()
            if isinstance(message, UtilityReply):
                assert message.call_id == call_id
                return before, message
            assert isinstance(message, EngineCoreOutputs), message
            before.append(message)

    async def call(self, method: str, *args: Any) -> Any:
        """Run a call that must succeed with no step output before its reply."""
        before, reply = await self.reply(self.start_call(method, *args))
        assert before == []
        assert reply.error is None, reply.error
        return reply.result


@contextmanager
def wired(
    core: EngineCore,
    step_timeout_s: float | None = None,
    heartbeat_interval_s: float | None = None,
    pipes: str = "unix",
) -> Iterator[Peer]:
    """The engine's pipes and the peer's: Unix stream sockets in a temporary directory
    (``pipes="unix"``, as between processes) or ZMQ in-process sockets (``"zmq"``)."""
    opened = Pipes()
    with tempfile.TemporaryDirectory() as directory:
        if pipes == "unix":
            to_in, to_out = f"unix://{directory}/in", f"unix://{directory}/out"
        else:
            name = uuid.uuid4().hex
            to_in, to_out = f"inproc://{name}-in", f"inproc://{name}-out"
        try:
            engine_in = opened.receiver(to_in)
            from_engine = opened.receiver(to_out, hwm=OUTPUT_HWM)
            engine_out = opened.sender(to_out, hwm=OUTPUT_HWM)
            to_engine = opened.sender(to_in)
            proc = EngineCoreProc(
                core,
                engine_in,
                engine_out,
                step_timeout_s=step_timeout_s,
                heartbeat_interval_s=heartbeat_interval_s,
            )
            yield Peer(proc, to_engine, from_engine)
        finally:
            opened.close()


def make_core(backend_cls: type[MockBackend] = MockBackend, **options: Any) -> EngineCore:
    return EngineCore(EngineConfig(num_kv_blocks=64, **options), backend_cls=backend_cls)


@asynccontextmanager
async def serving(
    backend_cls: type[MockBackend] = MockBackend,
    heartbeat_interval_s: float | None = None,
    pipes: str = "unix",
    **options: Any,
) -> AsyncIterator[Peer]:
    core = make_core(backend_cls, **options)
    try:
        with wired(core, heartbeat_interval_s=heartbeat_interval_s, pipes=pipes) as peer:
            async with anyio.create_task_group() as tg:
                tg.start_soon(peer.proc.run)
                yield peer
                peer.send(Shutdown())
    finally:
        if isinstance(core.backend, GatedMock):
            core.backend.open()
        core.close()


async def test_streams_tokens_until_finished() -> None:
    async with serving() as peer:
        peer.send(request("r1", [1, 2, 3], max_tokens=3))
        assert rows(await peer.outputs(3)) == [
            (["r1"], [[4]], []),
            (["r1"], [[5]], []),
            (["r1"], [[6]], [FinishedRequest("r1", "length")]),
        ]
        stats = await peer.call("get_stats")
        assert (stats["num_running"], stats["num_free_kv_blocks"], stats["num_steps"]) == (0, 64, 3)


async def test_abort_during_a_step_applies_before_its_outputs() -> None:
    async with serving(GatedMock) as peer:
        backend = peer.core.backend
        assert isinstance(backend, GatedMock)
        deferred = anyio.Event()
        defer_abort = peer.core.defer_abort

        def record_deferred(request_id: str) -> None:
            defer_abort(request_id)
            deferred.set()

        peer.core.defer_abort = record_deferred  # type: ignore[method-assign]
        # Paused, both requests join the queue; resuming starts them in the same step.
        await peer.call("pause_generation", "keep")
        peer.send(request("r1", [1, 2, 3]), request("r2", [50, 51, 52]))
        await peer.call("resume_generation")
        await backend.wait_started()
        backend.step()
        assert rows(await peer.outputs(1)) == [(["r1", "r2"], [[4], [53]], [])]

        await backend.wait_started()
        peer.send(AbortRequests(["r1"]))
        with anyio.fail_after(_TIMEOUT_S):
            await deferred.wait()  # the engine holds the abort while the step runs
        backend.step()
        # r1 gets no token from the step it was aborted in, and no output reports the abort.
        assert rows(await peer.outputs(1)) == [(["r2"], [[54]], [])]

        await backend.wait_started()
        call_id = peer.start_call("get_stats")
        backend.step()
        before, reply = await peer.reply(call_id)
        assert rows(before) == [(["r2"], [[55]], [])]
        stats = reply.result
        # r1's block went back to the pool at once; r2's 6 tokens hold one block.
        assert (stats["num_running"], stats["num_free_kv_blocks"], stats["num_steps"]) == (1, 63, 3)
        backend.open()


async def test_pause_abort_ends_in_flight_requests_and_rejects_new_ones() -> None:
    async with serving(backend_options={"latency": {"step_s": 0.002}}) as peer:
        peer.send(request("r1", [1, 2, 3], max_tokens=1000))
        await peer.outputs(1)
        before, reply = await peer.reply(peer.start_call("pause_generation", "abort"))
        assert reply.error is None
        assert before[-1].finished == [FinishedRequest("r1", "abort")]
        assert all(m.finished == [] for m in before[:-1])
        assert await peer.call("is_paused") is True

        peer.send(request("r2", [1, 2, 3]))
        expected_error = "the engine is paused (mode 'abort'); retry after it resumes"
        assert rows(await peer.outputs(1)) == [
            ([], [], [FinishedRequest("r2", "error", None, expected_error, retryable=True)])
        ]
        stats = await peer.call("get_stats")
        assert (stats["num_running"], stats["num_waiting"], stats["num_free_kv_blocks"]) == (
            0,
            0,
            64,
        )

        await peer.call("resume_generation")
        assert await peer.call("is_paused") is False
        peer.send(request("r3", [7], max_tokens=2))
        assert rows(await peer.outputs(2)) == [
            (["r3"], [[8]], []),
            (["r3"], [[9]], [FinishedRequest("r3", "length")]),
        ]


async def test_pause_wait_lets_in_flight_requests_finish() -> None:
    async with serving() as peer:
        peer.send(request("r1", [1, 2, 3], max_tokens=4))
        before, reply = await peer.reply(peer.start_call("pause_generation", "wait"))
        # The reply comes once r1 has run to its end.
        assert reply.error is None
        assert [t for m in before for t in m.new_token_ids] == [[4], [5], [6], [7]]
        assert before[-1].finished == [FinishedRequest("r1", "length")]

        peer.send(request("r2", [1]))
        expected_error = "the engine is paused (mode 'wait'); retry after it resumes"
        assert rows(await peer.outputs(1)) == [
            ([], [], [FinishedRequest("r2", "error", None, expected_error, retryable=True)])
        ]
        await peer.call("resume_generation")
        peer.send(request("r3", [1], max_tokens=1))
        assert rows(await peer.outputs(1)) == [(["r3"], [[2]], [FinishedRequest("r3", "length")])]


async def test_pause_keep_freezes_requests_and_queues_new_ones() -> None:
    async with serving() as peer:
        peer.send(request("r1", [1, 2, 3], max_tokens=20))
        await peer.outputs(1)
        before, reply = await peer.reply(peer.start_call("pause_generation", "keep"))
        assert reply.error is None
        num_tokens = 1 + sum(len(m.new_token_ids) for m in before)

        peer.send(request("r2", [100], max_tokens=2))
        first = await peer.call("get_stats")  # no step output arrives while paused
        second = await peer.call("get_stats")
        assert (first["num_running"], first["num_waiting"]) == (1, 1)
        assert second["num_steps"] == first["num_steps"] == num_tokens

        await peer.call("resume_generation")
        received = await peer.outputs_until_finished("r1")
        tokens = {rid: [] for rid in ("r1", "r2")}  # type: dict[str, list[int]]
        for message in received:
            for rid, new in zip(message.req_ids, message.new_token_ids, strict=True):
                tokens[rid] += new
        # r1 picks up exactly where it froze; r2 ran meanwhile.
        assert tokens["r1"] == list(range(4 + num_tokens, 24))
        assert tokens["r2"] == [101, 102]


async def test_reset_prefix_cache_fails_while_requests_hold_blocks() -> None:
    async with serving() as peer:
        peer.send(request("r1", list(range(40)), max_tokens=100))
        await peer.outputs(1)
        await peer.reply(peer.start_call("pause_generation", "keep"))  # after some steps
        assert await peer.call("reset_prefix_cache") is False
        peer.send(AbortRequests(["r1"]))
        assert await peer.call("reset_prefix_cache") is True
        await peer.call("resume_generation")


async def test_invalid_input_is_logged_and_dropped_or_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dropped = [
        random.Random(1).randbytes(32),
        msgspec.msgpack.encode(["bogus", "r1", [1]]),
    ]
    truncated = msgspec.msgpack.encode(request("r0", [1]))[:-4]  # its id is readable
    with caplog.at_level(logging.WARNING, logger="engine_core._engine.wire"):
        async with serving() as peer:
            for frame in [*dropped, truncated]:
                peer.send_raw(frame)
            peer.send(request("r1", [1, 2, 3], max_tokens=1))
            received = await peer.outputs_until_finished("r1")
            error = "the engine could not decode the request: Input data was truncated"
            # r0's error goes out with r1's step or before it.
            assert sorted((f for m in received for f in m.finished), key=lambda f: f.req_id) == [
                FinishedRequest("r0", "error", None, error),
                FinishedRequest("r1", "length"),
            ]
            assert [(m.req_ids, m.new_token_ids) for m in received if m.req_ids] == [
                (["r1"], [[4]])
            ]
            stats = await peer.call("get_stats")
            assert (stats["num_malformed_messages"], stats["num_waiting"]) == (3, 0)
    assert [r.getMessage()[: r.getMessage().index(" (")] for r in caplog.records] == [
        *(f"dropped an invalid message of {len(frame)} bytes" for frame in dropped),
        f"rejected request 'r0': an invalid message of {len(truncated)} bytes",
    ]


async def test_failed_calls_reply_with_the_error() -> None:
    async with serving() as peer:
        _, reply = await peer.reply(peer.start_call("bogus"))
        assert reply == UtilityReply(
            1, error="unknown utility method 'bogus'", error_type="ValueError"
        )
        _, reply = await peer.reply(peer.start_call("pause_generation", "later"))
        assert reply == UtilityReply(
            2, error="mode must be one of abort, wait, keep, got 'later'", error_type="ValueError"
        )
        _, reply = await peer.reply(peer.start_call("reset_prefix_cache", 1, 2))
        assert reply.error_type == "TypeError"
        assert await peer.call("check_health") is None


async def test_backend_control_calls_reach_the_backend() -> None:
    async with serving() as peer:
        backend = peer.core.backend
        assert isinstance(backend, MockBackend)
        await peer.call("profile", "start")
        assert backend.is_profiling is True
        await peer.call("profile", "stop")
        assert backend.is_profiling is False
        await peer.call("sleep", 1)
        assert backend.is_sleeping is True
        await peer.call("wake_up")
        assert backend.is_sleeping is False


async def test_shutdown_ends_in_flight_requests_as_aborted() -> None:
    async with serving(backend_options={"latency": {"step_s": 0.002}}) as peer:
        peer.send(request("r1", [1, 2, 3], max_tokens=1000), request("r2", [9], max_tokens=1000))
        await peer.outputs(1)
        peer.send(Shutdown())
        received = await peer.outputs_until_finished("r1")
        assert received[-1].finished == [
            FinishedRequest("r1", "abort"),
            FinishedRequest("r2", "abort"),
        ]
        assert peer.proc.stop_reason == "the client"


async def test_a_failing_step_ends_run_with_its_error() -> None:
    core = make_core(backend_options={"fault": {"kind": "raise", "at_step": 2}})
    with wired(core) as peer:
        peer.send(request("r1", [1, 2, 3]))
        with pytest.raises(ExceptionGroup) as info:
            await peer.proc.run()
        assert info.group_contains(RuntimeError, match="^mock fault injected: raise at step 2$")
        assert rows(await peer.outputs(1)) == [(["r1"], [[4]], [])]  # sent before the failure


async def test_a_step_past_the_timeout_ends_run() -> None:
    core = make_core(GatedMock)
    backend = core.backend
    assert isinstance(backend, GatedMock)
    try:
        with wired(core, step_timeout_s=0.2) as peer:
            peer.send(request("r1", [1, 2, 3]))
            with pytest.raises(ExceptionGroup) as info:
                await peer.proc.run()
            assert info.group_contains(
                TimeoutError, match=r"^a step ran longer than step_timeout_s \(0\.2 s\)$"
            )
    finally:
        backend.open()  # the abandoned model thread ends


# -- heartbeats ------------------------------------------------------------------------------------

_BEAT_S = 0.02


async def test_heartbeats_while_a_step_runs_in_its_thread() -> None:
    async with serving(GatedMock, heartbeat_interval_s=_BEAT_S) as peer:
        backend = peer.core.backend
        assert isinstance(backend, GatedMock)
        peer.send(request("r1", [1, 2, 3], max_tokens=1))
        await backend.wait_started()
        # The event loop is free while the model call blocks: it vouches for the process.
        assert [await peer.recv_any() for _ in range(3)] == [Heartbeat()] * 3
        backend.open()
        assert rows(await peer.outputs(1)) == [(["r1"], [[4]], [FinishedRequest("r1", "length")])]


async def test_heartbeats_while_paused_with_requests_in_flight() -> None:
    async with serving(heartbeat_interval_s=_BEAT_S) as peer:
        peer.send(request("r1", [1, 2, 3], max_tokens=900))
        await peer.outputs(1)
        await peer.reply(peer.start_call("pause_generation", "keep"))
        # No step runs, but a client still waits for r1.
        assert [await peer.recv_any() for _ in range(2)] == [Heartbeat()] * 2
        peer.send(AbortRequests(["r1"]))
        await peer.call("resume_generation")


async def test_no_heartbeat_while_outputs_flow() -> None:
    async with serving(
        heartbeat_interval_s=0.1, backend_options={"latency": {"step_s": 0.001}}
    ) as peer:
        peer.send(request("r1", [1, 2, 3], max_tokens=200))
        # ~0.2 s of outputs, one every ~1 ms: each look finds that something was sent.
        received = await peer.outputs(200)
        assert received[-1].finished == [FinishedRequest("r1", "length")]
        assert peer.num_heartbeats == 0


async def test_no_heartbeat_while_idle() -> None:
    async with serving(heartbeat_interval_s=_BEAT_S) as peer:
        peer.send(request("r1", [1, 2, 3], max_tokens=2))
        await peer.outputs_until_finished("r1")
        assert await peer.call("check_health") is None
        # Nothing is owed to anyone: ten intervals pass in silence (time passing is the test).
        with anyio.move_on_after(10 * _BEAT_S):
            pytest.fail(f"an idle engine sent {await peer.recv_any()!r}")


async def _held_back(peer: Peer) -> int:
    """The step count once the engine waits for the client to read."""
    with anyio.fail_after(_TIMEOUT_S):
        while not peer.proc._backlogged:
            await anyio.sleep(0.01)
    return peer.core.num_steps


@pytest.mark.parametrize("pipes", ["unix", "zmq"])
async def test_a_client_that_stops_reading_holds_the_engine_back(pipes: str) -> None:
    async with serving(pipes=pipes) as peer:
        peer.send(request("r1", [1], max_tokens=100_000))
        # Nothing is read: the engine steps until the pipe's buffers and the few outputs it
        # queues itself are full, then waits.
        held = await _held_back(peer)
        if pipes == "zmq":  # the sockets' queues: OUTPUT_HWM each way on an inproc pipe
            assert 2 * OUTPUT_HWM <= held <= 2 * OUTPUT_HWM + 8
        else:  # the kernel's socket buffer, which counts bytes (and a few hundred per write)
            output = peer.proc._output
            assert isinstance(output, StreamSender)
            sndbuf = output._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            frame = msgspec.msgpack.encode(EngineCoreOutputs(["r1"], [[2]]))
            assert 2 * OUTPUT_HWM <= held <= sndbuf // len(frame)
        await anyio.sleep(0.1)  # time passing is the test: no step while nothing is read
        assert peer.core.num_steps == held
        # Input is still handled while it waits: a control call answers once read up to.
        call_id = peer.start_call("get_stats")
        before, reply = await peer.reply(call_id)
        assert reply.result["num_running"] == 1
        # Reading resumes the steps; the tokens come in order, none lost.
        received = before + await peer.outputs(200)
        tokens = [t for m in received for ids in m.new_token_ids for t in ids]
        vocab = peer.core.vocab_size  # the mock counts up from the prompt's last token
        assert tokens == [(2 + i) % vocab for i in range(len(received))]
        assert peer.core.num_steps > held
