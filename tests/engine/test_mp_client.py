"""``MPClient`` and the engine-core process: startup, serving, death, shutdown.

Spawning a process costs ~0.3 s, so tests that leave the engine clean share one."""

from __future__ import annotations

import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import anyio
import msgspec
import pytest

from engine_core._core.engine_io import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineStats,
    FinishedRequest,
)
from engine_core._engine.mp.client import MPClient, RemoteEngineError
from engine_core._engine.pipes.addresses import TransportKind
from engine_core.config import EngineConfig
from engine_core.errors import EngineClosedError, EngineDeadError
from engine_core.sampling_params import SamplingParams

SLOW_STEPS = {"latency": {"step_s": 0.005}}


def request(request_id: str, prompt: list[int], max_tokens: int = 16) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)
    )


def config(**options: object) -> EngineConfig:
    return EngineConfig(backend="mock", num_kv_blocks=64, **options)  # type: ignore[arg-type]


def _take(outputs: EngineCoreOutputs, request_id: str, tokens: list[int]) -> FinishedRequest | None:
    """Add ``request_id``'s new tokens of one step to ``tokens``; its ending, if in the step."""
    for rid, new in zip(outputs.req_ids, outputs.new_token_ids, strict=True):
        if rid == request_id:
            tokens += new
    return next((f for f in outputs.finished if f.req_id == request_id), None)


def tokens_until_finished(client: MPClient, request_id: str) -> tuple[list[int], FinishedRequest]:
    tokens: list[int] = []
    while (finished := _take(client.get_output(), request_id, tokens)) is None:
        pass
    return tokens, finished


async def tokens_until_finished_async(
    client: MPClient, request_id: str
) -> tuple[list[int], FinishedRequest]:
    tokens: list[int] = []
    while (finished := _take(await client.get_output_async(), request_id, tokens)) is None:
        pass
    return tokens, finished


@pytest.fixture(scope="module")
def engine() -> Iterator[MPClient]:
    """An engine that every test leaves with no request in flight."""
    with MPClient(config()) as client:
        yield client


