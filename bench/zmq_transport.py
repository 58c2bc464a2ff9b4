#!/usr/bin/env python3
"""Round-trip latency of the ways an anyio program can wait on a ZMQ socket or a Unix stream
socket, and of the engine over either.

Part 1, transport. An echo process (blocking PULL -> PUSH over ``ipc://``) sends back every
message; the client sends a small message and waits for the echo, one at a time. Variants:

- ``sync``: blocking ``send``/``recv`` in plain Python: the floor;
- ``fd-wait``: non-blocking ``recv`` and ``anyio.wait_readable`` on the socket's ``zmq.FD``
  (edge-triggered: try ``recv`` first, wait only on ``EAGAIN``), under asyncio and trio: what
  ``engine_core._engine.pipes.addresses`` does;
- ``to-thread``: a blocking ``recv`` in ``anyio.to_thread.run_sync`` per message;
- ``reader-thread``: one thread blocks in ``recv`` and hands each message to the event loop with
  ``anyio.from_thread.run_sync`` into a memory stream;
- ``to_thread hop``: ``anyio.to_thread.run_sync`` of a no-op, which the engine pays per step;
- ``echo in an event loop``: ``fd-wait [asyncio]`` against an echo process that itself waits
  with ``anyio.wait_readable`` (as the engine-core process does) under asyncio, asyncio on
  uvloop, and trio, instead of blocking in ``recv``;
- ``unix socket``: the same echo over a plain Unix stream socket (no ZMQ I/O threads), blocking
  and with ``anyio.wait_readable``: what the round trip costs without ZMQ's thread hops (a ZMQ
  message crosses two I/O threads each way, a socket message none);
- ``pipes``: the engine's own Unix stream pipes (``engine_core._engine.pipes.unix``: framed
  messages, the reader waiting on its epoll descriptor) with both ends in event loops, the echo
  under asyncio, uvloop and trio;
- ``anyio streams``: the same echo with anyio's own Unix socket streams (``connect_unix``,
  ``create_unix_listener``) on both ends, each under the one runtime.

Part 2, engine. ``MPClient`` with the zero-latency mock backend: ``add_request`` of a
``max_tokens=1`` request until its output arrives, for each engine runtime and client kind, over
the Unix stream pipes (the default) and over ZMQ ``ipc://`` sockets.

The variants run interleaved over ``--rounds`` rounds; each line reports the median over rounds
of the per-round p50, and the p99 of all samples, in microseconds.

Usage: ``python bench/zmq_transport.py [--n 5000] [--rounds 3] [--size 64] [--no-engine]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import multiprocessing
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import zmq

from engine_core._bench.machine import machine_line
from engine_core._core.engine_io import EngineCoreRequest
from engine_core._engine.mp.client import MPClient
from engine_core._engine.pipes.addresses import TransportKind as PipeTransport
from engine_core._engine.pipes.addresses import recv_async
from engine_core._engine.pipes.unix import StreamReceiver, StreamSender
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams

_STOP = b"stop"
Samples = list[float]


def _echo(down: str, up: str, loop: str | None = None) -> None:
    """Echo until ``_STOP``, blocking in ``recv`` or (``loop``: "asyncio", "uvloop", "trio")
    waiting in an event loop."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(down)
    push = ctx.socket(zmq.PUSH)
    push.bind(up)

    async def serve() -> None:
        while (msg := await recv_async(pull)) != _STOP:
            push.send(msg)

    if loop is None:
        while (msg := pull.recv()) != _STOP:
            push.send(msg)
    elif loop == "uvloop":
        anyio.run(serve, backend="asyncio", backend_options={"use_uvloop": True})
    else:
        anyio.run(serve, backend=loop)
    pull.close(0)
    push.close(0)
    ctx.term()


def _echo_unix(path: str, size: int) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    while (msg := _recv_exactly(sock, size)) != _STOP.ljust(size, b"\0"):
        sock.sendall(msg)
    sock.close()


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the echo process closed the socket")
        data += chunk
    return data


def _run_in(loop: str, fn: Callable[[], Awaitable[None]]) -> None:
    if loop == "uvloop":
        anyio.run(fn, backend="asyncio", backend_options={"use_uvloop": True})
    else:
        anyio.run(fn, backend=loop)


