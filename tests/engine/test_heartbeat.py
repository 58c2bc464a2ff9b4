"""A frozen engine-core process (SIGSTOP, a step holding the GIL) is declared dead and killed
within ``engine_heartbeat_timeout_s`` while the client waits for it; a live one, however slow
its steps or its startup, and an idle one are not.

Each test that stops the engine arms a timer that SIGKILLs it after ``_BACKSTOP_S``: if the
heartbeat timeout failed to fire, the client would then see a plain kill (and the test fail on
the message) instead of waiting for ever."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator

import anyio
import msgspec
import pytest

from engine_core import LLM, AsyncLLM, SamplingParams
from engine_core._core.engine_io import EngineCoreOutputs, EngineCoreRequest, FinishedRequest
from engine_core._engine.mp.client import MPClient
from engine_core._engine.mp.inbox import EngineInbox
from engine_core._engine.pipes.pipes import Pipes
from engine_core._engine.wire import Heartbeat, Silence, UtilityReply
from engine_core.config import EngineConfig
from engine_core.errors import EngineDeadError

BEAT_S = 1.0
"""The heartbeat timeout of the tests that stop an engine."""
_SLACK_S = 1.0
"""How much later than the timeout a silence may be reported (a loaded machine)."""
_BACKSTOP_S = 10.0
SLOW_STEPS = {"latency": {"step_s": 0.005}}
STOPPED = re.compile(
    r"^the engine core is dead: it stopped answering for \d+\.\d s "
    r"\(engine_heartbeat_timeout_s\); its process was killed$"
)


def config(**options: object) -> EngineConfig:
    return EngineConfig(  # type: ignore[arg-type]
        backend="mock", tokenizer="byte", num_kv_blocks=64, **options
    )


def long_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)


def request(request_id: str, max_tokens: int = 900) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=max_tokens)
    )


@contextlib.contextmanager
def process_handle(pid: int) -> Iterator[int]:
    """A pidfd of ``pid`` (readable once it has exited), with a timer that SIGKILLs the
    process after ``_BACKSTOP_S`` and a SIGKILL on the way out."""
    pidfd = os.pidfd_open(pid)
    backstop = threading.Timer(_BACKSTOP_S, _kill, (pid,))
    backstop.start()
    try:
        yield pidfd
    finally:
        backstop.cancel()
        _kill(pid)
        os.close(pidfd)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def assert_stopped_answering(error: BaseException, *, since: float | None = None) -> None:
    """``error`` declares the engine dead for its silence; with ``since``, within the heartbeat
    timeout (and some slack) of that time."""
    if since is not None:
        assert time.monotonic() - since < BEAT_S + _SLACK_S
    assert isinstance(error, EngineDeadError), repr(error)
    assert STOPPED.match(str(error)), str(error)
    assert isinstance(error.__cause__, TimeoutError)
    assert str(error.__cause__).startswith("the engine core sent nothing for ")


def exited_within(pidfd: int, timeout: float) -> bool:
    return bool(select.select([pidfd], [], [], timeout)[0])


@contextlib.asynccontextmanager
async def stopped_client(runtime: str) -> AsyncIterator[tuple[MPClient, int]]:
    """A client whose idle engine process (heartbeat timeout ``BEAT_S``) was just stopped
    (SIGSTOP), and the process's handle (see ``process_handle``)."""
    client = await MPClient.start_async(
        config(engine_runtime=runtime, engine_heartbeat_timeout_s=BEAT_S)
    )
    async with client:
        assert client.pid is not None
        with process_handle(client.pid) as pidfd:
            os.kill(client.pid, signal.SIGSTOP)
            yield client, pidfd


async def start_with_a_fault(
    runtime: str, kind: str, *, step_timeout_s: float, engine_heartbeat_timeout_s: float
) -> MPClient:
    """A client of an engine process whose second step ``kind``s: "freeze" holds the GIL,
    "hang" blocks the step's thread."""
    return await MPClient.start_async(
        config(
            engine_runtime=runtime,
            step_timeout_s=step_timeout_s,
            engine_heartbeat_timeout_s=engine_heartbeat_timeout_s,
            backend_options={"fault": {"kind": kind, "at_step": 2}},
        )
    )


