#!/usr/bin/env python3
"""Data parallelism on the mock: throughput of N engines, the data-parallel client's overhead and
the router's cost.

- (a) ``--requests`` requests of ``--prompt-tokens`` distinct prompt tokens and
  ``--output-tokens`` output tokens (DELTA, ``ignore_eos``), all submitted at once through
  ``AsyncLLM`` to the mock at a fixed step latency (``--step-s``, ``max_num_seqs`` 64): output
  tokens per second of DP=2, of DP=1 through the data-parallel client and of DP=1 through the
  plain client, interleaved for ``--rounds`` rounds; medians and ratios;
- (b) the router's cost per decision (block digests of a ``--route-tokens``-token prompt, index
  walk, decision and the request's end), with 2 and 8 engines whose index holds other prompts.

Usage: ``python bench/bench_dp.py [--rounds 3] [--only a,b] [--runtime asyncio|trio]
[--json PATH]``.
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
from engine_core._core.block_hash import block_digests
from engine_core._core.engine_io import KVEvents
from engine_core._core.router import Router


def _prompts(args: argparse.Namespace, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(1, 250) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]


async def _throughput(args: argparse.Namespace, dp: int, dp_client: bool, seed: int) -> float:
    engine = AsyncLLM(
        backend="mock",
        tokenizer="byte",
        max_num_seqs=64,
        data_parallel_size=dp,
        backend_options={"latency": {"step_s": args.step_s}},
    )
    engine._data_parallel_client = dp_client
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.output_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    prompts = _prompts(args, seed)
    tokens = 0

    async def run(prompt: list[int]) -> None:
        nonlocal tokens
        async for out in engine.generate({"prompt_token_ids": prompt}, params):
            tokens += len(out.outputs[0].token_ids)

    async with engine:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for prompt in prompts:
                tg.start_soon(run, prompt)
        elapsed = time.perf_counter() - start
    assert tokens == args.requests * args.output_tokens
    return tokens / elapsed


async def bench_throughput(args: argparse.Namespace) -> dict[str, Any]:
    configs = {"dp2": (2, True), "dp1_dp_client": (1, True), "dp1_plain": (1, False)}
    configs = {k: v for k, v in configs.items() if k in args.configs.split(",")}
    runs: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, (dp, dp_client) in configs.items():
            runs[name].append(await _throughput(args, dp, dp_client, seed=r))
            print(f"  round {r + 1} {name}: {runs[name][-1]:,.0f} tok/s", flush=True)
    med = {name: statistics.median(v) for name, v in runs.items()}
    result: dict[str, Any] = {"tok_s": runs, "median_tok_s": med}
    print(f"(a) output tok/s, medians of {args.rounds}: {med}")
    if "dp1_plain" in med:
        # ratios per round (the configurations of a round ran back to back), then the median
        for name, key in (("dp2", "dp2_over_dp1"), ("dp1_dp_client", "dp_client_over_plain")):
            if name in med:
                ratios = [a / b for a, b in zip(runs[name], runs["dp1_plain"], strict=True)]
                result[key] = statistics.median(ratios)
                print(f"    {key}: {result[key]:.3f}x (per round: {[round(r, 3) for r in ratios]})")
    return result


def bench_router(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    results = {}
    for engines in (2, 8):
        router = Router(engines, block_size=16, balance_abs=8)
        # an index holding other prompts' blocks, and a shared system prompt on every engine
        system = [rng.randrange(1, 250) for _ in range(512)]
        for e in range(engines):
            for _ in range(20):
                other = system + [rng.randrange(1, 250) for _ in range(args.route_tokens - 512)]
                router.apply_events(e, KVEvents(stored=block_digests(other, 16, 10**9)))
        prompts = [
            system + [rng.randrange(1, 250) for _ in range(args.route_tokens - 512)]
            for _ in range(args.route_requests)
        ]
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            router.route(str(i), prompt)
            router.finished(str(i))
        per_us = (time.perf_counter() - start) / len(prompts) * 1e6
        # For scale: hashing every block of such a prompt, as the engine does.
        start = time.perf_counter()
        for prompt in prompts:
            block_digests(prompt, 16, 10**9)
        hash_us = (time.perf_counter() - start) / len(prompts) * 1e6
        results[f"{engines}_engines_us"] = per_us
        results[f"{engines}_engines_full_hash_us"] = hash_us
        print(
            f"(b) router, {engines} engines: {per_us:.1f} us per {args.route_tokens}-token "
            f"request (digests, index walk, decision, end); hashing all its blocks: "
            f"{hash_us:.1f} us"
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--route-tokens", type=int, default=2048)
    parser.add_argument("--route-requests", type=int, default=2000)
    parser.add_argument("--only", default="a,b")
    parser.add_argument("--configs", default="dp2,dp1_dp_client,dp1_plain")
    parser.add_argument("--runtime", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(machine_line())
    only = set(args.only.split(","))
    results: dict[str, Any] = {}
    if "a" in only:
        results["throughput"] = anyio.run(bench_throughput, args, backend=args.runtime)
    if "b" in only:
        results["router"] = bench_router(args)
    write_results(args.json, results)


if __name__ == "__main__":
    main()
