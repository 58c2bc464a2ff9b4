#!/usr/bin/env python3
"""The cuda backend on the CPU against transformers' ``generate``: same tiny models, same
machine, same run.

Each tiny model of the backend's tests (``--models``, default the Llama and the Qwen3-MoE: random
weights, 2 layers, hidden size 64; the MoE has 4 experts, top-2) generates
``--tokens`` greedy tokens for each of ``--batch-sizes`` identical-length prompts, through
``LLM.generate`` (engine core in the caller's thread; token ids only, like transformers, unless
``--detokenize``) and through ``model.generate`` of transformers, on ``--threads`` torch
threads. Each configuration runs ``--rounds`` times,
interleaved; the table shows the median tokens/s and the ratio engine / transformers.

Usage: ``python bench/bench_cpu_hf.py [--batch-sizes 1,32] [--tokens 64] [--rounds 5]
[--threads 1] [--kernels torch,triton] [--models llama,qwen3_moe] [--detokenize]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (for --kernels)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backends" / "cuda" / "tests"))  # the tiny checkpoints

import torch  # noqa: E402
from tiny_models import TinyModel  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from engine_core import LLM, SamplingParams  # noqa: E402
from engine_core._bench.machine import machine_line, write_results  # noqa: E402

PROMPT_LEN = 8


def _prompts(batch: int) -> list[list[int]]:
    return [[2 + (i * 7 + j * 13) % 300 for j in range(PROMPT_LEN)] for i in range(batch)]


def _engine_rate(llm: LLM, batch: int, tokens: int, detokenize: bool) -> float:
    params = SamplingParams(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=detokenize
    )
    prompts: list[Any] = [{"prompt_token_ids": p} for p in _prompts(batch)]
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == batch * tokens, produced
    return produced / elapsed


def _hf_rate(model: torch.nn.Module, batch: int, tokens: int) -> float:
    config = GenerationConfig(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                              eos_token_id=None, pad_token_id=0)  # fmt: skip
    ids = torch.tensor(_prompts(batch))
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    elapsed = time.perf_counter() - started
    produced = (out.shape[1] - PROMPT_LEN) * batch
    assert produced == batch * tokens, produced
    return produced / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kernels", default="torch", help="comma-separated: torch, triton")
    p.add_argument("--detokenize", action="store_true",
                   help="the engine detokenizes its outputs (transformers' generate does not)")  # fmt: skip
    p.add_argument(
        "--models",
        default="llama,qwen3_moe",
        help="comma-separated tiny models: llama, qwen3_moe (MoE), mixtral, ...",
    )
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    print(machine_line())
    print(f"tiny {args.models}, greedy, {args.tokens} tokens, prompts of {PROMPT_LEN} tokens, "
          f"{args.threads} thread(s), {args.rounds} rounds, median tok/s, engine "
          f"{'with' if args.detokenize else 'without'} detokenization")  # fmt: skip
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    medians: dict[str, dict[str, dict[int, float]]] = {}
    all_rates: dict[str, dict[str, dict[int, list[float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in models:
            model = TinyModel(kind, Path(tmp) / kind)
            rates = _measure(model, batch_sizes, kernels, args)
            all_rates[kind] = rates
            medians[kind] = {name: {b: statistics.median(r) for b, r in by_b.items()}
                             for name, by_b in rates.items()}  # fmt: skip
    print(f"{'model':>10} {'batch':>6} " + " ".join(f"{'engine ' + k:>16}" for k in kernels)
          + f" {'transformers':>14} " + " ".join(f"{'ratio ' + k:>14}" for k in kernels))  # fmt: skip
    for kind in models:
        for b in batch_sizes:
            m = medians[kind]
            hf = m["transformers"][b]
            print(f"{kind:>10} {b:>6} " + " ".join(f"{m[k][b]:>16,.0f}" for k in kernels)
                  + f" {hf:>14,.0f} " + " ".join(f"{m[k][b] / hf:>14.2f}" for k in kernels))  # fmt: skip
    write_results(args.json, {"tokens": args.tokens, "threads": args.threads,
                              "median_tok_s": medians, "rounds": all_rates})  # fmt: skip


def _measure(model: TinyModel, batch_sizes: list[int], kernels: list[str],
             args: argparse.Namespace) -> dict[str, dict[int, list[float]]]:  # fmt: skip
    """Tokens/s of each engine and of transformers per batch size, ``args.rounds`` interleaved
    rounds after a warm-up."""
    engines = {
        k: LLM(model=str(model.path), backend="cuda", max_model_len=256,
               max_num_seqs=max(batch_sizes), backend_options={"device": "cpu", "kernels": k})
        for k in kernels
    }  # fmt: skip
    rates: dict[str, dict[int, list[float]]] = {
        name: {b: [] for b in batch_sizes} for name in [*kernels, "transformers"]
    }
    try:
        for b in batch_sizes:  # warm-up
            for llm in engines.values():
                _engine_rate(llm, b, 4, args.detokenize)
            _hf_rate(model.hf, b, 4)
        for _ in range(args.rounds):
            for b in batch_sizes:
                for k, llm in engines.items():
                    rates[k][b].append(_engine_rate(llm, b, args.tokens, args.detokenize))
                rates["transformers"][b].append(_hf_rate(model.hf, b, args.tokens))
    finally:
        for llm in engines.values():
            llm.close()
    return rates


if __name__ == "__main__":
    main()
