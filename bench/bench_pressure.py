#!/usr/bin/env python3
"""The scheduler under KV pressure, end to end: the mock backend with a cost model (a step costs
``step_s`` 10 ms plus ``per_token_s`` 25 us per scheduled token), the engine in its own process
(``AsyncLLM``), every policy side by side in one run, each figure printed with its target and
today's behaviour beside it.

Scenarios:

- ``mixed``: 80 % chat requests (200-800 prompt tokens, 32-96 output tokens), 20 % documents
  (6-12k prompt tokens, 32 output tokens), Poisson arrivals at about 1.2x what the cache holds
  (arrival rate x mean token-seconds per request = 1.2 x the cache's tokens). Targets:
  recomputed tokens with ``least_progress`` <= 1/2 of ``last_admitted``; the short requests'
  TTFT p99 with the partial-prefill limits <= 0.5x without; output tok/s >= 0.97x today's.
- ``prefill``: the same mix of requests with a cache that holds them all (16,384 blocks) and
  arrivals at 0.7x the prompt tokens a full step computes, so what short requests wait for is
  the token budget that long prompts take, not blocks: what the partial-prefill limits are for.
  Reported: the short requests' TTFT p99 and p50 and tok/s with the limits / without.
- ``hol``: a cache two thirds full of running requests (32 x 1,100-token prompts, 250 output
  tokens), then a 30k-token request that does not fit, then 200 short requests (50-100 prompt
  tokens, 16 output tokens; together they fit in the free blocks) behind it. Targets: the short requests' TTFT p50 <= 0.2x
  today's, and the big request still completes.

"today" is the engine of a checkout of ``main`` when ``--today-python`` names its interpreter
(its ``.venv/bin/python``), else this tree with the new rules off (``max_bypass_steps=0``,
``last_admitted``, no partial-prefill limits), which schedules the same way. The never-fits and stuck-at-``max_num_seqs`` cases are tests
(``tests/core/test_pressure.py``, ``tests/engine/test_pressure_engine.py``).

Usage: ``python bench/bench_pressure.py [--scenario mixed|prefill|hol|all] [--scale 1.0]
[--today-python MAIN_CHECKOUT/.venv/bin/python] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import anyio

LATENCY = {"step_s": 0.010, "per_token_s": 25e-6}
BLOCK_SIZE = 16
VOCAB = (3, 250)

NEW_RULES_OFF = {"max_bypass_steps": 0, "preemption_victim": "last_admitted"}
"""This tree's engine scheduling as today's (no partial-prefill limits is the default)."""

CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "mixed": {
        "last_admitted": {"preemption_victim": "last_admitted"},
        "least_progress (default)": {},
        "least_progress+partial": {
            "preemption_victim": "least_progress",
            "max_num_partial_prefills": 4,
            "max_long_partial_prefills": 1,
            "long_prefill_token_threshold": 2048,
        },
    },
    "prefill": {
        "no limits (default)": {},
        "partial": {
            "max_num_partial_prefills": 4,
            "max_long_partial_prefills": 1,
            "long_prefill_token_threshold": 2048,
        },
    },
    "hol": {
        "bypass+last_admitted": {"preemption_victim": "last_admitted"},
        "bypass+least_progress (default)": {},
    },
}


# -- traces --------------------------------------------------------------------------------------


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(*VOCAB) for _ in range(n)]


def _chat_and_documents(rng: random.Random, scale: float) -> list[dict[str, Any]]:
    """120 x ``scale`` requests (at least 20): 80 % chat (200-800 prompt tokens, 32-96 output),
    20 % documents (6-12k prompt tokens, 32 output); arrival times and tokens not yet drawn."""
    reqs = []
    for _ in range(max(20, int(120 * scale))):
        if rng.random() < 0.2:
            reqs.append({"kind": "long", "prompt": rng.randint(6000, 12000), "out": 32})
        else:
            reqs.append(
                {"kind": "short", "prompt": rng.randint(200, 800), "out": rng.randint(32, 96)}
            )
    return reqs


def mixed_trace(scale: float, seed: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rng = random.Random(seed)
    num_blocks = 1536  # 24,576 tokens
    reqs = _chat_and_documents(rng, scale)
    # Token-seconds a request holds at no contention: its tokens x its lifetime.
    step = LATENCY["step_s"] + 64 * LATENCY["per_token_s"]
    demand = statistics.fmean(
        (r["prompt"] + r["out"]) * (r["out"] * step + r["prompt"] * LATENCY["per_token_s"])
        for r in reqs
    )
    rate = 1.2 * num_blocks * BLOCK_SIZE / demand
    t = 0.0
    for i, r in enumerate(reqs):
        t += rng.expovariate(rate)
        r.update(id=f"m{i}", at=t, tokens=_prompt(rng, r["prompt"]))
    config = {"num_kv_blocks": num_blocks, "max_model_len": 16384, "max_num_seqs": 256}
    return config, reqs


def hol_trace(scale: float, seed: int = 1) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rng = random.Random(seed)
    num_blocks = 4096  # 65,536 tokens
    reqs = []
    for _ in range(32):  # 32 x 1,350 tokens at their end: two thirds of the cache, ~250 steps
        reqs.append({"kind": "filler", "prompt": 1100, "out": 250, "at": 0.0})
    reqs.append({"kind": "long", "prompt": 30000, "out": 16, "at": 1.3})  # does not fit
    for _ in range(max(20, int(200 * scale))):
        reqs.append({"kind": "short", "prompt": rng.randint(50, 100), "out": 16, "at": 1.35})
    for i, r in enumerate(reqs):
        r.update(id=f"h{i}", tokens=_prompt(rng, r["prompt"]))
    config = {"num_kv_blocks": num_blocks, "max_model_len": 32768, "max_num_seqs": 256}
    return config, reqs


def prefill_trace(scale: float, seed: int = 2) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The mixed trace's requests with a cache that holds them all: what the short requests wait
    for is the token budget (compute), which long prompts take, not blocks."""
    rng = random.Random(seed)
    reqs = _chat_and_documents(rng, scale)
    # Prompt tokens per second a full step computes; arrivals at 0.7x of it.
    budget = 8192
    capacity = budget / (LATENCY["step_s"] + budget * LATENCY["per_token_s"])
    rate = 0.7 * capacity / statistics.fmean(r["prompt"] for r in reqs)
    t = 0.0
    for i, r in enumerate(reqs):
        t += rng.expovariate(rate)
        r.update(id=f"p{i}", at=t, tokens=_prompt(rng, r["prompt"]))
    config = {
        "num_kv_blocks": 16384,  # 262,144 tokens: every request fits at once
        "max_model_len": 16384,
        "max_num_seqs": 256,
        "max_num_batched_tokens": budget,
    }
    return config, reqs


