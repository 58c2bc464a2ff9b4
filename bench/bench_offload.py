#!/usr/bin/env python3
"""The host KV tier (CPU offload) on the mock: tier off against tier on, in one run.

The engine runs in its own process (``AsyncLLM``, ``multiprocess=True``) on the mock with a
cost model: the synthetic 8B geometry (32 layers, 8 KV heads of 128, bf16: 128 KiB of KV per
token, 2 MiB per 16-token block), prefill ``latency.per_token_s`` = 25 us, and the modelled
host link at 50 GB/s with 10 us per transfer (``backend_options["kv_link"]``; the mock's host
pool is bookkeeping only). Scenarios, each with its target:

1. working set 4x the device cache, 512-token prompts re-sent (100 % host hit after a warm-up
   round): throughput >= 5x off;
2. one 8k-token prompt re-sent after eviction: TTFT <= 1/4 of recompute;
3. all misses (unique prompts): throughput >= 0.98x off;
4. KV pressure with preemption (max_num_seqs 256, small device cache): recomputed tokens
   <= 1/3 of off;
5. fault drills (drop, corrupt, late; the engine killed mid-transfer): every request ends,
   outputs of recomputed requests equal a fault-free run, zero leaked blocks (device and host),
   no stalled scheduler (a deadline on every run).

Usage: ``python bench/bench_offload.py [--rounds 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

import anyio

from engine_core import AsyncLLM, EngineDeadError, SamplingParams
from engine_core._bench.machine import machine_line, write_results

PER_TOKEN_S = 25e-6
LINK = {"bytes_per_s": 50e9, "latency_s": 10e-6, "host_memory_bytes": 1 << 40}
OFFLOAD = "8GiB"


def prompt(i: int, length: int) -> list[int]:
    """A distinct prompt per ``i`` (token ids 1..250)."""
    rng = random.Random(i)
    return [rng.randrange(1, 251) for _ in range(length)]


def engine(offload: bool, *, link: dict[str, Any] | None = None, **kwargs: Any) -> AsyncLLM:
    options: dict[str, Any] = {
        "latency": {"per_token_s": PER_TOKEN_S},
        "kv_link": {**LINK, **(link or {})},
        **kwargs.pop("options", {}),
    }
    return AsyncLLM(
        backend="mock",
        tokenizer="byte",
        multiprocess=True,
        kv_offload_bytes=OFFLOAD if offload else 0,
        backend_options=options,
        **kwargs,
    )


async def generate(
    llm: AsyncLLM, request_id: str, tokens: list[int], max_tokens: int
) -> tuple[list[int], float, str | None]:
    """Output tokens, TTFT, finish reason (``"dead"``: the engine died)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    ttft = 0.0
    final = None
    try:
        async for out in llm.generate({"prompt_token_ids": tokens}, params, request_id=request_id):
            if not ttft:
                ttft = time.perf_counter() - start
            final = out
    except EngineDeadError:
        return [], ttft, "dead"
    assert final is not None
    return list(final.outputs[0].token_ids), ttft, final.outputs[0].finish_reason


async def batch(
    llm: AsyncLLM, requests: list[tuple[str, list[int]]], max_tokens: int
) -> tuple[dict[str, list[int]], float, dict[str, str | None]]:
    results: dict[str, tuple[list[int], float, str | None]] = {}

    async def one(rid: str, tokens: list[int]) -> None:
        results[rid] = await generate(llm, rid, tokens, max_tokens)

    start = time.perf_counter()
    with anyio.fail_after(300):  # a stalled scheduler fails the run
        async with anyio.create_task_group() as tg:
            for rid, tokens in requests:
                tg.start_soon(one, rid, tokens)
    wall = time.perf_counter() - start
    return (
        {r: v[0] for r, v in results.items()},
        wall,
        {r: v[2] for r, v in results.items()},
    )


async def settle(llm: AsyncLLM) -> Any:
    """The engine's stats once its transfers are done."""
    for _ in range(200):
        stats = await llm.get_stats()
        if (
            stats.num_free_kv_blocks == stats.num_kv_blocks
            and stats.kv_offload_free_blocks + stats.kv_offload_resident_blocks
            == stats.kv_offload_capacity_blocks
        ):
            return stats
        await anyio.sleep(0.01)
    return await llm.get_stats()


# -- scenarios ----------------------------------------------------------------------------------


