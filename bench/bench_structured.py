#!/usr/bin/env python3
"""What grammar-constrained decoding costs an engine step: mean step time of 64 requests under a
JSON schema vs 64 plain ones, on the mock backend with a fixed step latency.

The engine core is stepped in this process (``EngineCore.step``, the same ``execute`` the
engine-core process runs in its worker thread): with the mock's latency model its forward pass
sleeps ``--step-ms`` and the bitmask of the constrained requests is filled on a helper thread
meanwhile. Every request is greedy, 128 tokens long (``ignore_eos``; the schema's string never
closes under the mock's counting rule, so the constrained requests also run to the length
limit), so both runs have the same batches. Runs alternate (plain, constrained, ...) and the
ratio is taken per pair; the grammar is compiled once before timing (the cache serves the rest).
A third variant computes the bitmask after the forward pass instead of during it, to show what
the overlap saves.

Target: constrained / plain mean step time <= 1.10.

Usage: ``python bench/bench_structured.py [--repeat N] [--step-ms MS] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from engine_core._bench.machine import machine_line, write_results
from engine_core._core.engine_io import EngineCoreRequest
from engine_core._engine.core import EngineCore
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams, StructuredOutputsParams

NUM_REQUESTS = 64
MAX_TOKENS = 128
SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
}


def _core(step_s: float) -> EngineCore:
    return EngineCore(
        EngineConfig(
            backend="mock",
            tokenizer="byte",
            max_num_seqs=NUM_REQUESTS,
            backend_options={"latency": {"step_s": step_s}},
        )
    )


def _params(constrained: bool) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(json=SCHEMA) if constrained else None,
    )


def run_once(core: EngineCore, constrained: bool, overlap: bool = True) -> dict[str, Any]:
    """Step 64 requests to completion; per-step wall times."""
    params = _params(constrained)
    core.backend.step_in_thread = overlap  # False: the bitmask is filled after the forward pass
    for i in range(NUM_REQUESTS):
        prompt = list(f"request {i}: ".encode())
        core.add_request(
            EngineCoreRequest(f"{constrained}-{i}", prompt, params, eos_token_ids=[257])
        )
    if constrained and core.structured_output.num_pending:
        raise RuntimeError("the grammar should come from the cache")
    steps: list[float] = []
    finish: dict[str, int] = {}
    num_tokens = 0
    while core.has_unfinished_requests():
        start = time.perf_counter()
        out = core.step()
        steps.append(time.perf_counter() - start)
        num_tokens += sum(len(t) for t in out.new_token_ids)
        for f in out.finished:
            finish[f.finish_reason] = finish.get(f.finish_reason, 0) + 1
    if finish != {"length": NUM_REQUESTS} or num_tokens != NUM_REQUESTS * MAX_TOKENS:
        raise RuntimeError(f"unexpected run: {finish}, {num_tokens} tokens")
    return {"steps": len(steps), "mean_step_ms": statistics.fmean(steps) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="alternating run pairs")
    parser.add_argument("--step-ms", type=float, default=5.0, help="mock step latency")
    parser.add_argument("--json", default=None, help="write results to this path")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    print(
        f"mock, step latency {args.step_ms:g} ms, {NUM_REQUESTS} requests x {MAX_TOKENS} tokens, "
        f"greedy; schema {json.dumps(SCHEMA)}"
    )
    core = _core(args.step_ms / 1e3)
    start = time.perf_counter()
    core.add_request(EngineCoreRequest("warm-up", [1], _params(True).clone(max_tokens=1)))
    while core.has_unfinished_requests():
        core.step()
    compile_ms = (time.perf_counter() - start) * 1e3
    structured = core.structured_output
    fill = structured.fill_bitmask
    fill_s: list[float] = []

    def timed_fill(matchers: Any) -> Any:
        begin = time.perf_counter()
        bitmask = fill(matchers)
        fill_s.append(time.perf_counter() - begin)
        return bitmask

    structured.fill_bitmask = timed_fill  # type: ignore[method-assign]
    run_once(core, False)  # warm-up
    plain, constrained, sequential = [], [], []
    for _ in range(args.repeat):
        plain.append(run_once(core, False)["mean_step_ms"])
        constrained.append(run_once(core, True)["mean_step_ms"])
        sequential.append(run_once(core, True, overlap=False)["mean_step_ms"])
    core.close()
    ratios = [c / p for c, p in zip(constrained, plain, strict=True)]
    ratios_seq = [s / p for s, p in zip(sequential, plain, strict=True)]
    print(f"first grammar (llguidance import, tokenizer, compile, one step): {compile_ms:.1f} ms")
    print(f"{'run':<34} {'mean step ms (median of ' + str(args.repeat) + ')':>30}")
    print(f"{'plain':<34} {statistics.median(plain):>30.3f}")
    print(f"{'JSON schema, bitmask overlapped':<34} {statistics.median(constrained):>30.3f}")
    print(f"{'JSON schema, bitmask after forward':<34} {statistics.median(sequential):>30.3f}")
    print(
        f"ratio constrained/plain (median of pairs): {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}); target <= 1.10"
    )
    print(f"ratio without overlap: {statistics.median(ratios_seq):.3f}")
    print(
        f"bitmask fill per step ({NUM_REQUESTS} rows, vocab {core.vocab_size}): "
        f"{statistics.median(fill_s) * 1e3:.3f} ms median"
    )
    results = {
        "step_ms": args.step_ms,
        "plain_ms": plain,
        "constrained_ms": constrained,
        "sequential_ms": sequential,
        "ratios": ratios,
    }
    write_results(args.json, results)


if __name__ == "__main__":
    main()
