"""The load generator of ``engine-core bench serve``: streaming requests against an
OpenAI-compatible server, with per-request timings.

It speaks plain HTTP/1.1 over asyncio transports (keep-alive, chunked or sized bodies) and
parses server-sent events itself, in the transport's callbacks: a benchmark client must cost far
less than the server it measures, and general-purpose clients spend tens of microseconds per
event. One connection per concurrent worker; ``http://`` only; runs under asyncio (the server it
measures may run on either runtime).

Timings: TTFT is the time from sending a request to the first event carrying text; each later
event carrying text adds one inter-token latency (ITL) sample (a server that sends several
tokens in one event gives one sample for them, as vLLM's benchmark counts it). Output tokens
come from the usage the server reports (``stream_options.include_usage``).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import msgspec

__all__ = ["LoadResult", "RequestResult", "percentile", "random_token_prompts", "run_load"]

Endpoint = Literal["chat", "completions"]


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict[str, Any] | None = None


_DECODER = msgspec.json.Decoder(_Chunk)


@dataclass(slots=True)
class RequestResult:
    """One request's outcome and timings (seconds)."""

    ok: bool
    latency: float
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by the nearest-rank method; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]


@dataclass
class LoadResult:
    """What a load run measured."""

    results: list[RequestResult]
    elapsed: float

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def num_failed(self) -> int:
        return len(self.results) - len(self.ok)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.ok)

    def summary(self) -> dict[str, float]:
        """Request/s, output tok/s, and TTFT, ITL and latency percentiles in milliseconds."""
        ok = self.ok
        ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
        itls = [x * 1e3 for r in ok for x in r.itls]
        latencies = [r.latency * 1e3 for r in ok]
        row: dict[str, float] = {
            "requests": len(self.results),
            "failed": self.num_failed,
            "elapsed_s": self.elapsed,
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
            "output_tokens": self.output_tokens,
            "request_per_s": len(ok) / self.elapsed if self.elapsed else 0.0,
            "output_tok_per_s": self.output_tokens / self.elapsed if self.elapsed else 0.0,
            "mean_latency_ms": statistics.fmean(latencies) if latencies else float("nan"),
        }
        for name, values in (("ttft", ttfts), ("itl", itls)):
            for q in (50, 90, 99):
                row[f"{name}_p{q}_ms"] = percentile(values, q / 100)
        return row


class _ResponseParser:
    """An incremental HTTP/1.1 response parser: ``feed`` bytes as they arrive; body bytes go to
    ``on_body`` (chunked, sized, or up to the end of the connection); ``done`` at the end."""

    __slots__ = ("on_body", "buffer", "state", "remaining", "status", "close", "done")

    def __init__(self, on_body: Callable[[bytes], None]) -> None:
        self.on_body = on_body
        self.buffer = b""
        self.state = "head"
        self.remaining = 0
        self.status = 0
        self.close = False
        self.done = False

    def feed(self, data: bytes) -> None:
        self.buffer = self.buffer + data if self.buffer else data
        while not self.done and self.buffer:
            if not self._step():
                return

    def _step(self) -> bool:
        """Advance once; False when more bytes are needed."""
        buffer = self.buffer
        state = self.state
        if state == "head":
            index = buffer.find(b"\r\n\r\n")
            if index < 0:
                return False
            self._head(buffer[:index].decode("latin-1").split("\r\n"))
            self.buffer = buffer[index + 4 :]
        elif state == "size":
            index = buffer.find(b"\r\n")
            if index < 0:
                return False
            size = int(buffer[:index].split(b";")[0], 16)
            self.buffer = buffer[index + 2 :]
            self.state, self.remaining = ("trailer", 0) if size == 0 else ("chunk", size + 2)
        elif state == "chunk":
            if len(buffer) < self.remaining:
                return False
            self.on_body(buffer[: self.remaining - 2])
            self.buffer = buffer[self.remaining :]
            self.state = "size"
        elif state == "trailer":
            index = buffer.find(b"\r\n")
            if index < 0:
                return False
            self.buffer = buffer[index + 2 :]
            self.done = index == 0
        elif state == "sized":
            if len(buffer) < self.remaining:
                return False
            self.on_body(buffer[: self.remaining])
            self.buffer = buffer[self.remaining :]
            self.done = True
        else:  # "until-eof"
            self.on_body(buffer)
            self.buffer = b""
        return True

    def _head(self, lines: list[str]) -> None:
        self.status = int(lines[0].split(" ", 2)[1])
        fields = {
            k.strip().lower(): v.strip().lower()
            for k, _, v in (x.partition(":") for x in lines[1:])
        }
        self.close = fields.get("connection") == "close"
        if fields.get("transfer-encoding") == "chunked":
            self.state = "size"
        elif "content-length" in fields:
            self.state, self.remaining = "sized", int(fields["content-length"])
            self.done = self.remaining == 0
        else:
            self.state, self.close = "until-eof", True

    def eof(self) -> None:
        if self.state == "until-eof":
            self.done = True


