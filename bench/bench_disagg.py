#!/usr/bin/env python3
"""Prefill/decode disaggregation on the mock: colocated against disaggregated, two engines
either way, in one run.

Cost model (``backend_options``): the synthetic 8B geometry (128 KiB of KV per token), a step
costs ``latency.step_s`` = 10 ms plus ``latency.per_token_s`` = 25 us per scheduled token (an
8k-token prefill: ~205 ms), the engines' link 50 GB/s with 10 us per transfer
(``kv_link``). Workload: ``--streams`` decode streams (64) of ``--stream-tokens`` output tokens
(512) after a short prompt, while an 8k-token prompt (``--long-tokens``) arrives every
``--long-every`` seconds (0.25) and generates 16 tokens.

- colocated: ``engine_roles = ["both", "both"]``, the prefix router: each long prompt's prefill
  shares steps with the streams of its engine;
- disaggregated: ``["prefill", "decode"]``: long prompts are computed on the prefill engine, the
  decode engine pulls their blocks and carries every stream.

Figures, each beside its target: ITL p50/p99 of the decode streams (target: disaggregated p99
<= 0.5x colocated), TTFT p50/p99 of the long prompts, total output tok/s (the honest cost),
outputs token-identical (greedy), and fault drills (the prefill engine killed mid-transfer,
every transfer dropped, a lease expired, the decode engine killed mid-stream with
``dp_failover="resume"``): every request ends with the colocated run's tokens or a clear error
and no engine holds a block.

``--handoff N`` measures instead the handoff itself on each path: N requests one after another
(a 2k-token prompt, 2 output tokens, a link of no modelled cost), once over the same host's
shared memory and once over the authenticated ZMQ transport (``pd_transport="zmq"``, what a
decode engine on another machine uses): the decode side's mean time from a load's start to its
report (``pd_handoff_s_<path>`` / ``pd_transfers_<path>``).

Usage: ``python bench/bench_disagg.py [--streams 64] [--handoff N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import time
from typing import Any

import anyio

from engine_core import AsyncLLM, RequestOutputKind, SamplingParams
from engine_core._bench.machine import machine_line, write_results
from engine_core._engine.dp.client import DPClient

STEP_S = 10e-3
PER_TOKEN_S = 25e-6
LINK = {"bytes_per_s": 50e9, "latency_s": 10e-6, "deadline_s": 5.0}


def prompt(i: int, length: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(1, 251) for _ in range(length)]


def engine(roles: list[str], *, link: dict[str, Any] | None = None, **kwargs: Any) -> AsyncLLM:
    return AsyncLLM(
        backend="mock",
        tokenizer="byte",
        data_parallel_size=2,
        engine_roles=roles,
        max_num_seqs=256,
        max_model_len=16384,
        backend_options={
            "latency": {"step_s": STEP_S, "per_token_s": PER_TOKEN_S},
            "kv_link": {**LINK, **(link or {})},
            **kwargs.pop("options", {}),
        },
        **kwargs,
    )


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stream(
    llm: AsyncLLM, rid: str, tokens: list[int], max_tokens: int, first: anyio.Event | None = None
) -> tuple[list[int], list[float], float, str | None]:
    """Output tokens, arrival times of each delta, TTFT, finish reason (or the error)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    start = time.perf_counter()
    out_tokens: list[int] = []
    times: list[float] = []
    reason = None
    try:
        async for out in llm.generate({"prompt_token_ids": tokens}, params, request_id=rid):
            now = time.perf_counter()
            c = out.outputs[0]
            if c.token_ids:
                if first is not None:
                    first.set()
                out_tokens.extend(c.token_ids)
                times.extend([now] * len(c.token_ids))
            reason = c.finish_reason or reason
    except Exception as exc:  # a clear error is an acceptable end in the drills
        reason = f"error: {exc}"
    ttft = times[0] - start if times else float("nan")
    return out_tokens, times, ttft, reason


