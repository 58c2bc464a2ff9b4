#!/usr/bin/env python3
"""KV capacity per layout on the mock: hybrid (sliding-window + full layers in KV-cache groups)
against the same model allocated as all-full, at equal device memory.

Two model shapes (8 KV heads of 128, 2-byte KV, blocks of 16):

- Gemma-3-like: 12 layers, five window-1024 layers per full one;
- gpt-oss-like: 24 layers alternating full and window-128.

Each run: 64 requests of 16k-token prompts (the byte tokenizer: 16384 distinct bytes of text
each), 64 greedy output tokens, ``max_num_seqs`` 64, 8192 tokens per step, a latency model of
2 ms per step plus 2 us per scheduled token. The engine core is stepped in this process and
``get_stats()`` polled after every step: the peak of running requests, and output tokens per
second of wall time. The device memory holds about six all-full requests.

Then a second wave: the prompts of the last requests to finish in the first wave, as many as
the all-full pool holds less two (latest first), whose prefix hit rate shows the per-group
prefix cache at work (the full groups' blocks and the windows' last blocks); their outputs
must equal the first wave's.

Usage: ``python bench/bench_kv_layouts.py [--requests N] [--prompt-tokens N] [--rounds N]
[--json PATH]`` (each layout runs ``--rounds`` times, interleaved; the median tok/s is kept).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from engine_core._bench.machine import machine_line, write_results
from engine_core._core.engine_io import EngineCoreRequest
from engine_core._engine.core import EngineCore
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams

BLOCK_SIZE = 16
GEOMETRY = {"num_kv_heads": 8, "head_size": 128, "dtype_bytes": 2}
LAYER_PAGE = 2 * BLOCK_SIZE * 8 * 128 * 2
"""Bytes of one block of one layer."""
FULL_REQUESTS = 6.2
"""Device memory: about this many all-full requests."""


def gemma3_like() -> tuple[list[str], int]:
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(12)], 1024


def gpt_oss_like() -> tuple[list[str], int]:
    return ["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(24)], 128


def prompts(n: int, length: int) -> list[str]:
    rng = random.Random(7)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,."
    return [f"{i:04d}:" + "".join(rng.choices(alphabet, k=length - 5)) for i in range(n)]


def run(
    layer_types: list[str],
    window: int,
    memory: int,
    texts: list[str],
    wave2: int,
    max_tokens: int,
) -> dict[str, Any]:
    config = EngineConfig(
        backend="mock",
        tokenizer="byte",
        block_size=BLOCK_SIZE,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        max_model_len=len(texts[0]) + max_tokens + 8,
        kv_cache_memory_fraction=1.0,
        backend_options={
            **GEOMETRY,
            "num_layers": len(layer_types),
            "layer_types": layer_types,
            "sliding_window": window,
            "device_memory_bytes": memory,
            "latency": {"step_s": 0.002, "per_token_s": 2e-6},
        },
    )
    core = EngineCore(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def wave(order: list[int], tag: str) -> dict[str, Any]:
        outputs: dict[int, list[int]] = {i: [] for i in order}
        before = core.get_stats()
        for i in order:
            tokens = list(texts[i].encode())
            core.add_request(EngineCoreRequest(f"{tag}{i}", tokens, params))
        peak = 0
        finished: list[int] = []
        start = time.perf_counter()
        while core.has_unfinished_requests():
            out = core.step()
            for req_id, new in zip(out.req_ids, out.new_token_ids, strict=True):
                outputs[int(req_id[len(tag) :])].extend(new)
            finished.extend(int(f.req_id[len(tag) :]) for f in out.finished)
            peak = max(peak, core.get_stats().num_running)
        wall = time.perf_counter() - start
        after = core.get_stats()
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        num_tokens = sum(len(v) for v in outputs.values())
        return {
            "requests": len(order),
            "peak_running": peak,
            "output_tokens": num_tokens,
            "wall_s": wall,
            "output_tok_per_s": num_tokens / wall,
            "prefix_hit_rate": hits / queries if queries else 0.0,
            "preemptions": after.num_preemptions - before.num_preemptions,
            "outputs": outputs,
            "finished": finished,
        }

    first = wave(list(range(len(texts))), "a")
    result = {"num_kv_blocks": core.num_kv_blocks, "first": first}
    # The second wave: the prompts of the last requests to finish, latest first.
    again = first["finished"][::-1][:wave2]
    second = result["second"] = wave(again, "b")
    result["second_same"] = all(second["outputs"][i] == first["outputs"][i] for i in again)
    stats = core.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "blocks leaked"
    core.close()
    return result


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median output tok/s (the other figures are the same in every run)."""
    return sorted(runs, key=lambda r: r["first"]["output_tok_per_s"])[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs (median kept)")
    parser.add_argument("--json", default=None, help="write results to this path")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    texts = prompts(args.requests, args.prompt_tokens)
    blocks_per_request = -(-(args.prompt_tokens + args.max_tokens) // BLOCK_SIZE)
    rows = []
    for name, (types, window) in (("gemma3-like", gemma3_like()), ("gpt-oss-like", gpt_oss_like())):
        full_types = ["full_attention"] * len(types)
        memory = int(FULL_REQUESTS * blocks_per_request * len(types) * LAYER_PAGE)
        # The second wave: what the all-full pool holds, less two requests of margin.
        wave2 = int(FULL_REQUESTS) - 2
        fulls, hybrids = [], []
        for _ in range(args.rounds):  # interleaved: the machine's load drifts
            fulls.append(run(full_types, window, memory, texts, wave2, args.max_tokens))
            hybrids.append(run(types, window, memory, texts, wave2, args.max_tokens))
        full, hybrid = _median(fulls), _median(hybrids)
        same = (
            full["first"]["outputs"] == hybrid["first"]["outputs"]
            and full["second_same"]
            and hybrid["second_same"]
        )
        for label, r in (("all-full", full), ("hybrid", hybrid)):
            rows.append(
                {
                    "model": name,
                    "layout": label,
                    "memory_bytes": memory,
                    "num_kv_blocks": r["num_kv_blocks"],
                    "peak_running": r["first"]["peak_running"],
                    "output_tok_per_s": r["first"]["output_tok_per_s"],
                    "wall_s": r["first"]["wall_s"],
                    "preemptions": r["first"]["preemptions"],
                    "wave2_requests": r["second"]["requests"],
                    "wave2_hit_rate": r["second"]["prefix_hit_rate"],
                    "identical_outputs": same,
                }
            )
        rows.append(
            {
                "model": name,
                "layout": "ratio",
                "peak_running": hybrid["first"]["peak_running"] / full["first"]["peak_running"],
                "output_tok_per_s": hybrid["first"]["output_tok_per_s"]
                / full["first"]["output_tok_per_s"],
            }
        )
    print(
        f"{'model':<13} {'layout':<9} {'blocks':>7} {'peak running':>12} {'out tok/s':>10} "
        f"{'preempt':>7} {'wave-2 hit':>10} {'same out':>8}"
    )
    for r in rows:
        if r["layout"] == "ratio":
            print(
                f"{r['model']:<13} {'ratio':<9} {'':>7} {r['peak_running']:>11.2f}x "
                f"{r['output_tok_per_s']:>9.2f}x"
            )
            continue
        print(
            f"{r['model']:<13} {r['layout']:<9} {r['num_kv_blocks']:>7} {r['peak_running']:>12} "
            f"{r['output_tok_per_s']:>10.0f} {r['preemptions']:>7} "
            f"{r['wave2_hit_rate']:>10.3f} {str(r['identical_outputs']):>8}"
        )
    write_results(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
