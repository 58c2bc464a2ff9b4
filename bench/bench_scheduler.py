#!/usr/bin/env python3
"""Time the scheduler alone: ``schedule()`` + ``update_from_output()`` per engine step.

No backend: each step's fake model output is one sampled token per request whose prompt is
complete after the step (an empty list for a partial prefill chunk). Prefix caching on, greedy,
``ignore_eos``. The workloads match ``bench/reference/vllm_sched_bench.py`` so the two can be
compared side by side:

- W1: 256 requests x 128 random prompt tokens, max_tokens 128, max_num_seqs 256,
  max_num_batched_tokens 8192, 8192 blocks of 16;
- W2: the same with 1024 requests, max_num_seqs 1024, 20000 blocks;
- W3: 512 requests sharing a 1024-token prefix plus 32 unique tokens, max_tokens 16,
  max_num_seqs 512, 20000 blocks.

Usage: ``python bench/bench_scheduler.py --workload W1|W2|W3|all [--json PATH] [--repeat N]``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any

from engine_core._bench.machine import machine_line, write_results
from engine_core._core.request import Request
from engine_core._core.scheduler import Scheduler, SchedulerConfig
from engine_core.abc import ModelRunnerOutput
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams

VOCAB = 32000
BLOCK_SIZE = 16


def _prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


def workloads(rng: random.Random) -> dict[str, tuple[list[list[int]], int, dict[str, int]]]:
    shared = [rng.randrange(3, VOCAB) for _ in range(1024)]
    return {
        "W1": (_prompts(rng, 256, 128), 128, {"max_num_seqs": 256, "num_blocks": 8192}),
        "W2": (_prompts(rng, 1024, 128), 128, {"max_num_seqs": 1024, "num_blocks": 20000}),
        "W3": (
            [shared + [rng.randrange(3, VOCAB) for _ in range(32)] for _ in range(512)],
            16,
            {"max_num_seqs": 512, "num_blocks": 20000},
        ),
    }


def _fake_output(scheduler: Scheduler, req_ids: list[str], rng: random.Random) -> ModelRunnerOutput:
    sampled = []
    for request in scheduler._scheduled:
        if request.num_computed_tokens >= len(request.all_token_ids):
            sampled.append([rng.randrange(3, VOCAB)])
        else:
            sampled.append([])
    return ModelRunnerOutput(req_ids, sampled)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def run_workload(
    name: str, prompts: list[list[int]], max_tokens: int, *, max_num_seqs: int, num_blocks: int
) -> dict[str, Any]:
    rng = random.Random(0)
    engine_config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=8192,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
    )
    scheduler = Scheduler(SchedulerConfig.from_engine_config(engine_config), num_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    gc.collect()
    t0 = time.perf_counter()
    requests = [
        Request(f"r{i}", p, params, block_size=BLOCK_SIZE, arrival_time=float(i))
        for i, p in enumerate(prompts)
    ]
    t_create = time.perf_counter() - t0
    for request in requests:
        scheduler.add_request(request)

    steps: list[tuple[str, int, float, float]] = []  # (phase, num_reqs, sched_s, update_s)
    out_tokens = 0
    t_start = time.perf_counter()
    while scheduler.has_unfinished_requests():
        a = time.perf_counter()
        so = scheduler.schedule()
        b = time.perf_counter()
        mro = _fake_output(scheduler, so.req_ids, rng)
        c = time.perf_counter()
        outputs = scheduler.update_from_output(so, mro)
        d = time.perf_counter()
        n = so.num_reqs
        out_tokens += len(outputs.req_ids)
        is_decode = so.total_num_scheduled_tokens == n and not so.new_reqs
        steps.append(("decode" if is_decode else "prefill", n, b - a, d - c))
        if len(steps) > 100_000:
            raise RuntimeError("runaway loop")
    wall = time.perf_counter() - t_start

    def summarize(phase: str) -> dict[str, float]:
        ss = [s for s in steps if s[0] == phase]
        if not ss:
            return {}
        tot = [(s[2] + s[3]) * 1e6 for s in ss]
        nreq = statistics.fmean(s[1] for s in ss)
        return {
            "steps": len(ss),
            "avg_reqs_per_step": nreq,
            "schedule_mean_us": statistics.fmean(s[2] * 1e6 for s in ss),
            "update_mean_us": statistics.fmean(s[3] * 1e6 for s in ss),
            "sched+update_mean_us": statistics.fmean(tot),
            "sched+update_p50_us": _pct(tot, 0.5),
            "sched+update_p99_us": _pct(tot, 0.99),
            "per_req_us": statistics.fmean(tot) / max(nreq, 1e-9),
        }

    stats = scheduler.kv.stats
    free_ok = scheduler.kv.num_free_blocks == num_blocks
    return {
        "workload": name,
        "num_requests": len(prompts),
        "create_requests_us_per_req": t_create * 1e6 / len(prompts),
        "loop_wall_s": wall,
        "total_steps": len(steps),
        "output_tokens": out_tokens,
        "tokens_per_s_cpu_only": out_tokens / wall,
        "prefill_phase": summarize("prefill"),
        "decode_phase": summarize("decode"),
        "prefix_cache": {"hit_rate": stats.hit_rate, "queries": stats.queries, "hits": stats.hits},
        "all_blocks_free_after": free_ok,
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose decode per-request time is the median (keeps one coherent run)."""
    key = lambda r: r["decode_phase"].get("per_req_us", 0.0)  # noqa: E731
    return sorted(runs, key=key)[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="all", choices=["W1", "W2", "W3", "all"])
    parser.add_argument("--json", default=None, help="write results to this path")
    parser.add_argument("--repeat", type=int, default=3, help="runs per workload (median kept)")
    args = parser.parse_args()

    all_workloads = workloads(random.Random(1234))
    names = list(all_workloads) if args.workload == "all" else [args.workload]
    print(machine_line(), flush=True)
    results = []
    for name in names:
        prompts, max_tokens, kw = all_workloads[name]
        runs = [run_workload(name, prompts, max_tokens, **kw) for _ in range(args.repeat)]
        results.append(_median_run(runs))

    print(f"scheduler alone, median of {args.repeat} runs; microseconds")
    print(
        f"{'run':<4} {'reqs':>5} {'steps':>5} {'create/req':>10} {'prefill step':>12} "
        f"{'decode step':>11} {'decode p50':>10} {'decode/req':>10} {'hit rate':>8} {'tok/s':>9}"
    )
    for r in results:
        pre, dec = r["prefill_phase"], r["decode_phase"]
        print(
            f"{r['workload']:<4} {r['num_requests']:>5} {r['total_steps']:>5} "
            f"{r['create_requests_us_per_req']:>10.2f} {pre.get('sched+update_mean_us', 0):>12.0f} "
            f"{dec.get('sched+update_mean_us', 0):>11.0f} {dec.get('sched+update_p50_us', 0):>10.0f} "
            f"{dec.get('per_req_us', 0):>10.2f} {r['prefix_cache']['hit_rate']:>8.1%} "
            f"{r['tokens_per_s_cpu_only']:>9.0f}"
        )
    write_results(args.json, {"runs": results})


if __name__ == "__main__":
    main()