class _Protocol(asyncio.Protocol):
    """One keep-alive connection; one response parsed at a time, in the loop's callbacks."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser: _ResponseParser | None = None
        self.waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP transport

    def data_received(self, data: bytes) -> None:
        parser, waiter = self.parser, self.waiter
        if parser is None or waiter is None or waiter.done():
            return
        try:
            parser.feed(data)
        except Exception as exc:  # a malformed response fails this request
            waiter.set_exception(exc)
            return
        if parser.done:
            waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        parser, waiter = self.parser, self.waiter
        if parser is None or waiter is None or waiter.done():
            return
        parser.eof()
        if parser.done:
            waiter.set_result(None)
        else:
            waiter.set_exception(ConnectionError("the server closed the connection"))


class _Connection:
    """A keep-alive HTTP/1.1 connection (asyncio transports: no per-read syscalls besides the
    reads themselves)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.protocol: _Protocol | None = None

    def close(self) -> None:
        if self.protocol is not None and self.protocol.transport is not None:
            self.protocol.transport.close()
        self.protocol = None

    async def post(
        self, path: str, body: bytes, headers: dict[str, str], on_body: Callable[[bytes], None]
    ) -> int:
        """Send a POST and feed the response body to ``on_body`` as it arrives; the status."""
        loop = asyncio.get_running_loop()
        if self.protocol is None or self.protocol.transport is None:
            # The transport is taken from here: uvloop's is no asyncio.Transport subclass.
            connected, self.protocol = await loop.create_connection(_Protocol, self.host, self.port)
            self.protocol.transport = connected
        protocol = self.protocol
        transport = protocol.transport
        assert transport is not None
        parser = protocol.parser = _ResponseParser(on_body)
        protocol.waiter = loop.create_future()
        lines = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        lines.append(f"Content-Length: {len(body)}")
        transport.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        try:
            await protocol.waiter
        finally:
            protocol.parser = protocol.waiter = None
        if parser.close:
            self.close()
        return parser.status


class _EventParser:
    """Splits a response body into SSE ``data:`` events and times the ones carrying text."""

    __slots__ = ("start", "buffer", "result", "last", "raw")

    def __init__(self, start: float) -> None:
        self.start = start
        self.buffer = b""
        self.result = RequestResult(ok=False, latency=0.0)
        self.last: float | None = None
        self.raw = b""

    def feed(self, data: bytes) -> None:
        now = time.perf_counter()
        self.raw = data if len(self.raw) > 4096 else self.raw + data
        buffer = self.buffer + data if self.buffer else data
        events = buffer.split(b"\n\n")
        self.buffer = events.pop()
        for event in events:
            if event.startswith(b"data: "):
                self._event(event[6:], now)

    def _event(self, data: bytes, now: float) -> None:
        if data == b"[DONE]":
            return
        chunk = _DECODER.decode(data)
        result = self.result
        if chunk.error is not None:
            result.error = str(chunk.error.get("message", chunk.error))
        if chunk.usage is not None:
            result.prompt_tokens = chunk.usage.prompt_tokens
            result.output_tokens = chunk.usage.completion_tokens
        if any(c.text or (c.delta is not None and c.delta.content) for c in chunk.choices):
            if self.last is None:
                result.ttft = now - self.start
            else:
                result.itls.append(now - self.last)
            self.last = now


