#!/usr/bin/env python3
"""How busy the host keeps the device: async scheduling on and off, mock at a fixed step latency.

``AsyncLLM`` with the engine core in its own process, ``S`` concurrent streams of 128 output
tokens each (DELTA, ``ignore_eos``), the mock modelling a device whose every step takes
``step_s``. For each of 10 ms x 1 stream, 10 ms x 256 and 2 ms x 256, under asyncio and trio,
with ``async_scheduling`` off and on (several rounds, medians):

- **busy**: the fraction of the wall time the device spent on steps, ``steps x step duration /
  wall``, where the step duration is calibrated on this machine without any engine: the mock's
  device timeline run alone in a thread, one step at a time (``off``: each step waits for its
  own deadline, so a timer's overshoot counts as part of the step) or launched back to back
  (``on``: deadlines chain, so overshoot does not accumulate). The step count is the engine's
  (a count, not a time); the wall time is measured here. 1.0 means the host never made the
  device wait.
- **engine busy**: the engine's own ``device_busy_s`` over the wall time, as a cross-check.
- **tok/s**: output tokens per second.

``--tensor-parallel-size N`` runs the mock's pretend tensor parallelism (N-1 worker processes
that receive each step and its sampled ids), to see what the broadcast costs the overlap.

Usage: ``python bench/bench_overlap.py [--rounds 3] [--tokens 128] [--cases 10x1,10x256,2x256]
[--tensor-parallel-size N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import anyio

from engine_core import AsyncLLM, RequestOutputKind, SamplingParams
from engine_core._bench.machine import machine_line, write_results

CASES = ((0.010, 1), (0.010, 256), (0.002, 256))
PROMPT = "The quick brown fox jumps"


def calibrate(step_s: float, pipelined: bool, num: int = 200) -> float:
    """The real duration of one mock step on this machine: ``num`` steps of the mock's device
    timeline in a worker thread, each waiting for its deadline with ``time.sleep``; one at a
    time (each deadline from the moment it is launched) or back to back (each from the
    previous deadline)."""
    result: list[float] = []

    def run() -> None:
        start = time.monotonic()
        deadline = start
        for _ in range(num):
            base = deadline if pipelined else time.monotonic()
            deadline = base + step_s
            remaining = deadline - time.monotonic()
            if remaining > 0:
                time.sleep(remaining)
        result.append((time.monotonic() - start) / num)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result[0]


async def _round(engine: AsyncLLM, streams: int, tokens: int) -> dict[str, float]:
    params = SamplingParams(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    counts = [0] * streams

    async def one(i: int) -> None:
        async for output in engine.generate(PROMPT, params):
            counts[i] += len(output.outputs[0].token_ids)

    before = await engine.get_stats()
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(streams):
            tg.start_soon(one, i)
    wall = time.perf_counter() - start
    after = await engine.get_stats()
    if sum(counts) != streams * tokens:
        raise RuntimeError(f"expected {streams * tokens} tokens, got {sum(counts)}")
    return {
        "wall_s": wall,
        "steps": after.num_steps - before.num_steps,
        "engine_busy_s": after.device_busy_s - before.device_busy_s,
        "tok_s": streams * tokens / wall,
    }


def run_case(
    runtime: str, step_s: float, streams: int, async_scheduling: bool, args: argparse.Namespace
) -> list[dict[str, float]]:
    async def main() -> list[dict[str, float]]:
        async with AsyncLLM(
            backend="mock",
            tokenizer="byte",
            multiprocess=True,
            engine_runtime=runtime,  # type: ignore[arg-type]
            max_num_seqs=256,
            async_scheduling=async_scheduling,
            backend_options={
                "latency": {"step_s": step_s},
                "tensor_parallel_size": args.tensor_parallel_size,
            },
        ) as engine:
            await _round(engine, min(streams, 8), 8)  # warm up
            return [await _round(engine, streams, args.tokens) for _ in range(args.rounds)]

    rounds: list[dict[str, float]] = anyio.run(main, backend=runtime)
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--cases",
        default=",".join(f"{s * 1e3:g}x{n}" for s, n in CASES),
        help="step milliseconds x streams, comma-separated",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cases = [
        (float(ms) / 1e3, int(n)) for ms, n in (case.split("x") for case in args.cases.split(","))
    ]
    print(machine_line(), flush=True)
    steps = {s for s, _ in cases}
    calibrated = {
        (s, pipelined): calibrate(s, pipelined) for s in sorted(steps) for pipelined in (0, 1)
    }
    for s in sorted(steps):
        print(
            f"calibrated step of {s * 1e3:.0f} ms: one at a time {calibrated[s, 0] * 1e3:.3f} ms, "
            f"back to back {calibrated[s, 1] * 1e3:.3f} ms"
        )
    print(
        f"AsyncLLM, engine in its own process, {args.tokens} tokens per stream, DELTA; "
        f"mock tensor_parallel_size={args.tensor_parallel_size}; median of {args.rounds} rounds"
    )
    header = (
        f"{'step':>5} {'streams':>7} {'runtime':<8} "
        f"{'busy off':>9} {'busy on':>8} {'engine off':>10} {'engine on':>9} "
        f"{'tok/s off':>10} {'tok/s on':>10}"
    )
    print(header)
    results: list[dict[str, Any]] = []
    for step_s, streams in cases:
        for runtime in ("asyncio", "trio"):
            row: dict[str, Any] = {"step_ms": step_s * 1e3, "streams": streams, "runtime": runtime}
            for mode, on in (("off", False), ("on", True)):
                rounds = run_case(runtime, step_s, streams, on, args)
                duration = calibrated[step_s, int(on)]
                row[mode] = {
                    "busy": statistics.median(r["steps"] * duration / r["wall_s"] for r in rounds),
                    "engine_busy": statistics.median(
                        r["engine_busy_s"] / r["wall_s"] for r in rounds
                    ),
                    "tok_s": statistics.median(r["tok_s"] for r in rounds),
                    "steps": statistics.median(r["steps"] for r in rounds),
                }
            results.append(row)
            off, on_ = row["off"], row["on"]
            print(
                f"{step_s * 1e3:>3.0f}ms {streams:>7} {runtime:<8} "
                f"{off['busy']:>9.3f} {on_['busy']:>8.3f} {off['engine_busy']:>10.3f} "
                f"{on_['engine_busy']:>9.3f} {off['tok_s']:>10,.0f} {on_['tok_s']:>10,.0f}",
                flush=True,
            )
    if args.json:
        write_results(args.json, {"cases": results})


if __name__ == "__main__":
    main()
