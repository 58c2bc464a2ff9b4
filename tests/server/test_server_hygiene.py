"""What connections and responses may cost the server, and how it stops: idle, slow-header and
slow-body clients, the connection limit, shutdown (in flight responses finish, then end with an
error event), and the engine's death (responses end with an error, the server stops).

In-process tests run one server per test under each stack (asyncio on uvicorn and hypercorn,
trio on hypercorn) and talk to it over raw sockets where the client misbehaves; the last tests
run ``engine-core serve`` in a subprocess, to send it real signals and see its exit status.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest

from engine_core import AsyncLLM
from engine_core._bench.server_process import server_process
from engine_core.errors import EngineDeadError
from engine_core.server import ENGINE_DEAD_EXIT_CODE, ServerSettings, create_app, serve
from engine_core.server._connections import ConnectionGuard, default_max_connections

pytestmark = pytest.mark.anyio

MOCK = ["--backend", "mock", "--tokenizer", "byte"]
SLOW_STEPS = {"latency": {"step_s": 0.01}}
"""A step per 10 ms: a stream of N tokens takes about N / 100 s."""


@pytest.fixture(
    params=[("asyncio", "uvicorn"), ("asyncio", "hypercorn"), ("trio", "hypercorn")],
    ids=lambda stack: "-".join(stack),
)
def stack(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def anyio_backend(stack: tuple[str, str]) -> str:
    return stack[0]


@dataclass
class Running:
    url: str = ""
    stop: anyio.Event = field(default_factory=anyio.Event)
    """Set: serve()'s shutdown trigger returns."""
    done: anyio.Event = field(default_factory=anyio.Event)
    """Set once serve() returned or raised."""
    error: BaseException | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)


@contextlib.asynccontextmanager
async def running(
    stack: tuple[str, str], settings: dict[str, Any], **engine_config: Any
) -> AsyncIterator[tuple[Running, AsyncLLM]]:
    """A server on a free port over a mock engine, on ``stack``'s HTTP server; serve()'s
    outcome is recorded rather than raised into the test."""
    server_settings = ServerSettings(port=0, http_server=stack[1], **settings)  # type: ignore[arg-type]
    run = Running()

    async def serve_it(*, task_status: anyio.abc.TaskStatus[str]) -> None:
        try:
            await serve(
                engine, server_settings, shutdown_trigger=run.stop.wait, task_status=task_status
            )
        except EngineDeadError as exc:
            run.error = exc
        finally:
            run.done.set()

    async with (
        AsyncLLM(backend="mock", tokenizer="byte", **engine_config) as engine,
        anyio.create_task_group() as task_group,
    ):
        run.url = await task_group.start(serve_it)
        try:
            yield run, engine
        finally:
            run.stop.set()