def test_ready_reports_the_engine(engine: MPClient) -> None:
    assert engine.info == EngineInfo(
        num_kv_blocks=64,
        block_size=16,
        max_model_len=1024,
        vocab_size=258,
        backend="mock",
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    assert engine.info.describe() == (
        "backend mock; KV cache 64 blocks of 16 tokens; max_model_len 1024; max_num_seqs 256; "
        "token budget 8192 per step; async scheduling off; speculative decoding off"
    )


def test_generate_and_control_calls_sync(engine: MPClient) -> None:
    engine.add_request(request("s1", [1, 2, 3], max_tokens=5))
    assert tokens_until_finished(engine, "s1") == ([4, 5, 6, 7, 8], FinishedRequest("s1", "length"))
    stats = engine.call_utility("get_stats")
    assert (stats.num_running, stats.num_waiting, stats.num_free_kv_blocks) == (0, 0, 64)
    assert engine.call_utility("is_paused") is False
    assert engine.call_utility("check_health") is None
    with pytest.raises(ValueError, match="^unknown utility method 'bogus'$"):
        engine.call_utility("bogus")
    with pytest.raises(ValueError, match="^mode must be one of abort, wait, keep, got 'soon'$"):
        engine.call_utility("pause_generation", "soon")


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks


def test_an_idle_engine_sleeps(engine: MPClient) -> None:
    assert engine.pid is not None
    engine.call_utility("check_health")
    before = _cpu_ticks(engine.pid)
    time.sleep(0.5)  # measuring idleness takes an interval: there is nothing to await
    # A spinning loop would burn ~50 ticks (100 per second) here.
    assert _cpu_ticks(engine.pid) - before <= 2


@pytest.mark.anyio
async def test_generate_async_while_other_tasks_make_calls(
    engine: MPClient, anyio_backend: str
) -> None:
    prompts = {f"a{i}-{anyio_backend}": [10 * i + 1] for i in range(4)}
    for request_id, prompt in prompts.items():
        engine.add_request(request(request_id, prompt, max_tokens=8))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    finished: list[FinishedRequest] = []
    stats = []

    async def read_outputs() -> None:
        while len(finished) < len(prompts):
            outputs = await engine.get_output_async()
            for rid, new in zip(outputs.req_ids, outputs.new_token_ids, strict=True):
                if rid in tokens:  # not an earlier test's request
                    tokens[rid] += new
            finished.extend(f for f in outputs.finished if f.req_id in tokens)

    async def call() -> None:
        stats.append(await engine.call_utility_async("get_stats"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(read_outputs)
        for _ in range(3):
            tg.start_soon(call)
    assert tokens == {rid: list(range(p[0] + 1, p[0] + 9)) for rid, p in prompts.items()}
    assert sorted(f.req_id for f in finished) == sorted(prompts)
    assert [type(s) for s in stats] == [EngineStats] * 3
    after = await engine.call_utility_async("get_stats")
    assert (after.num_running, after.num_waiting, after.num_free_kv_blocks) == (0, 0, 64)


@pytest.mark.anyio
async def test_calls_return_while_another_task_waits_for_outputs(engine: MPClient) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.get_output_async)  # nothing is in flight: it waits on
        await anyio.wait_all_tasks_blocked()
        with anyio.fail_after(2):  # the waiting task reads the replies; the callers take them
            async with anyio.create_task_group() as calls:
                for method in ("is_paused", "get_stats", "check_health"):
                    calls.start_soon(engine.call_utility_async, method)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_invalid_frames_are_dropped_and_the_engine_keeps_serving(
    engine: MPClient, anyio_backend: str
) -> None:
    engine.send_raw(random.Random(2).randbytes(50))
    engine.send_raw(msgspec.msgpack.encode(["bogus", "x", [1, 2]]))
    engine.send_raw(msgspec.msgpack.encode(request("bad", [1]))[:-2])
    request_id = f"v-{anyio_backend}"
    engine.add_request(request(request_id, [1], max_tokens=2))
    assert await tokens_until_finished_async(engine, request_id) == (
        [2, 3],
        FinishedRequest(request_id, "length"),
    )


@pytest.mark.anyio
async def test_pause_keep_and_reset_prefix_cache(engine: MPClient, anyio_backend: str) -> None:
    request_id = f"p-{anyio_backend}"
    engine.add_request(request(request_id, list(range(40)), max_tokens=900))
    while request_id not in (await engine.get_output_async()).req_ids:
        pass  # outputs of earlier tests' requests
    await engine.call_utility_async("pause_generation", "keep")
    assert await engine.call_utility_async("is_paused") is True
    assert await engine.call_utility_async("reset_prefix_cache") is False
    engine.abort_requests([request_id])
    assert await engine.call_utility_async("reset_prefix_cache") is True
    await engine.call_utility_async("resume_generation")
    assert await engine.call_utility_async("is_paused") is False


@pytest.mark.anyio
async def test_shutdown_ends_in_flight_requests_as_aborted(anyio_backend: str) -> None:
    client = await MPClient.start_async(
        config(engine_runtime=anyio_backend, backend_options=SLOW_STEPS)
    )
    directory = client._sockets.addresses.directory
    assert directory is not None
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    received: list[EngineCoreOutputs] = []
    first = anyio.Event()

    async def read_outputs() -> None:
        with pytest.raises(EngineClosedError, match="^the engine was shut down$"):
            while True:
                received.append(await client.get_output_async())
                first.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(read_outputs)
        client.add_request(request("c1", [1, 2, 3], max_tokens=1000))
        await first.wait()
        await client.shutdown_async()
    assert received[-1].finished == [FinishedRequest("c1", "abort")]
    assert all(not m.finished for m in received[:-1])
    assert not os.path.exists(directory)
    with pytest.raises(EngineClosedError):
        client.add_request(request("c2", [1]))
    with pytest.raises(EngineClosedError):
        await client.get_output_async()


FAULTS = {
    "raise": (
        {"kind": "raise", "at_step": 2},
        "the engine core is dead: RuntimeError: mock fault injected: raise at step 2",
    ),
    "exit": (
        {"kind": "exit", "at_step": 2},
        "the engine core is dead: its process exited with status 13",
    ),
    "hang": (
        {"kind": "hang", "at_step": 2},
        "the engine core is dead: TimeoutError: a step ran longer than step_timeout_s (0.3 s)",
    ),
}


@pytest.mark.anyio
@pytest.mark.parametrize("fault, expected", FAULTS.values(), ids=FAULTS.keys())
async def test_engine_death_fails_in_flight_and_later_calls(
    fault: dict[str, object], expected: str, anyio_backend: str
) -> None:
    client = await MPClient.start_async(
        config(engine_runtime=anyio_backend, step_timeout_s=0.3, backend_options={"fault": fault})
    )
    async with client:
        start = time.monotonic()  # the engine dies at its second step, right after this
        client.add_request(request("d1", [1, 2, 3]))
        received = []
        with pytest.raises(EngineDeadError) as info:
            while True:
                received.append(await client.get_output_async())
        assert time.monotonic() - start < 1.0 + (0.3 if fault["kind"] == "hang" else 0.0)
        first_step = [(["d1"], [[4]])]
        # A process that exits abruptly may take its last outputs with it; one that fails
        # sends them before its death notice.
        allowed = ([], first_step) if fault["kind"] == "exit" else (first_step,)
        assert [(m.req_ids, m.new_token_ids) for m in received] in allowed
        assert str(info.value).startswith(expected)
        if fault["kind"] != "exit":
            cause = info.value.__cause__
            assert isinstance(cause, RemoteEngineError)
            assert cause.error_type == expected.split(": ")[1]
            assert str(cause).startswith("Traceback (most recent call last):")
        assert client.is_dead
        with pytest.raises(EngineDeadError, match="^the engine core is dead: "):
            client.add_request(request("d2", [1]))
        with pytest.raises(EngineDeadError, match="^the engine core is dead: "):
            await client.call_utility_async("get_stats")
        client.abort_requests(["d1"])  # a no-op once dead


@pytest.mark.anyio
async def test_kill_9_fails_in_flight_and_later_calls_within_a_second(anyio_backend: str) -> None:
    client = await MPClient.start_async(
        config(engine_runtime=anyio_backend, backend_options=SLOW_STEPS)
    )
    async with client:
        client.add_request(request("k1", [1, 2, 3], max_tokens=1000))
        await client.get_output_async()
        assert client.pid is not None
        start = time.monotonic()
        os.kill(client.pid, signal.SIGKILL)
        with pytest.raises(
            EngineDeadError, match="^the engine core is dead: its process was killed by SIGKILL$"
        ):
            while True:
                await client.get_output_async()
        assert time.monotonic() - start < 1.0
        with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
            client.add_request(request("k2", [1]))
        with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
            client.call_utility("check_health")


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_sigterm_ends_in_flight_requests_as_aborted(runtime: str) -> None:
    with MPClient(config(engine_runtime=runtime, backend_options=SLOW_STEPS)) as client:
        client.add_request(request("t1", [1, 2, 3], max_tokens=1000))
        client.get_output()
        assert client.pid is not None
        os.kill(client.pid, signal.SIGTERM)
        tokens, finished = tokens_until_finished(client, "t1")
        assert finished == FinishedRequest("t1", "abort")
        with pytest.raises(
            EngineDeadError, match=r"^the engine core is dead: shut down by SIGTERM"
        ):
            client.get_output()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "end, transport", [("sigterm", "ipc"), ("raise", "ipc"), ("sigterm", "tcp")]
)
async def test_the_engines_last_words_are_read_by_a_front_end_behind(
    end: str, transport: TransportKind, anyio_backend: str
) -> None:
    # The front end's event loop is held while the engine ends, until the process watch has
    # declared the end and well past its grace for the engine's death notice: the frames still
    # in the pipe (a SIGTERM's "abort" outputs, a failure's notice and its cause) are read,
    # from a Unix stream pipe and from a ZMQ one (tcp) alike.
    options: dict[str, object] = dict(SLOW_STEPS)
    if end == "raise":
        options["fault"] = {"kind": "raise", "at_step": 3}
    client = await MPClient.start_async(
        config(engine_runtime=anyio_backend, backend_options=options), transport=transport
    )
    async with client:
        client.add_request(request("w1", [1, 2, 3], max_tokens=1000))
        tokens: list[int] = []
        assert _take(await client.get_output_async(), "w1", tokens) is None
        assert client.pid is not None
        if end == "sigterm":
            os.kill(client.pid, signal.SIGTERM)
        client._process.wait_watch(30)  # blocks the loop: nothing is read meanwhile
        time.sleep(0.2)  # the front end > 0.1 s behind the watch's notice
        if end == "sigterm":
            while (finished := _take(await client.get_output_async(), "w1", tokens)) is None:
                pass
            assert finished == FinishedRequest("w1", "abort")
            assert tokens == list(range(4, 4 + len(tokens)))
            with pytest.raises(EngineDeadError) as info:
                await client.get_output_async()
            assert str(info.value).startswith("the engine core is dead: shut down by SIGTERM")
        else:
            with pytest.raises(EngineDeadError) as info:
                while True:
                    _take(await client.get_output_async(), "w1", tokens)
            assert tokens == [4, 5]  # steps 1 and 2, then the failure
            assert str(info.value).startswith(
                "the engine core is dead: RuntimeError: mock fault injected: raise at step 3"
            )
            assert isinstance(info.value.__cause__, RemoteEngineError)
        assert "(its process exited with status" in str(info.value)


_STARTUP_ERROR = (
    "the engine core failed to start (its process exited with status 1): "
    "ValueError: unknown mock backend_options ['bogus']; known: "
)


def test_backend_failing_at_startup_reports_its_error() -> None:
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        MPClient(config(backend_options={"bogus": 1}))
    assert time.monotonic() - start < 5.0
    assert str(info.value).startswith(_STARTUP_ERROR)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteEngineError)
    assert "parse_options" in str(cause)


