#!/usr/bin/env python3
"""Normal streaming clients next to hostile ones: what abuse costs the well-behaved.

``engine-core serve`` (mock backend, ``--step-ms`` per step, byte tokenizer, engine core in its
own process) in a subprocess; ``--clients`` normal clients stream chat completions of
``--max-tokens`` tokens back to back (the load generator of ``engine-core bench serve``, in this
process). Three runs of ``--duration`` seconds against the same server:

1. clean: the normal clients alone;
2. hostile: the same, while ``--hostile`` clients (in another process, so their work does not
   slow this one's event loop) each cycle through the hostile cases as fast as the server
   answers them: a huge ``n``, JSON nested 100,000 levels deep, integers beyond 64 bits,
   headers sent a line at a time and never finished (held ``--hold-s``), an idle connection
   (held ``--hold-s``), and a stream dropped after its first events;
3. clean again: whether the server recovered.

Reported per run: the normal streams' output tok/s, TTFT and ITL percentiles, failures, and the
server's peak RSS (``VmHWM`` of its front end and of its engine core; a peak only grows);
for the hostile run, what each hostile case got back. Targets: throughput >= 0.9x and TTFT p99
<= 2x the clean runs' mean; no 5xx; memory bounded. The server runs with its default timeouts
and connection limit, which cut the slow and idle connections the hostile clients hold.

Usage: ``python bench/bench_abuse.py [--runtime asyncio|trio] [--duration 15] [--clients 256]
[--hostile 50] [--max-tokens 64] [--step-ms 10] [--hold-s 30] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.parse
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from engine_core._bench.client import (
    LoadResult,
    RequestResult,
    _Connection,
    _one,
    _request_body,
)
from engine_core._bench.machine import machine_line
from engine_core._bench.server_process import server_process
from engine_core._frontend.runtime import run_options
from engine_core.server import ServerSettings
from engine_core.server._run import http_server_for

PROMPT = "Tell me about the quick brown fox."
MODEL = "bench"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


# -- the server ----------------------------------------------------------------------------------


def server_flags(args: argparse.Namespace) -> list[str]:
    """``engine-core serve``'s flags: the mock on a free loopback port, its engine core in its
    own process."""
    latency = {"latency": {"step_s": args.step_ms / 1000}} if args.step_ms else {}
    return [
        "--backend", "mock", "--tokenizer", "byte", "--port", "0",
        "--max-num-seqs", str(args.clients + args.hostile), "--served-model-name", MODEL,
        "--runtime", args.runtime, "--log-level", "error", "--multiprocess",
        "--backend-options", json.dumps(latency),
    ]  # fmt: skip


def _status_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _children(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # The parent pid follows the command name, which may hold spaces.
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        children.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return children


def peak_rss_mib(pid: int) -> tuple[float | None, float | None]:
    """``VmHWM`` of the server's process and of its biggest child (the engine core), in MiB."""
    front = _status_kib(pid, "VmHWM")
    children = [_status_kib(child, "VmHWM") or 0 for child in _children(pid)]
    return (
        front / 1024 if front is not None else None,
        max(children) / 1024 if children else None,
    )


# -- normal clients ------------------------------------------------------------------------------


async def normal_load(url: str, args: argparse.Namespace, duration: float) -> LoadResult:
    """``--clients`` streaming chat clients, each sending requests back to back until
    ``duration`` has passed (the requests in flight then are let finish)."""
    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    body = _request_body("chat", MODEL, PROMPT, args.max_tokens, {})
    results: list[RequestResult] = []
    deadline = time.perf_counter() + duration

    async def worker() -> None:
        connection = _Connection(host, port)
        try:
            while time.perf_counter() < deadline:
                results.append(await _one(connection, CHAT, body, headers))
        finally:
            connection.close()

    start = time.perf_counter()
    with anyio.fail_after(duration + 120):
        async with anyio.create_task_group() as task_group:
            for _ in range(args.clients):
                task_group.start_soon(worker)
    return LoadResult(results, time.perf_counter() - start)


# -- hostile clients (in their own process) ------------------------------------------------------