async def workload(llm: AsyncLLM, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}

    async def one(rid: str, tokens: list[int], max_tokens: int) -> None:
        results[rid] = await stream(llm, rid, tokens, max_tokens)

    start = time.perf_counter()
    with anyio.fail_after(600):
        async with anyio.create_task_group() as tg:
            for i in range(args.streams):
                tg.start_soon(one, f"s{i}", prompt(i, args.stream_prompt), args.stream_tokens)
            await anyio.sleep(0.5)  # the streams are decoding
            streams_done = anyio.Event()

            async def watch() -> None:
                while not all(f"s{i}" in results for i in range(args.streams)):
                    await anyio.sleep(0.05)
                streams_done.set()

            tg.start_soon(watch)
            j = 0
            while not streams_done.is_set():
                tg.start_soon(one, f"L{j}", prompt(10_000 + j, args.long_tokens), 16)
                j += 1
                with anyio.move_on_after(args.long_every):
                    await streams_done.wait()
    wall = time.perf_counter() - start
    itl = []
    for i in range(args.streams):
        times = results[f"s{i}"][1]
        itl.extend(b - a for a, b in zip(times, times[1:], strict=False) if b > a)
    ttft = [v[2] for k, v in results.items() if k.startswith("L")]
    # The handoff's cost shows after the first token: the transfer, then the decode engine.
    second = [v[1][1] - v[1][0] for k, v in results.items() if k.startswith("L") and len(v[1]) > 1]
    total = sum(len(v[0]) for v in results.values())
    return {
        "itl_p50_ms": 1e3 * pct(itl, 0.5),
        "itl_p99_ms": 1e3 * pct(itl, 0.99),
        "ttft_p50_ms": 1e3 * pct(ttft, 0.5),
        "ttft_p99_ms": 1e3 * pct(ttft, 0.99),
        "second_p50_ms": 1e3 * pct(second, 0.5),
        "second_p99_ms": 1e3 * pct(second, 0.99),
        "tok_s": total / wall,
        "num_long": len(ttft),
        "errors": sum(str(v[3]).startswith("error") for v in results.values()),
        "outputs": {k: v[0] for k, v in results.items()},
    }


async def held_blocks(llm: AsyncLLM) -> int:
    """Blocks some live engine still holds once transfers settle (0: none)."""
    held = 0
    for _ in range(300):
        stats = await llm.get_stats()
        held = sum(s.num_kv_blocks - s.num_free_kv_blocks for s in stats.engines)
        if held == 0:
            return 0
        await anyio.sleep(0.02)
    return held


async def run_config(roles: list[str], args: argparse.Namespace) -> dict[str, Any]:
    async with engine(roles) as llm:
        result = await workload(llm, args)
        result["held_blocks"] = await held_blocks(llm)
        stats = await llm.get_stats()
        result["transfers"] = stats.kv_transfer.get("pd_transfers", 0)
        result["recomputes"] = stats.kv_transfer.get("pd_transfer_failed", 0)
        return result


# -- fault drills ---------------------------------------------------------------------------------


async def drill(
    name: str, expected: dict[str, list[int]], requests: dict[str, list[int]], **kwargs: Any
) -> dict[str, Any]:
    kill: int | None = kwargs.pop("kill", None)
    kill_after: float = kwargs.pop("kill_after", 0.05)
    async with engine(["prefill", "decode"], **kwargs) as llm:
        client = llm._client
        assert isinstance(client, DPClient)
        results: dict[str, Any] = {}
        first = anyio.Event()

        async def one(rid: str) -> None:
            results[rid] = await stream(llm, rid, requests[rid], 32, first)

        async def killer() -> None:
            if kill is None:
                return
            await first.wait()  # a first token: its decode leg is on its way (or decoding)
            await anyio.sleep(kill_after)  # mid-transfer, or mid-stream
            pid = client.pids[kill]
            if pid is not None:
                os.kill(pid, signal.SIGKILL)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(killer)
                for rid in requests:
                    tg.start_soon(one, rid)
        right = sum(results[r][0] == expected[r] for r in requests)
        errors = [r for r in requests if str(results[r][3]).startswith("error")]
        wrong = len(requests) - right - len(errors)
        held = await held_blocks(llm)
        stats = await llm.get_stats()
        return {
            "drill": name,
            "requests": len(requests),
            "identical": right,
            "clear_errors": len(errors),
            "wrong": wrong,
            "held_blocks": held,
            "recomputes": stats.kv_transfer.get("pd_transfer_failed", 0),
            "lease_expired": stats.kv_transfer.get("pd_lease_expired", 0),
        }


async def drills(args: argparse.Namespace) -> list[dict[str, Any]]:
    requests = {f"d{i}": prompt(20_000 + i, 1024) for i in range(6)}
    async with engine(["both", "both"]) as llm:
        expected = {r: (await stream(llm, r, t, 32))[0] for r, t in requests.items()}
    slow = {"latency_s": 0.3}
    return [
        await drill("prefill engine killed mid-transfer", expected, requests, link=slow, kill=0),
        await drill(
            "every transfer dropped",
            expected,
            requests,
            link={"fault": {"kind": "drop", "probability": 1.0, "seed": 1}},
        ),
        await drill(
            "lease expired (no renewal)",
            expected,
            requests,
            link={"latency_s": 1.0},
            kv_lease_s=0.3,
            kv_connector_options={"renew": False},
        ),
        await drill(
            "decode engine killed mid-transfer (retry)", expected, requests, link=slow, kill=1
        ),
        await drill(
            "decode engine killed mid-stream (resume)",
            expected,
            requests,
            kill=1,
            kill_after=0.2,
            dp_failover="resume",
        ),
    ]