@pytest.mark.anyio
async def test_backend_failing_at_startup_reports_its_error_async() -> None:
    with pytest.raises(ValueError) as info:
        await MPClient.start_async(config(backend_options={"bogus": 1}))
    assert str(info.value).startswith(_STARTUP_ERROR)


def test_startup_timeout() -> None:
    # No process starts, let alone loads a backend, within a millisecond.
    with pytest.raises(
        TimeoutError, match=r"^the engine core did not start within startup_timeout_s \(0\.001 s\)$"
    ):
        MPClient(config(startup_timeout_s=0.001))


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


_PARENT = """
import sys
from engine_core._engine.mp.client import MPClient
from engine_core.config import EngineConfig

if __name__ == "__main__":
    runtime = sys.argv[1]
    client = MPClient(EngineConfig(backend="mock", num_kv_blocks=16, engine_runtime=runtime))
    print(client.pid, client._sockets.addresses.directory, flush=True)
    sys.stdin.read()
"""


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_engine_exits_when_its_parent_dies(runtime: str) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, runtime],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        pid, directory = parent.stdout.readline().split()
        engine_pid = int(pid)
        assert not _gone(engine_pid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 2.0
    while not _gone(engine_pid):
        assert time.monotonic() < deadline, "the engine outlived its parent by 2 s"
        time.sleep(0.01)
    assert not os.path.exists(directory)  # the engine removed the parent's socket directory


@pytest.mark.parametrize(
    ("transport", "scheme"),
    [("ipc", "unix://"), ("zmq-ipc", "ipc://"), ("tcp", "tcp://127.0.0.1:")],
)
def test_each_transport_serves(transport: TransportKind, scheme: str) -> None:
    threads, fds = set(threading.enumerate()), set(os.listdir("/proc/self/fd"))
    with MPClient(config(), transport=transport) as client:
        ready = client._inbox.ready
        assert ready is not None
        assert ready.input_address.startswith(scheme)
        directory = client._sockets.addresses.directory
        client.add_request(request("n1", [5], max_tokens=2))
        assert tokens_until_finished(client, "n1") == ([6, 7], FinishedRequest("n1", "length"))
    # Closed: the socket directory is gone, and so are the client's threads and descriptors.
    assert (directory is None) == (transport == "tcp")
    assert directory is None or not os.path.exists(directory)
    assert set(threading.enumerate()) - threads == set()
    assert set(os.listdir("/proc/self/fd")) == fds