async def working_set(rounds: int) -> dict[str, Any]:
    """32 prompts of 512 tokens (4x the 256-block device cache), re-sent."""
    prompts = [(f"p{i}", prompt(i, 512)) for i in range(32)]
    throughput: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, dict[str, list[int]]] = {}
    async with engine(False, num_kv_blocks=256) as off, engine(True, num_kv_blocks=256) as on:
        for llm in (off, on):
            await batch(llm, [(f"w-{r}", t) for r, t in prompts], 2)  # warm-up
        for r in range(rounds):
            for flag, llm in ((False, off), (True, on)):  # interleaved
                out, wall, _ = await batch(llm, [(f"{r}-{i}", t) for i, t in prompts], 2)
                throughput[flag].append(len(prompts) / wall)
                outputs[flag] = {k.split("-", 1)[1]: v for k, v in out.items()}
        stats = await settle(on)
    assert outputs[False] == outputs[True], "the host tier changed the output"
    ratio = statistics.median(throughput[True]) / statistics.median(throughput[False])
    hit = stats.kv_offload_hit_tokens
    return {
        "off_req_per_s": statistics.median(throughput[False]),
        "on_req_per_s": statistics.median(throughput[True]),
        "ratio": ratio,
        "host_hit_tokens": hit,
        "target": ">= 5x",
        "met": ratio >= 5,
    }


async def long_prompt(rounds: int) -> dict[str, Any]:
    """One 8k-token prompt, evicted by three others, re-sent: its TTFT. The device cache holds
    two such prompts (1100 blocks), so the last one's blocks, held while they are saved, do not
    keep the re-sent prompt waiting for room."""
    target = prompt(1000, 8192)
    kwargs = {"num_kv_blocks": 1100, "max_model_len": 8300}
    ttft: dict[bool, list[float]] = {False: [], True: []}
    async with engine(False, **kwargs) as off, engine(True, **kwargs) as on:
        for r in range(rounds):
            for flag, llm in ((False, off), (True, on)):
                await generate(llm, f"t{r}", target, 1)
                for k in range(3):
                    await generate(llm, f"e{r}-{k}", prompt(2000 + 10 * r + k, 8192), 1)
                _, t, _ = await generate(llm, f"again{r}", target, 1)
                ttft[flag].append(t)
    ratio = statistics.median(ttft[True]) / statistics.median(ttft[False])
    return {
        "off_ttft_s": statistics.median(ttft[False]),
        "on_ttft_s": statistics.median(ttft[True]),
        "ratio": ratio,
        "target": "<= 0.25x",
        "met": ratio <= 0.25,
    }


async def all_misses(rounds: int) -> dict[str, Any]:
    """Unique 512-token prompts only: what the tier costs on a miss."""
    throughput: dict[bool, list[float]] = {False: [], True: []}
    async with engine(False, num_kv_blocks=256) as off, engine(True, num_kv_blocks=256) as on:
        for r in range(rounds):
            for flag, llm in ((False, off), (True, on)):
                requests = [(f"m{r}-{i}", prompt(5000 + 100 * r + i, 512)) for i in range(48)]
                _, wall, _ = await batch(llm, requests, 2)
                throughput[flag].append(len(requests) / wall)
    ratio = statistics.median(throughput[True]) / statistics.median(throughput[False])
    return {
        "off_req_per_s": statistics.median(throughput[False]),
        "on_req_per_s": statistics.median(throughput[True]),
        "ratio": ratio,
        "target": ">= 0.98x",
        "met": ratio >= 0.98,
    }


async def pressure() -> dict[str, Any]:
    """64 requests of 256 + 128 tokens in a 320-block cache (they need 1536 at their peak)."""
    requests = [(f"q{i}", prompt(9000 + i, 256)) for i in range(64)]
    recomputed: dict[bool, int] = {}
    preemptions: dict[bool, int] = {}
    outputs: dict[bool, dict[str, list[int]]] = {}
    for flag in (False, True):
        async with engine(flag, num_kv_blocks=320, max_num_seqs=256) as llm:
            out, _, _ = await batch(llm, requests, 128)
            stats = await settle(llm)
            recomputed[flag] = stats.num_recomputed_tokens
            preemptions[flag] = stats.num_preemptions
            outputs[flag] = out
    assert outputs[False] == outputs[True], "the host tier changed the output"
    ratio = recomputed[True] / recomputed[False] if recomputed[False] else 0.0
    return {
        "off_recomputed_tokens": recomputed[False],
        "on_recomputed_tokens": recomputed[True],
        "off_preemptions": preemptions[False],
        "on_preemptions": preemptions[True],
        "ratio": ratio,
        "target": "<= 1/3",
        "met": recomputed[False] > 0 and ratio <= 1 / 3,
    }