def _connect_sender(address: str) -> StreamSender:
    """Connect once the peer listens (it binds after it started)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return StreamSender(address, bounded=True)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _echo_pipes(down: str, up: str, loop: str) -> None:
    """Echo over the engine's pipes until ``_STOP``, waiting in an event loop."""
    receiver = StreamReceiver(down)
    sender = _connect_sender(up)

    async def serve() -> None:
        while (msg := await receiver.recv()) != _STOP:
            await sender.send(msg)

    _run_in(loop, serve)
    receiver.close()
    sender.close()


class PipesTransport:
    """The client's ends of the engine's pipes to an echo process."""

    def __init__(self, directory: str, loop: str, payload: bytes, n: int) -> None:
        down, up = f"unix://{directory}/pipes-down-{loop}", f"unix://{directory}/pipes-up-{loop}"
        self.receiver = StreamReceiver(up)
        self.echo = multiprocessing.get_context("spawn").Process(
            target=_echo_pipes, args=(down, up, loop)
        )
        self.echo.start()
        self.sender = _connect_sender(down)
        self.payload, self.n = payload, n

    def close(self) -> None:
        self.sender.send_blocking(_STOP)
        self.echo.join()
        self.sender.close()
        self.receiver.close()

    async def fd_wait(self) -> Samples:
        out = []
        for _ in range(self.n):
            t0 = time.perf_counter()
            self.sender.send_nowait(self.payload)
            await self.receiver.recv()
            out.append(time.perf_counter() - t0)
        return out


def _echo_anyio(path: str, runtime: str, size: int) -> None:
    async def serve() -> None:
        listener = await anyio.create_unix_listener(path)
        stream = await listener.accept()
        async with stream, listener:
            while True:
                msg = await _receive_exactly(stream, size)
                if msg == _STOP.ljust(size, b"\0"):
                    return
                await stream.send(msg)

    anyio.run(serve, backend=runtime)


async def _receive_exactly(stream: anyio.abc.ByteStream, size: int) -> bytes:
    data = b""
    while len(data) < size:
        data += await stream.receive(size - len(data))
    return data


class AnyioStreams:
    """An echo process over anyio's Unix socket streams, both ends under ``runtime``."""

    def __init__(self, directory: str, runtime: str, payload: bytes, n: int) -> None:
        self.path = f"{directory}/anyio-{runtime}"
        self.runtime, self.payload, self.n = runtime, payload, n
        self.echo = multiprocessing.get_context("spawn").Process(
            target=_echo_anyio, args=(self.path, runtime, len(payload))
        )
        self.echo.start()

    async def _connect(self) -> anyio.abc.SocketStream:
        deadline = time.monotonic() + 10
        while True:
            try:
                return await anyio.connect_unix(self.path)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                await anyio.sleep(0.01)

    def run_all(self, rounds: int) -> list[Samples]:
        """Every round's samples, in one connection and one event loop."""

        async def main() -> list[Samples]:
            stream = await self._connect()
            size = len(self.payload)
            results = []
            async with stream:
                for _ in range(rounds + 1):  # the first is the warm-up
                    out = []
                    for _ in range(self.n):
                        t0 = time.perf_counter()
                        await stream.send(self.payload)
                        await _receive_exactly(stream, size)
                        out.append(time.perf_counter() - t0)
                    results.append(out)
                await stream.send(_STOP.ljust(size, b"\0"))
            return results[1:]

        results: list[Samples] = anyio.run(main, backend=self.runtime)
        self.echo.join()
        return results


class UnixTransport:
    """An echo process over a plain Unix stream socket (fixed-size messages)."""

    def __init__(self, path: str, payload: bytes, n: int) -> None:
        self.payload, self.n = payload, n
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        self.echo = multiprocessing.get_context("spawn").Process(
            target=_echo_unix, args=(path, len(payload))
        )
        self.echo.start()
        self.sock, _ = listener.accept()
        listener.close()

    def close(self) -> None:
        self.sock.setblocking(True)
        self.sock.sendall(_STOP.ljust(len(self.payload), b"\0"))
        self.sock.close()
        self.echo.join()

    def sync(self) -> Samples:
        self.sock.setblocking(True)
        out = []
        for _ in range(self.n):
            t0 = time.perf_counter()
            self.sock.sendall(self.payload)
            _recv_exactly(self.sock, len(self.payload))
            out.append(time.perf_counter() - t0)
        return out

    async def fd_wait(self) -> Samples:
        sock, size = self.sock, len(self.payload)
        sock.setblocking(False)
        out = []
        for _ in range(self.n):
            t0 = time.perf_counter()
            sock.send(self.payload)  # a small message fits the empty socket buffer
            received = 0
            while received < size:
                try:
                    received += len(sock.recv(size - received))
                except BlockingIOError:
                    await anyio.wait_readable(sock)
            out.append(time.perf_counter() - t0)
        return out


