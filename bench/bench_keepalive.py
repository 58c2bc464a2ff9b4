#!/usr/bin/env python3
"""Keep-alive soak: requests over connections that idle about as long as the client's pool keeps
them, counted by outcome.

``engine-core serve`` (mock backend, byte tokenizer, engine core in its own process) in a
subprocess, on ``--runtime`` (uvicorn under asyncio, hypercorn under trio), with its default
``--keep-alive-timeout`` or ``--keep-alive-timeout S``. ``--workers`` clients, each an
``httpx.AsyncClient`` of its own (httpx's defaults: a pooled connection expires after
``--client-expiry`` s idle, 5 s as in httpx and the OpenAI SDK), send ``--num-requests`` small
non-streamed completions between them; after each, a worker waits a few milliseconds, or with
probability ``--idle-fraction`` an idle gap drawn around the client's expiry (± ``--jitter-s``),
so that many requests go out on a connection just as the client would expire it and the server
might close it. With a server keep-alive equal to the client's expiry that is the race where a
request meets a connection being closed ("Server disconnected without sending a response").

Reported: requests, failures by kind, seconds, req/s, and the machine line.

Usage: ``python bench/bench_keepalive.py [--runtime asyncio|trio] [--num-requests 20000]
[--workers 200] [--keep-alive-timeout S] [--client-expiry 5] [--idle-fraction 0.05]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import time
from typing import Any

import anyio
import httpx

from engine_core._bench.machine import machine_line, write_results
from engine_core._bench.server_process import server_process
from engine_core._frontend.runtime import run_options

MODEL = "bench"


def server_flags(args: argparse.Namespace) -> list[str]:
    flags = [
        "--backend", "mock", "--tokenizer", "byte", "--port", "0",
        "--max-num-seqs", str(args.workers), "--served-model-name", MODEL,
        "--runtime", args.runtime, "--log-level", "error", "--multiprocess",
    ]  # fmt: skip
    if args.keep_alive_timeout is not None:
        flags += ["--keep-alive-timeout", str(args.keep_alive_timeout)]
    return flags


async def soak(url: str, args: argparse.Namespace) -> dict[str, Any]:
    outcomes: collections.Counter[str] = collections.Counter()
    left = args.num_requests
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
    limits = httpx.Limits(keepalive_expiry=args.client_expiry)
    rng = random.Random(args.seed)

    async def worker() -> None:
        nonlocal left
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60.0) as client:
            while left > 0:
                left -= 1
                try:
                    response = await client.post("/v1/completions", json=body)
                    outcomes[str(response.status_code)] += 1
                except httpx.HTTPError as exc:
                    outcomes[f"{type(exc).__name__}: {exc}"] += 1
                if rng.random() < args.idle_fraction:
                    gap = args.client_expiry + rng.uniform(-args.jitter_s, args.jitter_s)
                else:
                    gap = rng.uniform(0.0, 0.02)
                await asyncio.sleep(gap)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.workers)))
    seconds = time.perf_counter() - started
    failed = sum(n for outcome, n in outcomes.items() if outcome != "200")
    return {
        "requests": sum(outcomes.values()),
        "failed": failed,
        "outcomes": dict(outcomes),
        "seconds": seconds,
        "request_per_s": sum(outcomes.values()) / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--num-requests", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=200)
    parser.add_argument(
        "--keep-alive-timeout", type=float, default=None, help="default: the server's default"
    )
    parser.add_argument("--client-expiry", type=float, default=5.0)
    parser.add_argument("--idle-fraction", type=float, default=0.05)
    parser.add_argument("--jitter-s", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(machine_line())
    with server_process(server_flags(args)) as (url, _):
        result = anyio.run(soak, url, args, **run_options("asyncio"))
    load = os.getloadavg()
    keep_alive = "default" if args.keep_alive_timeout is None else f"{args.keep_alive_timeout} s"
    print(
        f"{args.runtime} (server keep-alive {keep_alive}, client expiry {args.client_expiry} s): "
        f"{result['requests']} requests, {result['failed']} failed, "
        f"{result['seconds']:.0f} s, {result['request_per_s']:.0f} req/s; "
        f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    for outcome, count in sorted(result["outcomes"].items(), key=lambda item: -item[1]):
        print(f"  {count:>6}  {outcome}")
    write_results(args.json, {"args": vars(args), **result})


if __name__ == "__main__":
    main()
