#!/usr/bin/env python3
"""Data parallelism on the mock: throughput of N engines, the data-parallel client's overhead and
the router's cost.

- (a) ``--requests`` requests of ``--prompt-tokens`` distinct prompt tokens and
  ``--output-tokens`` output tokens (DELTA, ``ignore_eos``), all submitted at once through
  ``AsyncLLM`` to the mock at a fixed step latency (``--step-s``, ``max_num_seqs`` 64): output
  tokens per second of DP=2, of DP=1 through the data-parallel client and of DP=1 through the
  plain client, interleaved for ``--rounds`` rounds; medians and ratios;
- (b) the router's cost per decision (block digests of a ``--route-tokens``-token prompt, index
  walk, decision and the request's end), with 2 and 8 engines whose index holds other prompts;
- (c) the chaos drill (only with ``--only c``): DP=``--chaos-engines`` with
  ``dp_restart_engines`` and ``dp_failover=--chaos-failover``, ``--chaos-requests`` greedy
  requests of ``--chaos-output-tokens`` tokens submitted at once, while a SIGKILL hits a
  random live engine every ``--kill-every`` s until they are done (so every engine is often
  dead at once); each request's tokens are checked against the mock's greedy rule (counting up
  from the last prompt token). Reported: requests exact / wrong / failed (by error), kills,
  restarts, the moments no engine was alive, seconds.

Usage: ``python bench/bench_dp.py [--rounds 3] [--only a,b,c] [--runtime asyncio|trio]
[--kill-every 0.5] [--chaos-requests 3000] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
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


async def bench_chaos(args: argparse.Namespace) -> dict[str, Any]:
    from engine_core._engine.dp.client import DPClient

    engine = AsyncLLM(
        backend="mock",
        tokenizer="byte",
        max_num_seqs=64,
        data_parallel_size=args.chaos_engines,
        dp_restart_engines=True,
        dp_failover=args.chaos_failover,
        backend_options={"latency": {"step_s": args.chaos_step_s}},
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.chaos_output_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    rng = random.Random(0)
    # Last tokens low enough that counting up never wraps around the vocabulary.
    prompts = [
        [rng.randrange(1, 200) for _ in range(args.prompt_tokens)]
        for _ in range(args.chaos_requests)
    ]
    outcomes: collections.Counter[str] = collections.Counter()
    kills = outages = 0
    done = anyio.Event()

    async def run(prompt: list[int]) -> None:
        tokens: list[int] = []
        try:
            async for out in engine.generate({"prompt_token_ids": prompt}, params):
                tokens += out.outputs[0].token_ids
        except Exception as exc:
            outcomes[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1
            return
        first = prompt[-1] + 1
        exact = tokens == list(range(first, first + args.chaos_output_tokens))
        outcomes["exact" if exact else "wrong"] += 1

    async def chaos(client: DPClient) -> None:
        nonlocal kills, outages
        kill_rng = random.Random(1)
        while not done.is_set():
            with anyio.move_on_after(args.kill_every):
                await done.wait()
            if done.is_set():
                return
            alive = [e["pid"] for e in client.engine_status() if e["alive"] and e["pid"]]
            if not alive:
                outages += 1
                continue
            try:
                os.kill(kill_rng.choice(alive), signal.SIGKILL)
                kills += 1
            except ProcessLookupError:
                pass

    async with engine:
        client = engine._client
        assert isinstance(client, DPClient)
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(chaos, client)
            async with anyio.create_task_group() as requests:
                for prompt in prompts:
                    requests.start_soon(run, prompt)
            done.set()
        seconds = time.perf_counter() - start
        restarts = sum(client.metrics.engine_restarts)
        dead = engine.dead_error
    result = {
        "requests": args.chaos_requests,
        "outcomes": dict(outcomes),
        "kills": kills,
        "restarts": restarts,
        "ticks_with_no_engine_alive": outages,
        "seconds": seconds,
        "deployment_dead": None if dead is None else str(dead),
    }
    failed = args.chaos_requests - outcomes["exact"]
    print(
        f"(c) chaos, DP={args.chaos_engines}, a SIGKILL every {args.kill_every} s, restarts on, "
        f"dp_failover={args.chaos_failover}: {outcomes['exact']} of {args.chaos_requests} "
        f"exact, {failed} not; {kills} kills, {restarts} restarts, no engine alive at "
        f"{outages} ticks; {seconds:.1f} s; deployment dead: {result['deployment_dead']}"
    )
    for outcome, count in sorted(outcomes.items(), key=lambda item: -item[1]):
        print(f"    {count:>6}  {outcome}")
    return result


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
    parser.add_argument("--kill-every", type=float, default=0.5, help="(c) seconds between kills")
    parser.add_argument("--chaos-requests", type=int, default=3000)
    parser.add_argument("--chaos-output-tokens", type=int, default=32)
    parser.add_argument("--chaos-engines", type=int, default=2)
    parser.add_argument("--chaos-step-s", type=float, default=0.01)
    parser.add_argument("--chaos-failover", choices=["retry", "fail", "resume"], default="resume")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(machine_line())
    only = set(args.only.split(","))
    results: dict[str, Any] = {}
    if "a" in only:
        results["throughput"] = anyio.run(bench_throughput, args, backend=args.runtime)
    if "b" in only:
        results["router"] = bench_router(args)
    if "c" in only:
        results["chaos"] = anyio.run(bench_chaos, args, backend=args.runtime)
    write_results(args.json, results)


if __name__ == "__main__":
    main()