async def outputs_until_dead(client: MPClient) -> tuple[list[EngineCoreOutputs], EngineDeadError]:
    """The client's outputs until it declares the engine dead, and its error."""
    received: list[EngineCoreOutputs] = []
    with pytest.raises(EngineDeadError) as info:
        while True:
            received.append(await client.get_output_async())
    return received, info.value


# -- a frozen engine ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_stopped_engine_fails_in_flight_and_later_generates(anyio_backend: str) -> None:
    engine = AsyncLLM.from_config(
        config(engine_runtime=anyio_backend, engine_heartbeat_timeout_s=BEAT_S)
    )
    async with engine:
        assert isinstance(engine._client, MPClient) and engine._client.pid is not None
        pid = engine._client.pid
        with process_handle(pid) as pidfd:
            streaming = [anyio.Event() for _ in range(4)]
            failed_at: list[float] = []

            async def generate(i: int) -> None:
                with pytest.raises(EngineDeadError) as info:
                    async for _ in engine.generate("abc", long_params()):
                        streaming[i].set()
                failed_at.append(time.monotonic())
                assert_stopped_answering(info.value)

            with anyio.fail_after(_BACKSTOP_S + 5):
                async with anyio.create_task_group() as tg:
                    for i in range(len(streaming)):
                        tg.start_soon(generate, i)
                    for event in streaming:
                        await event.wait()
                    os.kill(pid, signal.SIGSTOP)
                    stopped_at = time.monotonic()
                assert len(failed_at) == len(streaming)
                assert max(failed_at) - stopped_at < BEAT_S + _SLACK_S
                with pytest.raises(EngineDeadError) as info:
                    async for _ in engine.generate("abc", long_params()):
                        pass
                assert_stopped_answering(info.value)
                with pytest.raises(EngineDeadError, match="stopped answering"):
                    await engine.get_stats()
                with pytest.raises(EngineDeadError, match="stopped answering"):
                    await engine.check_health()
                # The client killed the frozen process: it does not linger.
                await anyio.wait_readable(pidfd)


