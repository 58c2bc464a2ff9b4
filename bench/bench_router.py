#!/usr/bin/env python3
"""Prefix-aware routing on real engine processes: the mock with a per-token latency, so prefill
tokens that the prefix cache saves are time saved, and shared-prefix workloads.

Every request is a shared prefix (``--prefix-tokens``) plus unique tokens (``--suffix-tokens``),
``--output-tokens`` greedy output tokens; ``--clients`` closed-loop clients send them in a
shuffled order. Each engine has ``--blocks`` KV blocks of 16 tokens. Workloads:

- ``fits``: 16 prefixes × 32 requests, all prefixes fit one engine's cache: DP=2 with each
  policy against one engine (DP=1);
- ``pooled``: as many prefixes as fill 1.7× one engine's cache, 8 requests each: the two caches
  together hold them, one does not;
- ``hot``: half the requests share one prefix, the rest spread over 31: how the requests split
  between the engines;
- ``failover``: ``pooled`` with ``dp_failover="resume"`` and engine 1 exiting at its
  ``--fault-step``-th step, against DP=1.

Reported: the prefix-cache hit rate (Σ hits / Σ queried tokens over the engines), output tokens
per second, TTFT p50 and the share of requests each engine served.

Usage: ``python bench/bench_router.py [--only fits,pooled,hot,failover] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import anyio

from engine_core import AsyncLLM, RequestOutputKind, SamplingParams
from engine_core._bench.machine import machine_line, write_results
from engine_core._engine.dp.client import DPClient

BLOCK = 16


def _workload(args: argparse.Namespace, name: str) -> list[list[int]]:
    rng = random.Random(1)
    prefix_blocks = args.prefix_tokens // BLOCK
    if name == "fits":
        owners = [p for p in range(16) for _ in range(32)]
    elif name == "hot":
        n = args.hot_requests
        owners = [0] * (n // 2) + [1 + i % 31 for i in range(n - n // 2)]
    else:  # pooled, failover
        num_prefixes = max(2, round(1.7 * args.blocks / prefix_blocks))
        owners = [p for p in range(num_prefixes) for _ in range(8)]
    prefixes: dict[int, list[int]] = {}
    prompts = []
    for owner in owners:
        if owner not in prefixes:
            prefixes[owner] = [rng.randrange(1, 250) for _ in range(args.prefix_tokens)]
        prompts.append(prefixes[owner] + [rng.randrange(1, 250) for _ in range(args.suffix_tokens)])
    rng.shuffle(prompts)
    return prompts


async def _run(
    args: argparse.Namespace, prompts: list[list[int]], dp: int, policy: str, **config: Any
) -> dict[str, Any]:
    options: dict[str, Any] = {"latency": {"step_s": args.step_s, "per_token_s": args.per_token_s}}
    fault = config.pop("fault", None)
    if fault is not None:
        options["fault"] = fault
    engine = AsyncLLM(
        backend="mock",
        tokenizer="byte",
        data_parallel_size=dp,
        router=policy,
        num_kv_blocks=args.blocks,
        max_model_len=args.prefix_tokens + args.suffix_tokens + args.output_tokens + BLOCK,
        max_num_seqs=args.max_num_seqs,
        backend_options=options,
        router_balance_abs=args.balance_abs,
        router_balance_rel=args.balance_rel,
        **config,
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.output_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    queue = list(reversed(prompts))
    ttfts: list[float] = []
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        while queue:
            prompt = queue.pop()
            start = time.perf_counter()
            first = True
            async for out in engine.generate({"prompt_token_ids": prompt}, params):
                if first:
                    ttfts.append(time.perf_counter() - start)
                    first = False
                tokens += len(out.outputs[0].token_ids)

    async with engine:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(args.clients):
                tg.start_soon(client)
        elapsed = time.perf_counter() - start
        stats = await engine.get_stats()
        dp_client = engine._client
        split = None
        if isinstance(dp_client, DPClient):
            per_engine = [0] * dp
            for (e, _reason), count in dp_client.metrics.requests.items():
                per_engine[e] += count
            split = [round(c / sum(per_engine), 3) for c in per_engine]
    return {
        "hit_rate": round(stats.prefix_cache_hit_rate, 4),
        "tok_s": round(tokens / elapsed, 1),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
        "split": split,
        "engines_alive": stats.num_engines_alive,
    }


def _show(name: str, label: str, r: dict[str, Any]) -> None:
    print(
        f"  {name:9s} {label:22s} hit {r['hit_rate']:.3f}  {r['tok_s']:9,.0f} tok/s  "
        f"TTFT p50 {r['ttft_p50_ms']:7.1f} ms  split {r['split']}",
        flush=True,
    )


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    only = args.only.split(",")
    for name in ("fits", "pooled", "hot"):
        if name not in only:
            continue
        prompts = _workload(args, name)
        runs: dict[str, Any] = {}
        if name == "fits":
            runs["single"] = await _run(args, prompts, 1, "prefix")
            _show(name, "DP=1", runs["single"])
        for policy in ("prefix", "round_robin", "least_loaded"):
            runs[policy] = await _run(args, prompts, 2, policy)
            _show(name, f"DP=2 {policy}", runs[policy])
        prefix, rr = runs["prefix"], runs["round_robin"]
        runs["prefix_minus_rr_hit"] = round(prefix["hit_rate"] - rr["hit_rate"], 4)
        runs["prefix_over_rr_tok_s"] = round(prefix["tok_s"] / rr["tok_s"], 3)
        if name == "fits":
            runs["prefix_minus_single_hit"] = round(
                prefix["hit_rate"] - runs["single"]["hit_rate"], 4
            )
        print(
            f"  {name}: prefix - RR hit {runs['prefix_minus_rr_hit']:+.3f}, "
            f"prefix/RR tok/s {runs['prefix_over_rr_tok_s']:.3f}"
            + (
                f", prefix - single hit {runs['prefix_minus_single_hit']:+.3f}"
                if name == "fits"
                else ""
            )
        )
        results[name] = runs
    if "failover" in only:
        prompts = _workload(args, "failover")
        single = await _run(args, prompts, 1, "prefix")
        _show("failover", "DP=1", single)
        fault = {"kind": "exit", "at_step": args.fault_step, "rank": 1}
        failed = await _run(args, prompts, 2, "prefix", dp_failover="resume", fault=fault)
        _show("failover", "DP=2, engine 1 dies", failed)
        ratio = round(failed["tok_s"] / single["tok_s"], 3)
        print(f"  failover: DP=2 with a death / DP=1 tok/s {ratio:.3f}")
        results["failover"] = {"single": single, "dp2_with_death": failed, "ratio": ratio}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="fits,pooled,hot,failover")
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=1200)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--hot-requests", type=int, default=512)
    parser.add_argument("--step-s", type=float, default=0.002)
    parser.add_argument("--per-token-s", type=float, default=20e-6)
    parser.add_argument("--fault-step", type=int, default=20)
    parser.add_argument("--balance-abs", type=int, default=None)
    parser.add_argument("--balance-rel", type=float, default=1.5)
    parser.add_argument("--runtime", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(machine_line())
    results = anyio.run(bench, args, backend=args.runtime)
    write_results(args.json, results)


if __name__ == "__main__":
    main()
