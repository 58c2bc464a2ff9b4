#!/usr/bin/env python3
"""The HTTP layer's cost: the OpenAI server vs the same load through ``AsyncLLM`` directly.

Mock backend (zero latency, or ``--step-ms`` per step), byte tokenizer, ``--concurrency``
concurrent streaming chat requests of ``--max-tokens`` output tokens each (``ignore_eos``,
greedy), on ``--runtime`` (asyncio runs on uvloop where installed, as ``engine-core serve``
does):

- server: ``engine-core serve`` in its own process (its engine core in another; uvicorn under
  asyncio, hypercorn under trio), driven by the load generator of ``engine-core bench serve``
  from this process (always on asyncio);
- direct: ``AsyncLLM`` in this process (its engine core in another), the same prompt tokens
  (the chat template rendered by the server's code) and the same timings: TTFT to the first
  output carrying text, one ITL sample per later output carrying text.

Rounds alternate direct and server runs so both see the same machine load; the ratio is
computed per round (its median is reported) and between the best run of each side (noise from
other work on the machine only ever slows a run down).

Usage: ``python bench/bench_http.py [--rounds 7] [--concurrency 256] [--max-tokens 128]
[--runtime asyncio|trio] [--step-ms MS] [--no-multiprocess] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import anyio

from engine_core import AsyncLLM, RequestOutputKind, SamplingParams
from engine_core._bench.client import LoadResult, RequestResult, run_load
from engine_core._bench.machine import machine_line
from engine_core._bench.server_process import server_process
from engine_core.cli import run_options
from engine_core.server import ServerSettings, load_chat_template
from engine_core.server._run import http_server_for

PROMPT = "Tell me about the quick brown fox."
MODEL = "bench"


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """The mock's options: a fixed time per step when ``--step-ms`` is given."""
    return {"latency": {"step_s": args.step_ms / 1000}} if args.step_ms else {}


def server_flags(args: argparse.Namespace) -> list[str]:
    """``engine-core serve``'s flags: the mock on a free loopback port, as the direct runs."""
    return [
        "--backend", "mock", "--tokenizer", "byte", "--port", "0",
        "--max-num-seqs", str(args.concurrency), "--served-model-name", MODEL,
        "--runtime", args.runtime, "--log-level", "warning",
        "--multiprocess" if args.multiprocess else "--no-multiprocess",
        "--backend-options", json.dumps(backend_options(args)),
    ]  # fmt: skip


async def direct_load(
    engine: AsyncLLM, args: argparse.Namespace, token_ids: list[int]
) -> LoadResult:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    results: list[RequestResult] = []
    remaining = iter(range(args.num_requests))

    async def one() -> RequestResult:
        start = time.perf_counter()
        result = RequestResult(ok=True, latency=0.0, prompt_tokens=len(token_ids))
        last = None
        async for output in engine.generate({"prompt_token_ids": token_ids}, params):
            now = time.perf_counter()
            completion = output.outputs[0]
            result.output_tokens += len(completion.token_ids)
            if completion.text:
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        return result

    async def worker() -> None:
        for _ in remaining:
            results.append(await one())

    start = time.perf_counter()
    async with anyio.create_task_group() as task_group:
        for _ in range(min(args.concurrency, args.num_requests)):
            task_group.start_soon(worker)
    return LoadResult(results, time.perf_counter() - start)


async def server_load(url: str, args: argparse.Namespace) -> LoadResult:
    return await run_load(
        url,
        endpoint="chat",
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        prompt=PROMPT,
        max_tokens=args.max_tokens,
        model=MODEL,
    )


def _check(name: str, result: LoadResult, args: argparse.Namespace) -> None:
    expected = args.num_requests * args.max_tokens
    if result.num_failed or result.output_tokens != expected:
        errors = [r.error for r in result.results if r.error]
        raise RuntimeError(
            f"{name}: {result.num_failed} failed, {result.output_tokens} tokens (expected "
            f"{expected}); first error: {errors[:1]}"
        )