async def read_until_closed(stream: anyio.abc.ByteStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
        while True:
            data += await stream.receive()
    return data


async def is_closed(stream: anyio.abc.ByteStream, within: float) -> bool:
    """Whether the server closes ``stream`` within ``within`` seconds (data is dropped)."""
    with anyio.move_on_after(within):
        await read_until_closed(stream)
        return True
    return False


def status_and_body(response: bytes) -> tuple[int, bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def completion(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"prompt": "abc", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def raw_post(path: str, body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    return (
        f"POST {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode() + body


HEALTH = b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n"


async def health(stream: anyio.abc.ByteStream) -> int:
    """The status of a ``GET /health`` sent on ``stream`` (one read: the answer is small)."""
    await stream.send(HEALTH)
    return status_and_body(await stream.receive())[0]


@contextlib.asynccontextmanager
async def silent_and_kept_alive(
    stack: tuple[str, str], settings: dict[str, Any]
) -> AsyncIterator[tuple[anyio.abc.SocketStream, anyio.abc.SocketStream]]:
    """Two connections to a server with ``settings``, within 10 s: one for a client that never
    sends, one for a client that keeps its connection alive between requests."""
    async with running(stack, settings, multiprocess=False) as (run, _):
        with anyio.fail_after(10):
            async with (
                await anyio.connect_tcp(*run.address) as silent,
                await anyio.connect_tcp(*run.address) as kept_alive,
            ):
                yield silent, kept_alive


# -- slow and idle connections -------------------------------------------------------------------


async def test_idle_connections_are_closed(stack: tuple[str, str]) -> None:
    settings = {"keep_alive_timeout_s": 0.5, "header_timeout_s": 5.0}
    async with silent_and_kept_alive(stack, settings) as (silent, kept_alive):
        start = anyio.current_time()
        assert await health(kept_alive) == 200
        after_response = anyio.current_time()
        assert await is_closed(silent, within=5)
        assert 0.4 <= anyio.current_time() - start < 3
        assert await is_closed(kept_alive, within=5)
        assert 0.4 <= anyio.current_time() - after_response < 3


async def test_a_connection_waits_for_its_first_request_no_longer_than_the_header_timeout(
    stack: tuple[str, str],
) -> None:
    # The keep-alive (long, so that clients end idle connections first) is for the wait
    # between two requests; a connection that never sends is cut at the header timeout.
    settings = {"keep_alive_timeout_s": 30.0, "header_timeout_s": 0.5}
    async with silent_and_kept_alive(stack, settings) as (silent, kept_alive):
        start = anyio.current_time()
        assert await health(kept_alive) == 200
        assert await is_closed(silent, within=5)
        assert 0.4 <= anyio.current_time() - start < 3
        assert not await is_closed(kept_alive, within=0.5)
        assert await health(kept_alive) == 200


async def test_a_connection_the_client_closed_is_released_at_once(
    stack: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kept-alive connection the client ends is let go at once, not at the (long) keep-alive
    # deadline: it would hold a file descriptor and a place under max_connections meanwhile.
    released: list[float] = []
    release = ConnectionGuard.release

    def record(guard: ConnectionGuard, connection: object) -> None:
        released.append(time.monotonic())
        release(guard, connection)

    monkeypatch.setattr(ConnectionGuard, "release", record)
    settings = {"keep_alive_timeout_s": 30.0, "header_timeout_s": 30.0}
    async with running(stack, settings, multiprocess=False) as (run, _):
        with anyio.fail_after(10):
            async with await anyio.connect_tcp(*run.address) as client:
                assert await health(client) == 200
            closed = time.monotonic()
            while not released:
                await anyio.sleep(0.01)
            assert released[0] - closed < 1.0


def closed_by_peer(stream: anyio.abc.ByteStream) -> bool:
    """Whether the server has ended ``stream`` (or sent anything) by now: what a client's pool
    looks at before it reuses a kept-alive connection (httpcore's ``is_readable``)."""
    sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    return bool(select.select([sock], [], [], 0)[0])


async def test_a_request_at_the_keep_alive_deadline_is_answered(stack: tuple[str, str]) -> None:
    # The client sends its next request just before the connection's idle deadline, and the
    # event loop (the server's too: it runs in this process) is then held past that deadline,
    # so that the server finds the request's bytes in and its deadline passed in the same turn:
    # a client idling at the server's keep-alive boundary. The request must be answered, not
    # dropped with the connection ("Server disconnected without sending a response").
    keep_alive = 0.3
    settings = {"keep_alive_timeout_s": keep_alive, "header_timeout_s": 5.0}
    async with running(stack, settings, multiprocess=False) as (run, _):
        with anyio.fail_after(30):
            answered = attempts = 0
            while answered < 3 and attempts < 10:
                async with await anyio.connect_tcp(*run.address) as client:
                    assert await health(client) == 200
                    while answered < 3 and attempts < 10:
                        attempts += 1
                        await anyio.sleep(keep_alive - 0.1)
                        if closed_by_peer(client):  # the deadline came early: try again
                            break
                        # Sent and held with no checkpoint between: the server cannot read it
                        # before its deadline passes.
                        os.write(
                            client.extra(anyio.abc.SocketAttribute.raw_socket).fileno(), HEALTH
                        )
                        time.sleep(0.2)
                        assert status_and_body(await client.receive())[0] == 200
                        answered += 1
            assert answered == 3


async def test_slow_headers_are_cut_at_the_header_timeout(stack: tuple[str, str]) -> None:
    # The header deadline (1 s from the first byte) replaces the idle one (0.5 s).
    settings = {"keep_alive_timeout_s": 0.5, "header_timeout_s": 1.0}
    request = raw_post("/v1/completions", b"{}")
    async with running(stack, settings, multiprocess=False) as (run, _):
        with anyio.fail_after(10):
            async with await anyio.connect_tcp(*run.address) as client:
                await anyio.sleep(0.25)
                first_byte = anyio.current_time()
                closed = False
                for byte in request[:-2]:  # never the blank line that ends the headers
                    try:
                        await client.send(bytes([byte]))
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        closed = True
                        break
                    if await is_closed(client, within=0.1):
                        closed = True
                        break
                assert closed
                assert 0.8 <= anyio.current_time() - first_byte < 3


async def test_slow_body_is_answered_408(stack: tuple[str, str]) -> None:
    settings = {"body_timeout_s": 0.5}
    async with running(stack, settings, multiprocess=False) as (run, _):
        with anyio.fail_after(10):
            async with await anyio.connect_tcp(*run.address) as client:
                await client.send(raw_post("/v1/completions", b"{", content_length=1000))
                start = anyio.current_time()
                received = b""
                while not received.endswith(b"}}"):
                    with anyio.move_on_after(0.1):
                        received += await client.receive()
                    if not received:
                        await client.send(b" ")  # a byte now and then: never the whole body
                assert 0.4 <= anyio.current_time() - start < 3
                status, body = status_and_body(received)
                assert status == 408
                error = json.loads(body)["error"]
                assert (error["type"], error["code"]) == (
                    "invalid_request_error",
                    "request_timeout",
                )
                assert await is_closed(client, within=3)


async def test_a_response_before_the_body_closes_the_connection(stack: tuple[str, str]) -> None:
    async with running(stack, {}, multiprocess=False) as (run, _):
        with anyio.fail_after(10):
            async with await anyio.connect_tcp(*run.address) as client:
                await client.send(raw_post("/no-such-route", b"{", content_length=1000))
                response = await read_until_closed(client)  # the rest of the body is not waited for
                assert status_and_body(response)[0] == 404


async def test_past_max_connections_a_busy_server_answers_503(stack: tuple[str, str]) -> None:
    settings = {"max_connections": 2}
    async with running(stack, settings, multiprocess=False, backend_options=SLOW_STEPS) as (run, _):
        with anyio.fail_after(15):
            async with (
                await anyio.connect_tcp(*run.address) as first,
                await anyio.connect_tcp(*run.address) as second,
            ):
                for busy in (first, second):  # both in a request: a stream that lasts
                    body = json.dumps(completion(2000, stream=True)).encode()
                    await busy.send(raw_post("/v1/completions", body))
                    while b"data: " not in await busy.receive():
                        pass
                async with await anyio.connect_tcp(*run.address) as third:
                    status, body = status_and_body(await read_until_closed(third))
                assert status == 503
                error = json.loads(body)["error"]
                assert (error["type"], error["code"]) == (
                    "service_unavailable",
                    "too_many_connections",
                )
            # The two streams are gone: there is room again.
            async with httpx.AsyncClient(base_url=run.url) as client:
                for _ in range(50):
                    response = await client.get("/health")
                    if response.status_code == 200:
                        break
                    await anyio.sleep(0.05)
                assert response.status_code == 200


async def test_past_max_connections_the_longest_idle_connection_makes_room(
    stack: tuple[str, str],
) -> None:
    settings = {"max_connections": 3, "keep_alive_timeout_s": 20.0}
    async with running(stack, settings, multiprocess=False) as (run, _):
        with anyio.fail_after(15):
            async with contextlib.AsyncExitStack() as stack_:
                idle = []
                for _ in range(3):  # three connections, each served once, then waiting
                    connection = await stack_.enter_async_context(
                        await anyio.connect_tcp(*run.address)
                    )
                    assert await health(connection) == 200
                    idle.append(connection)
                async with httpx.AsyncClient(base_url=run.url) as client:
                    assert (await client.get("/health")).status_code == 200
                assert await is_closed(idle[0], within=3)
                assert not await is_closed(idle[2], within=0.3)


# -- shutdown ------------------------------------------------------------------------------------


@dataclass
class InFlight:
    """Completions sent to a server each in its own task, what comes back collected."""

    client: httpx.AsyncClient
    task_group: anyio.abc.TaskGroup
    events: list[str] = field(default_factory=list)
    """The ``data:`` lines of the streamed completion, as they come."""
    whole: list[httpx.Response] = field(default_factory=list)
    """The responses to the completions that are not streamed, as they come."""

    def stream(self, body: dict[str, Any]) -> None:
        """POST a streamed completion, collecting its ``data:`` lines into ``events``."""
        self.task_group.start_soon(self._stream, body)

    def post(self, body: dict[str, Any]) -> None:
        """POST a completion that is not streamed, its response appended to ``whole``."""
        self.task_group.start_soon(self._post, body)

    async def _stream(self, body: dict[str, Any]) -> None:
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    self.events.append(line.removeprefix("data: "))

    async def _post(self, body: dict[str, Any]) -> None:
        self.whole.append(await self.client.post("/v1/completions", json=body))


@contextlib.asynccontextmanager
async def in_flight(url: str) -> AsyncIterator[InFlight]:
    """An :class:`InFlight` to ``url``; the block ends once every request it sent has."""
    async with (
        httpx.AsyncClient(base_url=url, timeout=10) as client,
        anyio.create_task_group() as task_group,
    ):
        yield InFlight(client, task_group)


async def refuses_connections(address: tuple[str, int], within: float) -> bool:
    with anyio.move_on_after(within):
        while True:
            try:
                connection = await anyio.connect_tcp(*address)
            except OSError:
                return True
            await connection.aclose()
            await anyio.sleep(0.05)
    return False


async def test_shutdown_lets_responses_in_flight_finish(stack: tuple[str, str]) -> None:
    settings = {"shutdown_timeout_s": 20.0}
    async with running(stack, settings, multiprocess=False, backend_options=SLOW_STEPS) as (run, _):
        with anyio.fail_after(15):
            async with in_flight(run.url) as flight:
                flight.stream(completion(100, True))
                while not flight.events:
                    await anyio.sleep(0.01)
                run.stop.set()
                assert await refuses_connections(run.address, within=3)
            events = flight.events
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            await run.done.wait()
            assert run.error is None


async def test_shutdown_timeout_ends_responses_with_an_error(stack: tuple[str, str]) -> None:
    settings = {"shutdown_timeout_s": 0.5}
    async with running(stack, settings, multiprocess=False, backend_options=SLOW_STEPS) as (
        run,
        engine,
    ):
        with anyio.fail_after(15):
            async with in_flight(run.url) as flight:
                flight.stream(completion(2000, True))
                flight.post(completion(2000, False))
                while not flight.events or (await engine.get_stats()).num_running < 2:
                    await anyio.sleep(0.01)
                start = anyio.current_time()
                run.stop.set()
            events, whole = flight.events, flight.whole
            assert 0.4 <= anyio.current_time() - start < 5
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert (error["type"], error["code"]) == ("service_unavailable", "server_shutting_down")
            assert whole[0].status_code == 503
            assert whole[0].json()["error"]["code"] == "server_shutting_down"
            await run.done.wait()
            assert run.error is None


# -- engine death --------------------------------------------------------------------------------


async def test_engine_death_ends_responses_and_stops_the_server(stack: tuple[str, str]) -> None:
    fault = {"fault": {"kind": "raise", "at_step": 20}, "latency": {"step_s": 0.02}}
    async with running(stack, {}, multiprocess=True, backend_options=fault) as (run, _):
        with anyio.fail_after(15):
            async with in_flight(run.url) as flight:
                flight.stream(completion(50, True))
                while not flight.events:
                    await anyio.sleep(0.01)
                flight.post(completion(50, False))
            events, whole = flight.events, flight.whole
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert (error["type"], error["code"]) == ("service_unavailable", "engine_dead")
            assert "engine is dead" in error["message"]
            assert whole[0].status_code == 503
            assert whole[0].json()["error"]["code"] == "engine_dead"
            await run.done.wait()
            assert isinstance(run.error, EngineDeadError)
            assert await refuses_connections(run.address, within=1)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_app_over_a_dead_engine_answers_503(anyio_backend: str) -> None:
    """What the app answers in the moment between the engine's death and the server's stop (and
    for good, where it is served by something else than :func:`serve`)."""
    fault = {"fault": {"kind": "exit", "at_step": 3}}
    async with AsyncLLM(
        backend="mock", tokenizer="byte", multiprocess=True, backend_options=fault
    ) as engine:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            with anyio.fail_after(10):
                first = await client.post("/v1/completions", json=completion(50, False))
                assert first.status_code == 503
                assert first.json()["error"]["code"] == "engine_dead"
                health = await client.get("/health")
                assert health.status_code == 503
                assert health.json()["error"]["type"] == "service_unavailable"
                for body in (completion(5, False), completion(5, True)):
                    response = await client.post("/v1/completions", json=body)
                    assert response.status_code == 503
                    assert response.json()["error"]["code"] == "engine_dead"
                chat = await client.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                )
                assert chat.status_code == 503
                metrics = await client.get("/metrics")
                assert metrics.status_code == 200
                assert "engine_core_generation_tokens_total" in metrics.text
                assert "engine_core_num_requests_running" not in metrics.text


# -- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("keep_alive_timeout_s", 0),
        ("header_timeout_s", -1.0),
        ("body_timeout_s", float("inf")),
        ("shutdown_timeout_s", float("nan")),
        ("max_connections", 0),
    ],
)
def test_limits_are_validated(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        ServerSettings(**{name: value})  # type: ignore[arg-type]


def test_the_default_connection_limit_fits_the_file_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limits = {256: (256 - 64) * 7 // 8, 1024: (1024 - 64) * 7 // 8, 80: 16}
    for soft, expected in limits.items():
        monkeypatch.setattr(resource, "getrlimit", lambda _, soft=soft: (soft, 1 << 20))
        assert default_max_connections() == expected
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY,) * 2)
    assert default_max_connections() == ((1 << 20) - 64) * 7 // 8


# -- the real process: signals, exit status ------------------------------------------------------


@contextlib.contextmanager
def serve_process(
    runtime: str, *flags: str, nofile: int | None = None
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``engine-core serve`` over the mock in a subprocess, and its URL."""

    def limit_files() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with server_process(
        ["--port", "0", *MOCK, "--runtime", runtime, "--log-level", "warning", *flags],
        start_timeout_s=60,
        stop_grace_s=None,
        preexec_fn=limit_files,
    ) as served:
        yield served


def stream_in_thread(url: str, body: dict[str, Any]) -> tuple[list[str], Any]:
    """Start a streamed completion in a thread; (its ``data:`` lines as they come, the thread)."""
    import threading

    events: list[str] = []

    def run() -> None:
        with (
            httpx.Client(base_url=url, timeout=30) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return events, thread


def wait_for(condition: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_serve_with_few_files_serves_under_idle_connections(runtime: str) -> None:
    """With 256 files at most and 300 idle connections open, requests are still served."""
    with serve_process(runtime, nofile=256) as (url, process):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(300)]
        try:
            with httpx.Client(base_url=url, timeout=5) as client:
                for _ in range(5):
                    response = client.post("/v1/completions", json=completion(4, False))
                    assert response.status_code == 200, response.text
        finally:
            for connection in idle:
                connection.close()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
@pytest.mark.parametrize("end", ["shutdown timeout", "second signal"])
def test_serve_on_sigterm_lets_streams_finish_then_ends_them(runtime: str, end: str) -> None:
    """On SIGTERM a short stream finishes; a long one ends with an error event and
    ``data: [DONE]`` past --shutdown-timeout, or at a second signal; the process exits 0."""
    timeout = "1" if end == "shutdown timeout" else "60"
    flags = ["--shutdown-timeout", timeout, "--backend-options", json.dumps(SLOW_STEPS)]
    with serve_process(runtime, *flags) as (url, process):
        short, short_thread = stream_in_thread(url, completion(30, True))
        long, long_thread = stream_in_thread(url, completion(3000, True))
        wait_for(lambda: short and long, timeout=10)
        process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        short_thread.join(10)
        if end == "second signal":
            assert long_thread.is_alive()
            process.send_signal(signal.SIGINT)
        long_thread.join(10)
        assert process.wait(timeout=10) == 0
        assert time.monotonic() - start < 8
    assert short[-1] == "[DONE]"
    assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]"
    assert json.loads(long[-2])["error"]["code"] == "server_shutting_down"


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_serve_exits_when_the_engine_dies(runtime: str) -> None:
    options = {"fault": {"kind": "exit", "at_step": 30}, **SLOW_STEPS}
    with serve_process(runtime, "--backend-options", json.dumps(options)) as (url, process):
        events, thread = stream_in_thread(url, completion(1000, True))
        thread.join(15)
        assert process.wait(timeout=10) == ENGINE_DEAD_EXIT_CODE
        assert process.stderr is not None
        assert "the engine died" in process.stderr.read()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_dead"