async def drills() -> dict[str, Any]:
    """Faults on the link (probability 0.3), then the engine killed mid-transfer."""
    prompts = [(f"d{i}", prompt(7000 + i, 512)) for i in range(16)]
    results: dict[str, Any] = {}
    async with engine(True, num_kv_blocks=128) as llm:
        reference = {}
        for r in range(3):
            out, _, _ = await batch(llm, [(f"{r}-{rid}", t) for rid, t in prompts], 4)
            reference = {k.split("-", 1)[1]: v for k, v in out.items()}
    for kind in ("drop", "corrupt", "late"):
        link = {"fault": {"kind": kind, "probability": 0.3, "seed": 7, "late_s": 0.2}}
        link["deadline_s"] = 0.05
        async with engine(True, link=link, num_kv_blocks=128) as llm:
            ended = 0
            same = True
            for r in range(3):
                out, _, reasons = await batch(llm, [(f"{r}-{rid}", t) for rid, t in prompts], 4)
                ended += sum(1 for v in reasons.values() if v in ("length", "stop"))
                got = {k.split("-", 1)[1]: v for k, v in out.items()}
                same = same and got == reference
            stats = await settle(llm)
            leaked_device = stats.num_kv_blocks - stats.num_free_kv_blocks
            leaked_host = stats.kv_offload_capacity_blocks - (
                stats.kv_offload_free_blocks + stats.kv_offload_resident_blocks
            )
            results[kind] = {
                "requests": 3 * len(prompts),
                "ended": ended,
                "same_output": same,
                "failed_blocks": stats.kv_offload_failed_blocks,
                "leaked_device_blocks": leaked_device,
                "leaked_host_blocks": leaked_host,
                "met": ended == 3 * len(prompts) and same and not leaked_device and not leaked_host,
            }
    # The engine killed mid-transfer: a slow link keeps loads in flight when it exits.
    link = {"bytes_per_s": 2e9}
    start = time.perf_counter()
    async with engine(
        True, link=link, num_kv_blocks=128, options={"fault": {"kind": "exit", "at_step": 40}}
    ) as llm:
        total = ended = dead = 0
        for r in range(3):
            _, _, reasons = await batch(llm, [(f"{r}-{rid}", t) for rid, t in prompts], 4)
            total += len(reasons)
            ended += sum(1 for v in reasons.values() if v is not None)
            dead += sum(1 for v in reasons.values() if v == "dead")
    results["killed"] = {
        "requests": total,
        "ended": ended,
        "engine_dead_errors": dead,
        "wall_s": time.perf_counter() - start,
        "met": ended == total and dead > 0,
    }
    return results


async def main_async(rounds: int) -> dict[str, Any]:
    return {
        "working_set_4x": await working_set(rounds),
        "long_prompt_8k": await long_prompt(rounds),
        "all_misses": await all_misses(rounds),
        "preemption": await pressure(),
        "fault_drills": await drills(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = anyio.run(main_async, args.rounds)
    print(machine_line(), f"load average {os.getloadavg()}")
    w, t, m, p, d = (
        results[k]
        for k in ("working_set_4x", "long_prompt_8k", "all_misses", "preemption", "fault_drills")
    )
    rows = [
        (
            "working set 4x device, 512-token re-sent: throughput on/off",
            f"{w['ratio']:.2f}x ({w['off_req_per_s']:.1f} -> {w['on_req_per_s']:.1f} req/s)",
            w["target"],
            w["met"],
        ),
        (
            "8k prompt re-sent after eviction: TTFT on/off",
            f"{t['ratio']:.3f}x ({t['off_ttft_s'] * 1e3:.0f} -> {t['on_ttft_s'] * 1e3:.0f} ms)",
            t["target"],
            t["met"],
        ),
        (
            "all misses: throughput on/off",
            f"{m['ratio']:.3f}x ({m['off_req_per_s']:.1f} -> {m['on_req_per_s']:.1f} req/s)",
            m["target"],
            m["met"],
        ),
        (
            "preemption: recomputed tokens on/off",
            f"{p['ratio']:.3f} ({p['off_recomputed_tokens']} -> {p['on_recomputed_tokens']})",
            p["target"],
            p["met"],
        ),
    ]
    for kind in ("drop", "corrupt", "late"):
        r = d[kind]
        rows.append(
            (
                f"fault drill {kind} (p=0.3)",
                f"{r['ended']}/{r['requests']} ended, same output {r['same_output']}, "
                f"{r['failed_blocks']} failed blocks, leaked {r['leaked_device_blocks']} device / "
                f"{r['leaked_host_blocks']} host",
                "all end, same output, 0 leaked",
                r["met"],
            )
        )
    k = d["killed"]
    rows.append(
        (
            "engine killed mid-transfer",
            f"{k['ended']}/{k['requests']} ended ({k['engine_dead_errors']} EngineDeadError) in "
            f"{k['wall_s']:.1f} s",
            "every request ends, no hang",
            k["met"],
        )
    )
    print("| scenario | measured | target | met |\n| --- | --- | --- | --- |")
    for name, value, target, met in rows:
        print(f"| {name} | {value} | {target} | {'yes' if met else 'NO'} |")
    write_results(args.json, results)


if __name__ == "__main__":
    main()