def _row(name: str, s: dict[str, float]) -> str:
    return (
        f"{name:<8} {s['output_tok_per_s']:>10,.0f} {s['request_per_s']:>8,.1f} "
        f"{s['ttft_p50_ms']:>8.1f} {s['ttft_p90_ms']:>8.1f} {s['ttft_p99_ms']:>8.1f} "
        f"{s['itl_p50_ms']:>7.2f} {s['itl_p90_ms']:>7.2f} {s['itl_p99_ms']:>7.2f}"
    )


HEADER = (
    f"{'':<8} {'out tok/s':>10} {'req/s':>8} {'TTFT p50':>8} {'p90':>8} {'p99':>8} "
    f"{'ITL p50':>7} {'p90':>7} {'p99':>7}   (ms)"
)


def direct_round(args: argparse.Namespace, token_ids: list[int]) -> LoadResult:
    """One direct run, on the benchmark's runtime (the engine starts before the clock does)."""

    async def main() -> LoadResult:
        async with AsyncLLM(
            backend="mock",
            tokenizer="byte",
            max_num_seqs=args.concurrency,
            multiprocess=args.multiprocess,
            backend_options=backend_options(args),
        ) as engine:
            warm = argparse.Namespace(**{**vars(args), "num_requests": 16, "concurrency": 16})
            await direct_load(engine, warm, token_ids)
            return await direct_load(engine, args, token_ids)

    result: LoadResult = anyio.run(main, **run_options(args.runtime))
    return result


def server_round(args: argparse.Namespace, url: str) -> LoadResult:
    """One run against the server; the load generator always runs on asyncio."""

    async def main() -> LoadResult:
        warm = argparse.Namespace(**{**vars(args), "num_requests": 16, "concurrency": 16})
        await server_load(url, warm)
        return await server_load(url, args)

    result: LoadResult = anyio.run(main, **run_options("asyncio"))
    return result


def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    chat = load_chat_template("byte").render([{"role": "user", "content": PROMPT}])
    token_ids = list(chat.encode())
    rounds: list[dict[str, Any]] = []
    print(HEADER, flush=True)
    for _ in range(args.rounds):
        direct = direct_round(args, token_ids)
        _check("direct", direct, args)
        server = server_round(args, url)
        _check("server", server, args)
        d, s = direct.summary(), server.summary()
        ratio = s["output_tok_per_s"] / d["output_tok_per_s"]
        print(_row("direct", d), flush=True)
        print(_row("server", s), f"  ratio {ratio:.2f}", flush=True)
        rounds.append({"direct": d, "server": s, "ratio": ratio})
    return {"rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--num-requests", type=int, default=None, help="default: concurrency")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runtime", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument(
        "--multiprocess",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="engine core in its own process (the default) or in the front end's event loop",
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="simulated time of every engine step (default 0: the mock as fast as it goes)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.num_requests = args.num_requests or args.concurrency
    print(machine_line(), flush=True)
    loop = "uvloop" if run_options(args.runtime).get("backend_options") else args.runtime
    where = "in its own process" if args.multiprocess else "in the front end's event loop"
    print(
        f"mock backend ({f'{args.step_ms:g} ms' if args.step_ms else 'zero'} per step), byte "
        f"tokenizer, {loop}: {args.num_requests} "
        f"streaming chat requests, {args.concurrency} concurrent, {args.max_tokens} output "
        f"tokens each; engine core {where} in both runs; HTTP server "
        f"{http_server_for(ServerSettings(), args.runtime)}",
        flush=True,
    )
    with server_process(server_flags(args)) as (url, _):
        result = run(args, url)
    ratios = [r["ratio"] for r in result["rounds"]]
    median = statistics.median(ratios)
    best = {
        side: max(result["rounds"], key=lambda r, side=side: r[side]["output_tok_per_s"])[side]
        for side in ("direct", "server")
    }
    best_ratio = best["server"]["output_tok_per_s"] / best["direct"]["output_tok_per_s"]
    print("best of each side:")
    print(_row("direct", best["direct"]))
    print(_row("server", best["server"]), f"  ratio {best_ratio:.2f}")
    print(
        f"server / direct output tok/s: median {median:.2f} over {len(ratios)} rounds "
        f"({', '.join(f'{r:.2f}' for r in ratios)}), {best_ratio:.2f} best against best; "
        "target >= 0.50"
    )
    result |= {"median_ratio": median, "best_ratio": best_ratio, "best": best}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_line(), **result}, f, indent=2)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