async def handoff(args: argparse.Namespace) -> dict[str, Any]:
    """Mean handoff latency per path (see the module)."""
    out: dict[str, Any] = {}
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for path, transport in (("shm", "auto"), ("zmq", "zmq")):
        llm = engine(
            ["prefill", "decode"],
            link={"bytes_per_s": 1e15, "latency_s": 0.0},
            kv_connector_options={"pd_transport": transport},
        )
        async with llm:
            for i in range(args.handoff):
                tokens = {"prompt_token_ids": prompt(10_000 + i, 2048)}
                async for _ in llm.generate(tokens, params, request_id=f"h{i}"):
                    pass
            stats = await llm.get_stats()
        decode = next(s.kv_transfer for s in stats.engines if s.engine_role == "decode")
        n = decode.get(f"pd_transfers_{path}", 0)
        out[path] = {
            "transfers": n,
            "recomputes": decode.get("pd_transfer_failed", 0),
            "handoff_ms": 1e3 * decode.get(f"pd_handoff_s_{path}", 0.0) / n if n else float("nan"),
        }
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    if args.handoff:
        return {"handoff": await handoff(args)}
    colocated = await run_config(["both", "both"], args)
    disagg = await run_config(["prefill", "decode"], args)
    common = set(colocated["outputs"]) & set(disagg["outputs"])
    identical = sum(colocated["outputs"][k] == disagg["outputs"][k] for k in common)
    out = {
        "colocated": {k: v for k, v in colocated.items() if k != "outputs"},
        "disaggregated": {k: v for k, v in disagg.items() if k != "outputs"},
        "identical": identical,
        "compared": len(common),
        "drills": [] if args.no_drills else await drills(args),
    }
    return out


def report(out: dict[str, Any]) -> None:
    print(machine_line())
    if "handoff" in out:
        for path, row in out["handoff"].items():
            print(
                f"handoff over {path}: {row['handoff_ms']:.2f} ms mean (load start to report), "
                f"{row['transfers']:.0f} transfers, {row['recomputes']:.0f} recomputes"
            )
        return
    c, d = out["colocated"], out["disaggregated"]
    print(f"{'':28}{'colocated':>12}{'disagg':>12}{'ratio':>9}  target")
    rows = [
        ("ITL p50 (ms)", "itl_p50_ms", ""),
        ("ITL p99 (ms)", "itl_p99_ms", "disagg <= 0.5x colocated"),
        ("TTFT p50, long (ms)", "ttft_p50_ms", "(the cost)"),
        ("TTFT p99, long (ms)", "ttft_p99_ms", "(the cost)"),
        ("2nd token p50, long (ms)", "second_p50_ms", "(the handoff's cost)"),
        ("2nd token p99, long (ms)", "second_p99_ms", "(the handoff's cost)"),
        ("total tok/s", "tok_s", "(the cost)"),
    ]
    for label, key, target in rows:
        ratio = d[key] / c[key] if c[key] else float("nan")
        print(f"{label:28}{c[key]:12.1f}{d[key]:12.1f}{ratio:9.2f}  {target}")
    ratio = d["itl_p99_ms"] / c["itl_p99_ms"]
    print(
        f"ITL p99 ratio {ratio:.2f} (target <= 0.50: {'met' if ratio <= 0.5 else 'NOT met'}); "
        f"long prompts {c['num_long']} / {d['num_long']}; transfers {d['transfers']:.0f}, "
        f"recomputes {d['recomputes']:.0f}; errors {c['errors']} / {d['errors']} (target 0)"
    )
    print(
        f"outputs identical (greedy): {out['identical']}/{out['compared']} (target: all); "
        f"blocks held after: colocated {c['held_blocks']}, disagg {d['held_blocks']} (target 0)"
    )
    for row in out["drills"]:
        ok = row["wrong"] == 0 and row["held_blocks"] == 0
        print(
            f"drill {row['drill']:42} identical {row['identical']}/{row['requests']}, "
            f"clear errors {row['clear_errors']}, wrong {row['wrong']}, held blocks "
            f"{row['held_blocks']}, recomputes {row['recomputes']:.0f}, lease expiries "
            f"{row['lease_expired']:.0f} (target: no wrong output, 0 held) {'ok' if ok else 'FAIL'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--stream-tokens", type=int, default=512)
    parser.add_argument("--stream-prompt", type=int, default=128)
    parser.add_argument("--long-tokens", type=int, default=8192)
    parser.add_argument("--long-every", type=float, default=0.25)
    parser.add_argument("--no-drills", action="store_true")
    parser.add_argument(
        "--handoff", type=int, default=0, help="measure the handoff per path (N requests)"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    out = anyio.run(main_async, args)
    report(out)
    if args.json:
        write_results(args.json, out)


if __name__ == "__main__":
    main()