class Transport:
    """The client's two sockets to the echo process, and the variants measured on them."""

    def __init__(self, down: str, up: str, payload: bytes, n: int) -> None:
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(down)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(up)
        self.down, self.up, self.payload, self.n = down, up, payload, n

    def close(self) -> None:
        self.push.send(_STOP)
        self.push.close()
        self.pull.close(0)
        self.ctx.term()

    def sync(self) -> Samples:
        out = []
        for _ in range(self.n):
            t0 = time.perf_counter()
            self.push.send(self.payload)
            self.pull.recv()
            out.append(time.perf_counter() - t0)
        return out

    async def _timed(self, recv: Callable[[], Awaitable[bytes]]) -> Samples:
        out = []
        for _ in range(self.n):
            t0 = time.perf_counter()
            self.push.send(self.payload)
            await recv()
            out.append(time.perf_counter() - t0)
        return out

    async def fd_wait(self) -> Samples:
        return await self._timed(lambda: recv_async(self.pull))

    async def to_thread(self) -> Samples:
        return await self._timed(lambda: anyio.to_thread.run_sync(self.pull.recv))

    async def reader_thread(self) -> Samples:
        send, receive = anyio.create_memory_object_stream[bytes](self.n)
        token = anyio.lowlevel.current_token()

        def reader() -> None:
            for _ in range(self.n):
                anyio.from_thread.run_sync(send.send_nowait, self.pull.recv(), token=token)

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            return await self._timed(receive.receive)
        finally:
            thread.join()

    async def hop(self) -> Samples:
        out = []
        for _ in range(self.n):
            t0 = time.perf_counter()
            await anyio.to_thread.run_sync(int)
            out.append(time.perf_counter() - t0)
        return out


class Engine:
    """``add_request`` -> first output through ``MPClient`` and the mock backend."""

    def __init__(self, runtime: str, n: int, transport: PipeTransport = "ipc") -> None:
        self.client = MPClient(
            EngineConfig(backend="mock", num_kv_blocks=256, engine_runtime=runtime),  # type: ignore[arg-type]
            transport=transport,
        )
        self.transport = transport
        self.params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        self.ids = itertools.count()
        self.n = n

    def _request(self) -> EngineCoreRequest:
        return EngineCoreRequest(f"r{next(self.ids)}", [1, 2, 3], self.params)

    def sync(self) -> Samples:
        out = []
        for _ in range(self.n):
            t0 = time.perf_counter()
            self.client.add_request(self._request())
            self.client.get_output()
            out.append(time.perf_counter() - t0)
        return out

    async def run_async(self) -> Samples:
        out = []
        for _ in range(self.n):
            t0 = time.perf_counter()
            self.client.add_request(self._request())
            await self.client.get_output_async()
            out.append(time.perf_counter() - t0)
        return out


def _measure(variants: dict[str, Callable[[], Samples]], rounds: int) -> list[str]:
    p50s: dict[str, list[float]] = {name: [] for name in variants}
    pooled: dict[str, Samples] = {name: [] for name in variants}
    for run in variants.values():  # warm-up
        run()
    for _ in range(rounds):
        for name, run in variants.items():
            samples = run()
            p50s[name].append(statistics.median(samples))
            pooled[name] += samples
    return [_line(name, [pooled[name]], p50s[name]) for name in variants]


def _line(name: str, rounds: list[Samples], p50s: list[float] | None = None) -> str:
    """The median of the rounds' p50s and the p99 of every sample."""
    if p50s is None:
        p50s = [statistics.median(samples) for samples in rounds]
    pooled = sorted(itertools.chain.from_iterable(rounds))
    p99 = pooled[int(len(pooled) * 0.99)]
    return f"{name:<38} p50 {statistics.median(p50s) * 1e6:7.1f} us   p99 {p99 * 1e6:7.1f} us"