def test_a_stopped_engine_fails_the_sync_llm() -> None:
    with LLM.from_config(config(multiprocess=True, engine_heartbeat_timeout_s=BEAT_S)) as llm:
        assert llm.generate("abc", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs
        assert isinstance(llm._client, MPClient) and llm._client.pid is not None
        pid = llm._client.pid
        with process_handle(pid) as pidfd:
            os.kill(pid, signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(EngineDeadError) as info:
                llm.generate(["abc", "xyz"], SamplingParams(max_tokens=5), use_tqdm=False)
            assert_stopped_answering(info.value, since=start)
            with pytest.raises(EngineDeadError, match="stopped answering"):
                llm.generate("abc", SamplingParams(max_tokens=5), use_tqdm=False)
            with pytest.raises(EngineDeadError, match="stopped answering"):
                llm.get_stats()
            assert exited_within(pidfd, 5.0)


@pytest.mark.anyio
async def test_a_stopped_engine_fails_a_waiting_call(anyio_backend: str) -> None:
    async with stopped_client(anyio_backend) as (client, pidfd):
        start = time.monotonic()  # stopped idle: nothing is declared while nobody waits
        with anyio.fail_after(_BACKSTOP_S + 5):
            with pytest.raises(EngineDeadError) as info:
                await client.call_utility_async("get_stats")
            assert_stopped_answering(info.value, since=start)
            assert client.is_dead
            await anyio.wait_readable(pidfd)


@pytest.mark.anyio
async def test_the_clock_runs_on_after_a_caller_stops_waiting(anyio_backend: str) -> None:
    # A health probe that gives up does not reset the clock: the engine still owes its reply.
    async with stopped_client(anyio_backend) as (client, _):
        start = time.monotonic()
        with anyio.move_on_after(0.7 * BEAT_S):
            await client.call_utility_async("check_health")
        assert not client.is_dead
        with anyio.fail_after(_BACKSTOP_S + 5):
            with pytest.raises(EngineDeadError) as info:
                await client.call_utility_async("check_health")
        assert_stopped_answering(info.value, since=start)


@pytest.mark.anyio
async def test_a_step_holding_the_gil_is_caught_by_the_heartbeat(anyio_backend: str) -> None:
    # No step timeout can fire in a process whose event loop never gets the GIL back.
    client = await start_with_a_fault(
        anyio_backend, "freeze", step_timeout_s=0.2, engine_heartbeat_timeout_s=BEAT_S
    )
    async with client:
        assert client.pid is not None
        with process_handle(client.pid) as pidfd:
            start = time.monotonic()
            client.add_request(request("f1"))
            with anyio.fail_after(_BACKSTOP_S + 5):
                received, error = await outputs_until_dead(client)
                assert_stopped_answering(error, since=start)
                assert [m.new_token_ids for m in received] == [[[4]]]
                await anyio.wait_readable(pidfd)


# -- a live engine --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_hung_step_still_dies_by_the_step_timeout(anyio_backend: str) -> None:
    # A model call that blocks in its thread leaves the event loop free: the heartbeats go on
    # (for longer than their timeout) and the step timeout ends the engine.
    client = await start_with_a_fault(
        anyio_backend, "hang", step_timeout_s=1.0, engine_heartbeat_timeout_s=0.3
    )
    async with client:
        start = time.monotonic()
        client.add_request(request("h1"))
        with anyio.fail_after(_BACKSTOP_S):
            _, error = await outputs_until_dead(client)
        assert 1.0 <= time.monotonic() - start < 1.0 + _SLACK_S
        assert str(error).startswith(
            "the engine core is dead: TimeoutError: a step ran longer than step_timeout_s (1.0 s)"
        )


@pytest.mark.anyio
async def test_steps_longer_than_the_heartbeat_timeout_are_no_silence(anyio_backend: str) -> None:
    engine = AsyncLLM.from_config(
        config(
            engine_runtime=anyio_backend,
            engine_heartbeat_timeout_s=0.3,
            backend_options={"latency": {"step_s": 0.8}},
        )
    )
    async with engine:
        with anyio.fail_after(_BACKSTOP_S):
            outputs = [
                o
                async for o in engine.generate("abc", SamplingParams(temperature=0.0, max_tokens=2))
            ]
        assert (outputs[-1].outputs[0].text, outputs[-1].finished) == ("de", True)


@pytest.mark.anyio
async def test_an_idle_engine_is_not_declared_dead(anyio_backend: str) -> None:
    engine = AsyncLLM.from_config(
        config(engine_runtime=anyio_backend, engine_heartbeat_timeout_s=0.3)
    )
    async with engine:
        with anyio.fail_after(_BACKSTOP_S):
            await engine.check_health()
            # Its output handler waits the whole time; no request is in flight, no call waits.
            await anyio.sleep(1.0)  # time passing is the test
            outputs = [
                o
                async for o in engine.generate("abc", SamplingParams(temperature=0.0, max_tokens=2))
            ]
            assert outputs[-1].outputs[0].text == "de"
            await engine.check_health()


@pytest.mark.anyio
async def test_a_client_too_busy_to_read_does_not_mistake_the_backlog_for_silence(
    anyio_backend: str,
) -> None:
    client = await MPClient.start_async(
        config(
            engine_runtime=anyio_backend, engine_heartbeat_timeout_s=0.3, backend_options=SLOW_STEPS
        )
    )
    async with client:
        client.add_request(request("b1", max_tokens=400))
        with anyio.fail_after(_BACKSTOP_S):
            await client.get_output_async()
            # The event loop is blocked (by the application, say) for three heartbeat timeouts:
            # nobody reads, and the watch thread finds nothing heard meanwhile.
            time.sleep(1.0)
            finished: list[FinishedRequest] = []
            while not finished:
                finished = (await client.get_output_async()).finished
        assert finished == [FinishedRequest("b1", "length")]
        assert not client.is_dead


@pytest.mark.anyio
async def test_a_startup_longer_than_the_heartbeat_timeout(anyio_backend: str) -> None:
    # Loading has its own limit (startup_timeout_s); the heartbeat only counts once ready.
    start = time.monotonic()
    client = await MPClient.start_async(
        config(
            engine_runtime=anyio_backend,
            engine_heartbeat_timeout_s=0.2,
            backend_options={"load_s": 1.0},
        )
    )
    async with client:
        assert time.monotonic() - start >= 1.0
        client.add_request(request("s1", max_tokens=2))
        with anyio.fail_after(_BACKSTOP_S):
            finished: list[FinishedRequest] = []
            while not finished:
                finished = (await client.get_output_async()).finished
        assert finished == [FinishedRequest("s1", "length")]


def test_defaults() -> None:
    assert (EngineConfig().engine_heartbeat_timeout_s, EngineConfig().step_timeout_s) == (
        10.0,
        300.0,
    )


# -- the inbox's judgement, frame by frame ----------------------------------------------------------


class Wire:
    """An inbox on one in-process pipe, fed in order by the test (as the engine and the watch
    would, but in an order the test chooses)."""

    def __init__(self, limit: float) -> None:
        self._directory = tempfile.TemporaryDirectory()
        self._pipes = Pipes()
        address = f"unix://{self._directory.name}/output"
        self.pull = self._pipes.receiver(address)
        self.push = self._pipes.sender(address)
        self.silences: list[float] = []
        self.posted: list[bytes] = []
        self.inbox = EngineInbox(
            self.pull,
            on_notice=lambda: None,
            heartbeat_timeout_s=limit,
            on_silence=self.silences.append,
            post=self.posted.append,
        )
        self.inbox.listening = True

    def send(self, *messages: object) -> None:
        for message in messages:
            self.push.send_nowait(msgspec.msgpack.encode(message))

    def read_all(self) -> None:
        """Sort every frame sent so far (the last one is a reply the test expects)."""
        self.inbox.expect_reply(99)
        self.send(UtilityReply(99))
        self.inbox.read_until_sync(lambda: self.inbox.has_reply(99), timeout=5.0)
        self.inbox.take_reply(99)

    def close(self) -> None:
        self._pipes.close()
        self._directory.cleanup()


@pytest.fixture
def wire() -> Iterator[Wire]:
    w = Wire(limit=0.05)
    try:
        yield w
    finally:
        w.close()


def test_look_posts_one_silence_notice_once_the_wait_is_long_enough(wire: Wire) -> None:
    inbox = wire.inbox
    assert inbox.look() == 0.05  # nothing is waited for: look again a timeout later
    inbox.track("r1")
    left = inbox.look()
    assert left is not None and 0 < left <= 0.05
    time.sleep(0.06)  # the passing of time is what is tested
    assert inbox.look() == 0.05
    assert inbox.look() == 0.05
    assert wire.posted == [msgspec.msgpack.encode(Silence())]  # one until it is read


def test_a_silence_notice_with_the_engines_messages_behind_it_is_no_silence(wire: Wire) -> None:
    inbox = wire.inbox
    inbox.track("r1")
    time.sleep(0.06)  # nothing was read for longer than the timeout
    # The notice was read first; the engine's backlog (the client was busy) comes behind it.
    wire.send(Silence(), Heartbeat(), EngineCoreOutputs(["r1"], [[4]]))
    wire.read_all()
    assert (wire.silences, inbox.silent_s, inbox.gone) == ([], None, False)
    assert [o.req_ids for o in inbox.outputs] == [["r1"]]


def test_a_silence_notice_alone_declares_the_engine_silent(wire: Wire) -> None:
    inbox = wire.inbox
    inbox.track("r1")
    time.sleep(0.06)
    wire.send(Silence())
    inbox.read_until_sync(lambda: False, timeout=5.0)  # returns once the engine is gone
    assert len(wire.silences) == 1 and wire.silences[0] >= 0.05
    assert inbox.gone and inbox.silent_s == wire.silences[0]


def test_a_silence_notice_is_ignored_when_nothing_is_waited_for(wire: Wire) -> None:
    inbox = wire.inbox
    inbox.track("r1")
    inbox.untrack(["r1"])  # aborted
    inbox.track("r2")
    wire.send(EngineCoreOutputs(finished=[FinishedRequest("r2", "length")]))
    wire.read_all()
    time.sleep(0.06)
    wire.send(Silence())
    wire.read_all()
    assert (wire.silences, inbox.gone, inbox.in_flight) == ([], False, set())