Prompt = str | list[int]
"""A prompt as text, or as token ids (``/v1/completions`` only)."""


def _request_body(
    endpoint: Endpoint,
    model: str | None,
    prompt: Prompt,
    max_tokens: int,
    extra: dict[str, Any],
    ignore_eos: bool = True,
) -> bytes:
    body: dict[str, Any] = {
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        **extra,
    }
    if model is not None:
        body["model"] = model
    if endpoint == "chat":
        if not isinstance(prompt, str):
            raise ValueError("the chat endpoint takes text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return msgspec.json.encode(body)


async def run_load(
    url: str,
    *,
    endpoint: Endpoint = "chat",
    num_requests: int,
    concurrency: int,
    prompt: Prompt | Sequence[Prompt],
    max_tokens: int,
    model: str | None = None,
    api_key: str | None = None,
    extra_body: dict[str, Any] | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
    timeout_s: float = 600.0,
    ignore_eos: bool = True,
) -> LoadResult:
    """Send ``num_requests`` streaming requests, ``concurrency`` at a time, to the server at
    ``url`` (``http://host:port``, optionally with a path prefix such as ``/v1``'s parent).
    ``prompt``: one prompt for every request, or a list of them, request ``i`` taking
    prompt ``i`` modulo their number."""
    if num_requests < 1 or concurrency < 1:
        raise ValueError("num_requests and concurrency must be >= 1")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http" or parsed.hostname is None:
        raise ValueError(f"url must be http://host[:port], got {url!r}")
    path = parsed.path.rstrip("/") + (
        "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    )
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    prompts = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else list(prompt)
    if not prompts:
        raise ValueError("prompt must not be an empty list")
    bodies = [
        _request_body(endpoint, model, p, max_tokens, extra_body or {}, ignore_eos)  # type: ignore[arg-type]
        for p in prompts
    ]
    results: list[RequestResult] = []
    remaining = iter(range(num_requests))

    async def worker() -> None:
        connection = _Connection(parsed.hostname or "127.0.0.1", parsed.port or 80)
        try:
            for index in remaining:
                body = bodies[index % len(bodies)]
                results.append(await _one(connection, path, body, headers))
                if on_done is not None:
                    on_done(results[-1])
        finally:
            connection.close()

    start = time.perf_counter()
    with anyio.fail_after(timeout_s):
        async with anyio.create_task_group() as task_group:
            for _ in range(min(concurrency, num_requests)):
                task_group.start_soon(worker)
    return LoadResult(results, time.perf_counter() - start)


def _is_ids(prompt: object) -> bool:
    return isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and bool(prompt)


def random_token_prompts(
    vocabulary: Sequence[int], num_prompts: int, length: int, seed: int = 0
) -> list[list[int]]:
    """``num_prompts`` prompts of ``length`` token ids drawn (seeded) from ``vocabulary``, as
    ``vllm bench serve``'s random dataset makes them (each prompt its own, so no prefix is
    shared)."""
    if length < 1 or not vocabulary:
        raise ValueError("random prompts need a length >= 1 and a vocabulary")
    rng = random.Random(seed)
    return [rng.choices(vocabulary, k=length) for _ in range(num_prompts)]


async def _one(
    connection: _Connection, path: str, body: bytes, headers: dict[str, str]
) -> RequestResult:
    start = time.perf_counter()
    parser = _EventParser(start)
    try:
        status = await connection.post(path, body, headers, parser.feed)
    except (OSError, ValueError, msgspec.DecodeError) as exc:
        connection.close()
        return RequestResult(ok=False, latency=time.perf_counter() - start, error=repr(exc))
    result = parser.result
    result.latency = time.perf_counter() - start
    if status != 200:
        result.error = f"HTTP {status}: {parser.raw[:300].decode(errors='replace')}"
    result.ok = result.error is None and result.ttft is not None
    if not result.ok and result.error is None:
        result.error = "no text was streamed"
    return result