def _request(path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _chat(**fields: Any) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": PROMPT}], **fields}).encode()


HUGE_N = [
    _request(CHAT, _chat(n=10**9, temperature=1.0, stream=True)),
    _request(CHAT, _chat(n=129, temperature=1.0)),
    _request(COMPLETIONS, json.dumps({"prompt": ["a"] * 5000, "n": 128}).encode()),
]
DEEP = 100_000
DEEP_JSON = [
    _request(CHAT, b'{"messages": [], "x": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    _request(CHAT, b'{"messages": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}"),
]
HUGE_INTS = [
    _request(CHAT, _chat(max_tokens=10**30)),
    _request(CHAT, _chat(top_k=2**70)),
    _request(CHAT, _chat(seed=-(2**70))),
    _request(CHAT, _chat(priority=2**64)),
    _request(CHAT, _chat(stop_token_ids=[1, 2**70])),
    _request(COMPLETIONS, json.dumps({"prompt": [1, 2, 10**40]}).encode()),
    _request(CHAT, _chat(min_tokens=10**6)),
]


async def _read_status(reader: asyncio.StreamReader) -> int:
    """The response's status; reads it to its end (the server closes the connection)."""
    line = await reader.readline()
    status = int(line.split()[1]) if line.startswith(b"HTTP/") else 0
    while await reader.read(65536):
        pass
    return status


async def _exchange(host: str, port: int, request: bytes) -> str:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        return str(await _read_status(reader))
    finally:
        writer.close()


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server closes the connection (or answers and closes) within ``seconds``."""
    try:
        await asyncio.wait_for(reader.read(), seconds)
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


async def _slow_headers(host: str, port: int, hold_s: float) -> str:
    """Headers a line a second, never finished, for up to ``hold_s``."""
    reader, writer = await asyncio.open_connection(host, port)
    began = time.monotonic()
    try:
        writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: bench\r\n".encode())
        for index in range(int(hold_s)):
            if await _closed_within(reader, 1.0):
                return f"closed by the server after {time.monotonic() - began:.0f} s"
            writer.write(f"X-Slow-{index}: {'x' * 20}\r\n".encode())
            await writer.drain()
        return "held"
    except OSError:
        return f"closed by the server after {time.monotonic() - began:.0f} s"
    finally:
        writer.close()


async def _idle(host: str, port: int, hold_s: float) -> str:
    """A connection that sends nothing, for up to ``hold_s``."""
    reader, writer = await asyncio.open_connection(host, port)
    began = time.monotonic()
    try:
        if await _closed_within(reader, hold_s):
            return f"closed by the server after {time.monotonic() - began:.0f} s"
        return "held"
    finally:
        writer.close()


async def _drop_stream(host: str, port: int) -> str:
    """A long stream dropped after its first two events."""
    body = _chat(max_tokens=4000, stream=True, ignore_eos=True, temperature=0.0)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(_request(CHAT, body))
        line = await reader.readline()
        status = line.split()[1].decode() if line.startswith(b"HTTP/") else "0"
        events = 0
        while events < 2:
            chunk = await reader.readline()
            if not chunk:
                break
            events += chunk.startswith(b"data: ")
        return status
    finally:
        writer.close()


async def hostile_load(url: str, clients: int, duration: float, hold_s: float) -> dict[str, Any]:
    parsed = urllib.parse.urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    cases: list[tuple[str, Callable[[int], Awaitable[str]]]] = [
        ("huge n", lambda i: _exchange(host, port, HUGE_N[i % len(HUGE_N)])),
        ("deep JSON", lambda i: _exchange(host, port, DEEP_JSON[i % len(DEEP_JSON)])),
        ("huge ints", lambda i: _exchange(host, port, HUGE_INTS[i % len(HUGE_INTS)])),
        ("slow headers", lambda i: _slow_headers(host, port, hold_s)),
        ("idle connection", lambda i: _idle(host, port, hold_s)),
        ("dropped stream", lambda i: _drop_stream(host, port)),
    ]
    outcomes: dict[str, Counter[str]] = defaultdict(Counter)
    seconds: dict[str, list[float]] = defaultdict(list)
    deadline = time.perf_counter() + duration

    async def client(offset: int) -> None:
        turn = offset
        while time.perf_counter() < deadline:
            name, case = cases[turn % len(cases)]
            started = time.perf_counter()
            try:
                outcome = await asyncio.wait_for(case(turn // len(cases)), 30)
            except TimeoutError:
                outcome = "timeout"
            except OSError as exc:
                outcome = type(exc).__name__
            outcomes[name][outcome] += 1
            seconds[name].append(time.perf_counter() - started)
            turn += 1

    await asyncio.gather(*(client(offset) for offset in range(clients)))
    return {
        name: {
            "outcomes": dict(outcomes[name]),
            "median_ms": statistics.median(seconds[name]) * 1e3,
        }
        for name, _ in cases
    }


def hostile_worker(args: argparse.Namespace) -> None:
    """The hostile process: says ``ready``, runs, prints its JSON summary."""
    print("ready", flush=True)
    summary = asyncio.run(
        hostile_load(args.hostile_worker, args.hostile, args.duration, args.hold_s)
    )
    print(json.dumps(summary), flush=True)


# -- the runs ------------------------------------------------------------------------------------


def run_phase(args: argparse.Namespace, url: str, hostile: bool) -> tuple[LoadResult, Any]:
    worker = None
    if hostile:
        command = [
            sys.executable, __file__, "--hostile-worker", url, "--hostile", str(args.hostile),
            "--duration", str(args.duration), "--hold-s", str(args.hold_s),
        ]  # fmt: skip
        worker = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert worker.stdout is not None
        if worker.stdout.readline().strip() != "ready":
            raise RuntimeError("the hostile worker did not start")

    async def main() -> LoadResult:
        return await normal_load(url, args, args.duration)

    result: LoadResult = anyio.run(main, **run_options("asyncio"))
    summary = None
    if worker is not None:
        output, _ = worker.communicate(timeout=args.duration + 120)
        summary = json.loads(output.strip().splitlines()[-1])
    return result, summary


HEADER = (
    f"{'run':<14} {'out tok/s':>10} {'req/s':>7} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} "
    f"{'p99':>7} {'failed':>6} {'front RSS':>10} {'engine RSS':>11}"
)


def _mib(value: float | None) -> str:
    return f"{value:,.0f} MiB" if value is not None else "?"


def _row(name: str, s: dict[str, Any]) -> str:
    return (
        f"{name:<14} {s['output_tok_per_s']:>10,.0f} {s['request_per_s']:>7,.1f} "
        f"{s['ttft_p50_ms']:>9.1f} {s['ttft_p99_ms']:>8.1f} {s['itl_p50_ms']:>8.2f} "
        f"{s['itl_p99_ms']:>7.2f} {int(s['failed']):>6} {_mib(s['front_peak_mib']):>10} "
        f"{_mib(s['engine_peak_mib']):>11}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runtime", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per run")
    parser.add_argument("--clients", type=int, default=256, help="normal streaming clients")
    parser.add_argument("--hostile", type=int, default=50, help="hostile clients")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--step-ms", type=float, default=10.0, help="simulated time of every engine step"
    )
    parser.add_argument(
        "--hold-s",
        type=float,
        default=30.0,
        help="how long hostile clients hold slow and idle connections (the server cuts them first)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--hostile-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hostile_worker:
        hostile_worker(args)
        return

    print(machine_line(), flush=True)
    print(
        f"engine-core serve: mock backend ({args.step_ms:g} ms per step), byte tokenizer, "
        f"{args.runtime} ({http_server_for(ServerSettings(), args.runtime)}), engine core in "
        f"its own process; {args.clients} normal streaming chat clients of {args.max_tokens} "
        f"tokens; {args.hostile} hostile clients; {args.duration:g} s per run; the server's "
        "default timeouts and connection limit",
        flush=True,
    )
    runs: dict[str, dict[str, Any]] = {}
    hostile_summary: Any = None
    with server_process(server_flags(args)) as (url, process):
        warm = argparse.Namespace(**{**vars(args), "clients": min(args.clients, 32)})
        anyio.run(normal_load, url, warm, 2.0, **run_options("asyncio"))
        print(HEADER, flush=True)
        for name, hostile in (("clean", False), ("hostile", True), ("clean after", False)):
            result, summary = run_phase(args, url, hostile)
            front, engine = peak_rss_mib(process.pid)
            row: dict[str, Any] = {
                **result.summary(),
                "front_peak_mib": front,
                "engine_peak_mib": engine,
                "front_rss_mib": (_status_kib(process.pid, "VmRSS") or 0) / 1024,
            }
            errors = Counter(r.error for r in result.results if r.error)
            row["errors"] = dict(errors.most_common(3))
            runs[name] = row
            print(_row(name, row), flush=True)
            if summary is not None:
                hostile_summary = summary
    clean = [runs["clean"], runs["clean after"]]
    throughput = runs["hostile"]["output_tok_per_s"] / statistics.fmean(
        r["output_tok_per_s"] for r in clean
    )
    ttft = runs["hostile"]["ttft_p99_ms"] / statistics.fmean(r["ttft_p99_ms"] for r in clean)
    print(
        f"hostile / clean (mean of both clean runs): throughput {throughput:.2f}x "
        f"(target >= 0.9), TTFT p99 {ttft:.2f}x (target <= 2)"
    )
    print("hostile cases (outcome: count; median time per case):")
    server_errors = 0
    for case, data in hostile_summary.items():
        outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(data["outcomes"].items()))
        server_errors += sum(v for k, v in data["outcomes"].items() if k.startswith("5"))
        print(f"  {case:<16} {outcomes}; {data['median_ms']:.1f} ms")
    print(f"5xx answers to hostile requests: {server_errors}")
    for name, row in runs.items():
        if row["errors"]:
            print(f"normal-client errors in {name}: {row['errors']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": machine_line(),
                    "args": {k: v for k, v in vars(args).items() if k != "hostile_worker"},
                    "runs": runs,
                    "hostile": hostile_summary,
                    "throughput_ratio": throughput,
                    "ttft_p99_ratio": ttft,
                },
                f,
                indent=2,
            )
        print("wrote", args.json)


if __name__ == "__main__":
    main()
