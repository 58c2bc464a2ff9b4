#!/usr/bin/env python3
"""End-to-end serving overhead through ``AsyncLLM``: zero-latency mock, byte tokenizer.

- (a) throughput: 256 concurrent streams x 256 output tokens, DELTA (``--kind``), ``ignore_eos``;
- (b) overhead: 1000 sequential requests of max_tokens 1, time from ``generate()`` to the first
  output (p50, p99);
- (c) under asyncio and trio, side by side; (d) engine core in its own process vs in-process;
- (e) the process's pipes: Unix stream sockets (the default, "unix") and ZMQ ``ipc://`` ("zmq"),
  over ``--rounds`` interleaved rounds (medians reported with every round's figures).

Usage: ``python bench/bench_serving.py [--json PATH] [--streams 256] [--tokens 256]
[--kind DELTA|CUMULATIVE|FINAL_ONLY] [--pipes unix,zmq] [--rounds 1] [--no-inproc]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import anyio

from engine_core import AsyncLLM, RequestOutputKind, SamplingParams
from engine_core._bench.machine import machine_line, write_results

PROMPT = "The quick brown fox jumps"


async def _throughput(
    engine: AsyncLLM, streams: int, tokens: int, kind: RequestOutputKind
) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, output_kind=kind)
    counts = [0] * streams
    delta = kind == RequestOutputKind.DELTA

    async def one(i: int) -> None:
        async for output in engine.generate(PROMPT, params):
            n = len(output.outputs[0].token_ids)
            counts[i] = counts[i] + n if delta else n

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(streams):
            tg.start_soon(one, i)
    elapsed = time.perf_counter() - start
    if sum(counts) != streams * tokens:
        raise RuntimeError(f"expected {streams * tokens} tokens, got {sum(counts)}")
    return sum(counts) / elapsed


async def _first_output(engine: AsyncLLM, num: int) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(num):
        start = time.perf_counter()
        async for _output in engine.generate(PROMPT, params):
            times.append(time.perf_counter() - start)
    return times


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run(runtime: str, multiprocess: bool, args: argparse.Namespace, pipes: str) -> dict[str, Any]:
    # Read when the client binds its pipes (see engine_core/_engine/sockets.py).
    os.environ["ENGINE_CORE_IPC_TRANSPORT"] = pipes

    async def main() -> dict[str, Any]:
        async with AsyncLLM(
            backend="mock", tokenizer="byte", multiprocess=multiprocess, max_num_seqs=args.streams
        ) as engine:
            await _first_output(engine, 20)  # warm up
            tok_s = await _throughput(
                engine, args.streams, args.tokens, RequestOutputKind[args.kind]
            )
            first = await _first_output(engine, args.requests)
        return {
            "throughput_tok_s": tok_s,
            "first_output_us": {
                "p50": _pct(first, 0.5) * 1e6,
                "p99": _pct(first, 0.99) * 1e6,
                "mean": statistics.fmean(first) * 1e6,
            },
        }

    result: dict[str, Any] = anyio.run(main, backend=runtime)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument(
        "--kind", default="DELTA", choices=[k.name for k in RequestOutputKind], help="for (a)"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--pipes", default="unix,zmq", help="comma-separated: unix, zmq")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-inproc", action="store_true", help="skip the in-process runs")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    print(
        f"AsyncLLM, zero-latency mock, byte tokenizer: (a) {args.streams} streams x "
        f"{args.tokens} tokens {args.kind}; (b) {args.requests} sequential max_tokens=1 requests"
    )
    configs = [(f"multiprocess-{p}", True, p) for p in args.pipes.split(",")]
    if not args.no_inproc:
        configs.append(("in-process", False, "unix"))
    rounds: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for mode, multiprocess, pipes in configs:
            for runtime in ("asyncio", "trio"):
                r = run(runtime, multiprocess, args, pipes)
                rounds.setdefault(f"{mode}/{runtime}", []).append(r)
                print(
                    f"{mode:<18} {runtime:<8} throughput {r['throughput_tok_s']:>10,.0f} tok/s   "
                    f"first output p50 {r['first_output_us']['p50']:>7.0f} us  "
                    f"p99 {r['first_output_us']['p99']:>7.0f} us",
                    flush=True,
                )
    results: dict[str, dict[str, Any]] = {}
    print(f"medians of {args.rounds} round(s):")
    for key, rs in rounds.items():
        results[key] = {
            "throughput_tok_s": statistics.median(r["throughput_tok_s"] for r in rs),
            "first_output_us": {
                q: statistics.median(r["first_output_us"][q] for r in rs)
                for q in ("p50", "p99", "mean")
            },
        }
        r = results[key]
        mode, runtime = key.split("/")
        print(
            f"{mode:<18} {runtime:<8} throughput {r['throughput_tok_s']:>10,.0f} tok/s   "
            f"first output p50 {r['first_output_us']['p50']:>7.0f} us  "
            f"p99 {r['first_output_us']['p99']:>7.0f} us"
        )
    if args.json:
        mp = {k.split("/")[1]: v for k, v in results.items() if k.startswith("multiprocess-unix")}
        data = {
            "throughput_tok_s": {k: v["throughput_tok_s"] for k, v in mp.items()},
            "first_output_us": {
                k: {"p50": v["first_output_us"]["p50"], "p99": v["first_output_us"]["p99"]}
                for k, v in mp.items()
            },
            "in_process": {k: v for k, v in results.items() if k.startswith("in-process")},
        }
        write_results(args.json, data)


if __name__ == "__main__":
    main()
