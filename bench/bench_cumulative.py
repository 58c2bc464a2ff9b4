#!/usr/bin/env python3
"""Long streams through ``AsyncLLM``: zero-latency mock, byte tokenizer, engine in its own process.

- (a) one stream of ``--tokens`` tokens (``ignore_eos``) in each output kind: wall time;
- (b) short requests (``--short-tokens`` tokens, one after the other) beside one long stream
  (CUMULATIVE, or ``--beside-kind``): how long each takes, against the same short requests on
  an idle engine;
- (c) back-pressure: ``--streams`` streams running while the event loop is blocked for
  ``--block-s`` seconds; resident memory (VmRSS) of this process and of the engine's before,
  right after the block, half a second later, after the streams ended and after ``malloc_trim``
  (which tells memory in use from memory the C allocator only keeps), and how long the streams
  took to end once the loop ran again.

Usage: ``python bench/bench_cumulative.py [--runtime asyncio|trio] [--only a,b,c] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import time
from typing import Any

import anyio

from engine_core import AsyncLLM, RequestOutputKind, SamplingParams
from engine_core._bench.machine import machine_line, write_results

PROMPT = "The quick brown fox jumps"


def rss_mb(pid: int | str = "self") -> float:
    """Resident memory (VmRSS) of this process or of ``pid``, in MB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _malloc_trim() -> bool:
    """Give the C allocator's free memory back to the system (glibc); False elsewhere. Tells
    memory still in use from memory only kept by the allocator."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def _engine(args: argparse.Namespace, **kwargs: Any) -> AsyncLLM:
    return AsyncLLM(
        backend="mock",
        tokenizer="byte",
        multiprocess=not args.in_process,
        max_model_len=args.tokens + 1000,
        **kwargs,
    )


def _params(tokens: int, kind: RequestOutputKind, **kw: Any) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, output_kind=kind, **kw
    )


async def _stream(engine: AsyncLLM, params: SamplingParams) -> tuple[float, int]:
    """Seconds a stream takes and the outputs it delivered (each one read, as a consumer would)."""
    start = time.perf_counter()
    count = tokens = 0
    async for output in engine.generate(PROMPT, params):
        count += 1
        tokens = len(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    if params.output_kind != RequestOutputKind.DELTA and tokens != params.max_tokens:
        raise RuntimeError(f"expected {params.max_tokens} tokens, got {tokens}")
    return elapsed, count


async def long_stream(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    async with _engine(args) as engine:
        await _stream(engine, _params(16, RequestOutputKind.DELTA))  # warm up
        for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
            elapsed, count = await _stream(engine, _params(args.tokens, kind))
            result[kind.name] = {"seconds": elapsed, "outputs": count}
    return result


async def _short_requests(
    engine: AsyncLLM, args: argparse.Namespace, until: anyio.Event | None
) -> list[float]:
    times: list[float] = []
    params = _params(args.short_tokens, RequestOutputKind.CUMULATIVE)
    while len(times) < args.short_requests or (until is not None and not until.is_set()):
        start = time.perf_counter()
        async for _ in engine.generate(PROMPT, params):
            pass
        times.append(time.perf_counter() - start)
        await anyio.sleep(0.02)
    return times


async def beside(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    beside_kind = RequestOutputKind[args.beside_kind]
    async with _engine(args) as engine:
        idle = await _short_requests(engine, args, None)
        result["idle"] = {"p50_ms": statistics.median(idle) * 1e3, "max_ms": max(idle) * 1e3}
        done = anyio.Event()
        long_time = 0.0

        async def long_one() -> None:
            nonlocal long_time
            long_time, _ = await _stream(engine, _params(args.tokens, beside_kind))
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_one)
            busy = await _short_requests(engine, args, done)
        result["beside_long_stream"] = {
            "p50_ms": statistics.median(busy) * 1e3,
            "max_ms": max(busy) * 1e3,
            "requests": len(busy),
            "long_stream_s": long_time,
        }
    return result


async def blocked_loop(args: argparse.Namespace) -> dict[str, Any]:
    """VmRSS of this process (and of the engine's, where it has one) at each point, in MB, and
    the seconds from the end of the block to the end of the streams."""
    marks: dict[str, Any] = {}
    kind = RequestOutputKind[args.block_kind]
    async with _engine(args) as engine:
        engine_pid = getattr(engine._client, "pid", None)

        def mark(name: str) -> None:
            marks[name] = rss_mb()
            if engine_pid is not None:
                marks[f"{name} (engine)"] = rss_mb(engine_pid)

        await _stream(engine, _params(16, RequestOutputKind.DELTA))
        gc.collect()
        mark("before")
        started = 0
        all_started = anyio.Event()

        async def one() -> None:
            nonlocal started
            first = True
            async for _ in engine.generate(PROMPT, _params(args.block_tokens, kind)):
                if first:
                    first = False
                    started += 1
                    if started == args.streams:
                        all_started.set()
                if args.slow_consumers:
                    await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            for _ in range(args.streams):
                tg.start_soon(one)
            await all_started.wait()
            mark("running")
            time.sleep(args.block_s)  # the event loop is blocked: nobody reads
            mark("after_block")
            unblocked = time.perf_counter()
            await anyio.sleep(0.5)
            mark("0.5s_later")
        marks["drain_s"] = time.perf_counter() - unblocked
        gc.collect()
        mark("after_streams_end")
        if _malloc_trim():
            mark("after_malloc_trim")
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runtime", default="asyncio", choices=("asyncio", "trio"))
    parser.add_argument("--in-process", action="store_true")
    parser.add_argument("--only", default="a,b,c")
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--short-requests", type=int, default=20)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--block-s", type=float, default=10.0)
    parser.add_argument("--block-tokens", type=int, default=20_000)
    parser.add_argument("--beside-kind", default="CUMULATIVE", choices=("DELTA", "CUMULATIVE"))
    parser.add_argument("--block-kind", default="DELTA", choices=("DELTA", "CUMULATIVE"))
    parser.add_argument(
        "--slow-consumers", action="store_true", help="(c): each stream sleeps 10 ms per output"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(machine_line(), flush=True)
    only = set(args.only.split(","))
    results: dict[str, Any] = {}
    if "a" in only:
        r = results["long_stream"] = anyio.run(long_stream, args, backend=args.runtime)
        for kind, v in r.items():
            print(
                f"(a) one stream of {args.tokens} tokens, {kind:<10}: {v['seconds']:7.2f} s "
                f"({v['outputs']} outputs)",
                flush=True,
            )
    if "b" in only:
        r = results["beside"] = anyio.run(beside, args, backend=args.runtime)
        b = r["beside_long_stream"]
        print(
            f"(b) {args.short_tokens}-token requests: idle p50 {r['idle']['p50_ms']:.1f} ms "
            f"max {r['idle']['max_ms']:.1f} ms; beside a {args.tokens}-token {args.beside_kind} "
            f"stream "
            f"({b['long_stream_s']:.2f} s): p50 {b['p50_ms']:.1f} ms max {b['max_ms']:.1f} ms "
            f"({b['requests']} requests)",
            flush=True,
        )
    if "c" in only:
        r = results["blocked_loop"] = anyio.run(blocked_loop, args, backend=args.runtime)
        print(
            f"(c) VmRSS, {args.streams} {args.block_kind} streams x {args.block_tokens} tokens, "
            f"loop blocked {args.block_s:.0f} s: "
            + ", ".join(
                f"{k} {v:.1f} s" if k.endswith("_s") else f"{k} {v:.0f} MB" for k, v in r.items()
            ),
            flush=True,
        )
    write_results(args.json, results)


if __name__ == "__main__":
    main()