TRACES = {"mixed": mixed_trace, "prefill": prefill_trace, "hol": hol_trace}


# -- one engine, one trace ------------------------------------------------------------------------


async def _run(config: dict[str, Any], reqs: list[dict[str, Any]]) -> dict[str, Any]:
    from engine_core import AsyncLLM, RequestOutputKind, SamplingParams

    results: dict[str, dict[str, Any]] = {}
    async with AsyncLLM(
        backend="mock",
        tokenizer="byte",
        multiprocess=True,
        backend_options={"latency": LATENCY},
        **config,
    ) as engine:
        # Warm up (process start, first step) before the clock starts.
        warm = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
        async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, warm):
            pass
        start = time.perf_counter()

        async def one(r: dict[str, Any]) -> None:
            await anyio.sleep(max(0.0, start + r["at"] - time.perf_counter()))
            params = SamplingParams(
                max_tokens=r["out"],
                ignore_eos=True,
                temperature=0.0,
                output_kind=RequestOutputKind.DELTA,
            )
            sent = time.perf_counter()
            first = None
            n = 0
            error = None
            try:
                async for out in engine.generate(
                    {"prompt_token_ids": r["tokens"]}, params, request_id=r["id"]
                ):
                    if first is None and out.outputs[0].token_ids:
                        first = time.perf_counter()
                    n += len(out.outputs[0].token_ids)
            except Exception as exc:  # reported, not fatal
                error = f"{type(exc).__name__}: {exc}"
            results[r["id"]] = {
                "kind": r["kind"],
                "ttft": None if first is None else first - sent,
                "end": time.perf_counter() - start,
                "tokens": n,
                "error": error,
            }

        async with anyio.create_task_group() as tg:
            for r in reqs:
                tg.start_soon(one, r)
        stats = await engine.get_stats()
    return {
        "requests": results,
        "num_preemptions": stats.num_preemptions,
        "num_recomputed_tokens": getattr(stats, "num_recomputed_tokens", None),
        "num_steps": stats.num_steps,
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    reqs = run["requests"].values()
    done = [r for r in reqs if r["error"] is None]
    short = [r["ttft"] for r in done if r["kind"] == "short" and r["ttft"] is not None]
    long_ = [r for r in reqs if r["kind"] == "long"]
    makespan = max(r["end"] for r in reqs)
    return {
        "completed": len(done),
        "errors": sum(1 for r in reqs if r["error"] is not None),
        "short_ttft_p50": _pct(short, 0.5),
        "short_ttft_p99": _pct(short, 0.99),
        "long_completed": all(r["error"] is None and r["tokens"] > 0 for r in long_),
        "long_end_s": max((r["end"] for r in long_), default=float("nan")),
        "tok_s": sum(r["tokens"] for r in reqs) / makespan,
        "makespan_s": makespan,
        "num_preemptions": run["num_preemptions"],
        "num_recomputed_tokens": run["num_recomputed_tokens"],
    }


def run_one(scenario: str, name: str, extra: dict[str, Any], scale: float) -> dict[str, Any]:
    config, reqs = TRACES[scenario](scale)
    return summarize(anyio.run(_run, {**config, **extra}, reqs))


def run_today(scenario: str, scale: float, python: str | None) -> dict[str, Any]:
    """Today's engine: the main checkout's, in a subprocess of its interpreter, or this tree
    with the new rules off."""
    if python is None:
        return run_one(scenario, "today", NEW_RULES_OFF, scale) | {"source": "this tree, rules off"}
    out = subprocess.run(
        [python, __file__, "--worker", scenario, "--scale", str(scale)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"source": python}


# -- report ----------------------------------------------------------------------------------------


def _f(x: Any, unit: str = "") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        if unit == "ms":
            return f"{x * 1e3:.0f} ms"
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.2f}"
    return str(x)


def report(scenario: str, today: dict[str, Any], rows: dict[str, dict[str, Any]]) -> list[str]:
    lines = [f"\n== {scenario} (today: {today.get('source')}) =="]
    cols = ["today", *rows]
    everything = {"today": today, **rows}
    lines.append(f"{'metric':<26}" + "".join(f"{c:>32}" for c in cols))
    for key, unit in [
        ("completed", ""),
        ("errors", ""),
        ("short_ttft_p50", "ms"),
        ("short_ttft_p99", "ms"),
        ("long_completed", ""),
        ("long_end_s", ""),
        ("tok_s", ""),
        ("makespan_s", ""),
        ("num_preemptions", ""),
        ("num_recomputed_tokens", ""),
    ]:
        lines.append(
            f"{key:<26}" + "".join(f"{_f(everything[c].get(key), unit):>32}" for c in cols)
        )
    lines.append("targets:")
    if scenario == "mixed":
        la, lp = rows["last_admitted"], rows["least_progress (default)"]
        part = rows["least_progress+partial"]
        rec = (lp["num_recomputed_tokens"] or 0) / max(la["num_recomputed_tokens"] or 0, 1)
        ttft = part["short_ttft_p99"] / lp["short_ttft_p99"]
        best = max(rows.values(), key=lambda r: r["tok_s"])
        lines += [
            f"  recomputed tokens least_progress / last_admitted = {rec:.2f} (target <= 0.5; "
            f"{lp['num_recomputed_tokens']} vs {la['num_recomputed_tokens']})",
            f"  short TTFT p99 with partial-prefill limits / without = {ttft:.2f} (target <= 0.5; "
            f"{_f(part['short_ttft_p99'], 'ms')} vs {_f(lp['short_ttft_p99'], 'ms')}, today "
            f"{_f(today['short_ttft_p99'], 'ms')})",
        ]
        for name, row in rows.items():
            lines.append(
                f"  tok/s {name} / today = {row['tok_s'] / today['tok_s']:.3f} (target >= 0.97)"
            )
        del best
    elif scenario == "prefill":
        base, part = rows["no limits (default)"], rows["partial"]
        lines += [
            f"  short TTFT p99 with partial-prefill limits / without = "
            f"{part['short_ttft_p99'] / base['short_ttft_p99']:.2f} ({_f(part['short_ttft_p99'], 'ms')}"
            f" vs {_f(base['short_ttft_p99'], 'ms')}); p50 "
            f"{part['short_ttft_p50'] / base['short_ttft_p50']:.2f}; tok/s "
            f"{part['tok_s'] / base['tok_s']:.3f}"
        ]
    else:
        for name, row in rows.items():
            lines.append(
                f"  short TTFT p50 {name} / today = "
                f"{row['short_ttft_p50'] / today['short_ttft_p50']:.3f} (target <= 0.2; "
                f"{_f(row['short_ttft_p50'], 'ms')} vs {_f(today['short_ttft_p50'], 'ms')}); "
                f"big request completed: {_f(row['long_completed'])}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", default="all", choices=["mixed", "prefill", "hol", "all"])
    parser.add_argument("--scale", type=float, default=1.0, help="trace length factor")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--today-python",
        default=None,
        help="the interpreter of a checkout of today's engine, e.g. main's .venv/bin/python "
        "(none: this tree with the new rules off)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # today's engine, run by its own interpreter: print one JSON line
        print(json.dumps(run_one(args.worker, "today", {}, args.scale)))
        return

    from engine_core._bench.machine import machine_line, write_results

    print(machine_line(), f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"mock cost model {LATENCY}; engine in its own process; scale {args.scale}")
    scenarios = ["mixed", "prefill", "hol"] if args.scenario == "all" else [args.scenario]
    out: dict[str, Any] = {}
    for scenario in scenarios:
        today = run_today(scenario, args.scale, args.today_python)
        rows = {
            name: run_one(scenario, name, extra, args.scale)
            for name, extra in CONFIGS[scenario].items()
        }
        for line in report(scenario, today, rows):
            print(line, flush=True)
        out[scenario] = {"today": today, **rows}
    print(f"load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    write_results(args.json, out)


if __name__ == "__main__":
    sys.exit(main())
