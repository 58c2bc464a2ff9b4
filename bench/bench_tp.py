#!/usr/bin/env python3
"""Tensor parallelism's costs on the CPU: the per-step broadcast to the workers (the mock's
pretend TP, whose steps otherwise cost microseconds) and greedy runs of a tiny Llama at TP=1 and
on two gloo ranks (one thread per process), with async scheduling off and on. The
configurations are timed in the same run, alternating, several rounds; medians are printed.

Usage: ``python bench/bench_tp.py [--rounds 5] [--steps 400]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
# One thread per process for both configurations (a TP rank on the CPU takes cores / ranks):
# otherwise TP=1 pays for OpenMP threads spinning against the machine's other load.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def mock_step_us(tp: int, steps: int) -> float:
    """Microseconds per decode step of 8 requests on the mock (``tensor_parallel_size=tp``)."""
    from engine_core_mock import MockBackend

    from engine_core.abc import CachedRequestData, NewRequestData, SchedulerOutput
    from engine_core.config import EngineConfig
    from engine_core.sampling_params import SamplingParams

    backend = MockBackend(EngineConfig(backend_options={"tensor_parallel_size": tp}))
    try:
        backend.initialize_kv_cache(4096)
        greedy = SamplingParams(temperature=0.0)
        ids = [f"r{i}" for i in range(8)]
        new = [NewRequestData(r, [1, 2, 3, 4], greedy, list(range(i * 64, i * 64 + 64)), 0, 4)
               for i, r in enumerate(ids)]  # fmt: skip
        backend.execute_model(SchedulerOutput(new, CachedRequestData(), 32))
        backend.sample_tokens(None)
        started = time.perf_counter()
        for step in range(steps):
            cached = CachedRequestData(ids, [None] * 8, [4 + step] * 8, [1] * 8)
            backend.execute_model(SchedulerOutput([], cached, 8))
            backend.sample_tokens(None)
        if backend.workers is not None:
            backend.workers.call("num_steps")  # the workers have run every step
        return (time.perf_counter() - started) / steps * 1e6
    finally:
        backend.close()


def greedy_s(model_dir: Path, tp: int, async_scheduling: bool) -> tuple[float, list[list[int]]]:
    """Seconds for 8 prompts x 16 greedy tokens, and the tokens."""
    from engine_core import LLM, SamplingParams

    prompts = [f"the engine token block cache {i}" for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(model=str(model_dir), backend="cuda", dtype="float32", max_model_len=256,
             num_kv_blocks=96, tensor_parallel_size=tp, multiprocess=False,
             async_scheduling=async_scheduling,
             backend_options={"device": "cpu", "kernels": "torch"}) as llm:  # fmt: skip
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started, [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args()
    from engine_core._bench.machine import machine_line

    print(machine_line())
    mock: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for tp in (1, 2):
            mock[tp].append(mock_step_us(tp, args.steps))
    m1, m2 = statistics.median(mock[1]), statistics.median(mock[2])
    print(f"mock step (8 requests): TP=1 {m1:.0f} us, TP=2 {m2:.0f} us "
          f"(broadcast +{m2 - m1:.0f} us/step)")  # fmt: skip
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "backends/cuda/tests"))
    import tiny_models

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama"
        tiny_models.build("llama", model_dir)
        configs = [(1, False), (2, False), (2, True)]
        cpu: dict[tuple[int, bool], list[float]] = {c: [] for c in configs}
        tokens: dict[tuple[int, bool], list[list[int]]] = {}
        for _ in range(max(1, args.rounds // 2)):
            for tp, on in configs:
                seconds, tokens[tp, on] = greedy_s(model_dir, tp, on)
                cpu[tp, on].append(seconds)
    c1, c2, c2a = (statistics.median(cpu[c]) for c in configs)
    print(f"tiny Llama fp32 greedy 8 x 16 tokens on the CPU: TP=1 {c1:.2f} s, TP=2 {c2:.2f} s "
          f"({c2 / c1:.1f}x), TP=2 with async scheduling {c2a:.2f} s ({c2a / c2:.2f}x TP=2 sync; "
          f"same tokens: {tokens[2, True] == tokens[2, False]})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