def _in(runtime: str, fn: Callable[[], Awaitable[Samples]]) -> Callable[[], Samples]:
    return lambda: anyio.run(fn, backend=runtime)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--n", type=int, default=5000, help="round trips per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=64, help="message size in bytes")
    parser.add_argument("--no-engine", action="store_true", help="skip part 2")
    args = parser.parse_args()
    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}" for name in ("pyzmq", "anyio", "trio")
    )
    print(machine_line())
    print(
        f"config: {args.n} round trips x {args.rounds} rounds per variant, {args.size}-byte "
        f"messages, ipc://, libzmq {zmq.zmq_version()}, {versions}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        down, up = f"ipc://{tmp}/down", f"ipc://{tmp}/up"
        echo = multiprocessing.get_context("spawn").Process(target=_echo, args=(down, up))
        echo.start()
        t = Transport(down, up, os.urandom(args.size), args.n)
        variants: dict[str, Callable[[], Samples]] = {"sync (floor)": t.sync}
        for runtime in ("asyncio", "trio"):
            variants[f"fd-wait [{runtime}]"] = _in(runtime, t.fd_wait)
            variants[f"to-thread [{runtime}]"] = _in(runtime, t.to_thread)
            variants[f"reader-thread [{runtime}]"] = _in(runtime, t.reader_thread)
        for runtime in ("asyncio", "trio"):
            variants[f"to_thread no-op hop [{runtime}]"] = _in(runtime, t.hop)
        looped = []
        for loop in ("asyncio", "uvloop", "trio"):
            l_down, l_up = f"ipc://{tmp}/down-{loop}", f"ipc://{tmp}/up-{loop}"
            process = multiprocessing.get_context("spawn").Process(
                target=_echo, args=(l_down, l_up, loop)
            )
            process.start()
            looped.append((process, Transport(l_down, l_up, os.urandom(args.size), args.n)))
            variants[f"fd-wait [asyncio], {loop} echo"] = _in("asyncio", looped[-1][1].fd_wait)
        u = UnixTransport(f"{tmp}/unix", os.urandom(args.size), args.n)
        variants["unix socket, sync"] = u.sync
        for runtime in ("asyncio", "trio"):
            variants[f"unix socket, fd-wait [{runtime}]"] = _in(runtime, u.fd_wait)
        pipes = []
        for loop in ("asyncio", "uvloop", "trio"):
            pipes.append(PipesTransport(tmp, loop, os.urandom(args.size), args.n))
            for runtime in ("asyncio", "trio"):
                variants[f"pipes [{runtime}], {loop} echo"] = _in(runtime, pipes[-1].fd_wait)
        print("part 1: transport round trip")
        try:
            for line in _measure(variants, args.rounds):
                print("  " + line)
            for runtime in ("asyncio", "trio"):
                rounds = AnyioStreams(tmp, runtime, os.urandom(args.size), args.n).run_all(
                    args.rounds
                )
                print("  " + _line(f"anyio streams [{runtime}], {runtime} echo", rounds))
        finally:
            for p in pipes:
                p.close()
            u.close()
            t.close()
            echo.join()
            for process, transport in looped:
                transport.close()
                process.join()
    if args.no_engine:
        return
    print("part 2: MPClient add_request -> first output (mock backend, max_tokens=1)")
    engines = [
        Engine(runtime, args.n, transport)
        for transport in ("ipc", "zmq-ipc")
        for runtime in ("asyncio", "trio")
    ]
    try:
        variants = {}
        for engine in engines:
            runtime = engine.client.config.engine_runtime
            pipe = "unix" if engine.transport == "ipc" else "zmq"
            variants[f"{pipe}: engine {runtime}, sync client"] = engine.sync
            for client_runtime in ("asyncio", "trio"):
                variants[f"{pipe}: engine {runtime}, {client_runtime} client"] = _in(
                    client_runtime, engine.run_async
                )
        for line in _measure(variants, args.rounds):
            print("  " + line)
    finally:
        for engine in engines:
            engine.client.shutdown()


if __name__ == "__main__":
    main()
