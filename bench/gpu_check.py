#!/usr/bin/env python3
"""What only a GPU can show about the cuda backend, in one run: prints a compact table and exits
non-zero when a check fails.

1. kernels: the Triton KV-write and paged-attention kernels against their torch references in
   bfloat16 (decode batches with and without split-KV, prefill chunks after prefix-cache hits
   in the middle of a block, random shapes);
2. parity: greedy tokens of tiny Llama/Qwen2/Qwen3-shaped models (float32, CUDA graphs on)
   against transformers when it is installed, else against the dense reference of
   ``engine_core_cuda.reference_model`` (itself tested against transformers in CI);
3. conformance: ``engine_core.testing.check_backend`` on the GPU (when the scheduler's
   dependencies are installed);
4. throughput: decode steps of a Llama-3-8B-shaped model with random bfloat16 weights at each
   batch size (context ``--context``), next to the memory-bandwidth roofline (weight bytes + KV
   bytes read per step / ``--bandwidth``), with CUDA graphs on and off; the ratio must reach
   ``--target`` at batch 1 and at the largest batch;
5. overlap: decode throughput of the same model through the engine core (real scheduler, CUDA
   graphs on) with async scheduling off and on, at each batch size (information only).

``--device cpu`` runs the same code at toy sizes on the CPU (Triton interpreted) to check the
script itself; the throughput targets are then not enforced.

Usage: ``python bench/gpu_check.py [--only kernels,parity,conformance,throughput,overlap]
[--batch-sizes 1,64,256] [--context 512] [--steps 32] [--layers 32] [--device cuda|cpu]
[--reference auto|builtin] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECKS = ("kernels", "parity", "conformance", "throughput", "overlap")
NO_CUDA_EXIT = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks to run")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (a toy smoke run)")
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--context", type=int, default=512, help="tokens in context per request")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--layers", type=int, default=32, help="layers of the 8B-shaped model")
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s for the roofline")
    p.add_argument("--target", type=float, default=0.70, help="roofline ratio to reach")
    p.add_argument("--reference", choices=("auto", "builtin"), default="auto")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    args.only = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = sorted(set(args.only) - set(CHECKS))
    if unknown:
        p.error(f"unknown check(s) {unknown}; known: {', '.join(CHECKS)}")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        p.error(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    return args


@dataclass
class Row:
    check: str
    value: str
    target: str
    ok: bool | None  # None: information only


class Table:
    def __init__(self) -> None:
        self.rows: list[Row] = []

    def add(self, check: str, value: str, target: str = "", ok: bool | None = None) -> None:
        self.rows.append(Row(check, value, target, ok))
        status = "info" if ok is None else ("PASS" if ok else "FAIL")
        print(f"  {check:<52} {value:<46} {target:<12} {status}", flush=True)

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.ok is False]


# -- models -----------------------------------------------------------------------------------

_TINY_COMMON = {
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "dtype": "float32",
}  # fmt: skip
TINY = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "tie_word_embeddings": True,
              "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64}},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "tie_word_embeddings": False, "rope_theta": 1000.0, "torch_dtype": "float32"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 64,
              "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
}  # fmt: skip
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}  # fmt: skip
TOY_8B = {**LLAMA3_8B, "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
          "num_attention_heads": 8, "num_key_value_heads": 2}  # fmt: skip


def write_config(root: Path, name: str, config: dict[str, Any]) -> Path:
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def make_backend(model_dir: Path, device: str, **fields: Any) -> Any:
    from engine_core_cuda import CudaBackend

    from engine_core.config import EngineConfig

    options = {"device": device, "load_format": "dummy", **fields.pop("options", {})}
    return CudaBackend(
        EngineConfig(model=str(model_dir), backend="cuda", backend_options=options, **fields)
    )


def sharpen(backend: Any, seed: int) -> None:
    """Random weights larger than the dummy init, so greedy choices are not near-ties."""
    import torch
    from engine_core_cuda._loader import checkpoint_tensors

    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(checkpoint_tensors(backend.runner.model).items()):
            std = 0.25 if name.endswith("bias") else 0.12
            values = torch.randn(tensor.shape, generator=gen) * (0.1 if "norm" in name else std)
            tensor.copy_(values + (1.0 if "norm" in name else 0.0))


def release(backend: Any) -> None:
    import torch

    backend.close()
    del backend
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Driver:
    """Feeds a backend hand-made scheduler outputs (no scheduler): each request's prompt in
    one step (after ``hit`` tokens already cached), then one token per step."""

    def __init__(self, backend: Any, block_size: int) -> None:
        self.backend = backend
        self.block_size = block_size
        self.next_block = 0
        self.blocks: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.new: list[Any] = []

    def _grow(self, req_id: str, num_tokens: int) -> list[int]:
        needed = -(-num_tokens // self.block_size) - len(self.blocks[req_id])
        fresh = list(range(self.next_block, self.next_block + needed))
        self.next_block += needed
        self.blocks[req_id] += fresh
        return fresh

    def add(self, req_id: str, prompt: list[int], params: Any, hit: int = 0) -> None:
        from engine_core.abc import NewRequestData

        self.blocks[req_id], self.tokens[req_id] = [], list(prompt)
        self._grow(req_id, len(prompt))
        self.new.append(NewRequestData(req_id, prompt, params, list(self.blocks[req_id]), hit,
                                       len(prompt) - hit))  # fmt: skip

    def finish(self) -> None:
        """End every request (the backend drops their state)."""
        from engine_core.abc import CachedRequestData, SchedulerOutput

        done = list(self.tokens)
        self.backend.execute_model(SchedulerOutput([], CachedRequestData(), 0, done))
        self.backend.sample_tokens(None)
        self.tokens.clear()
        self.blocks.clear()
        self.next_block = 0

    def step(self) -> Any:
        from engine_core.abc import CachedRequestData, SchedulerOutput

        new_ids = {n.req_id for n in self.new}
        cached = CachedRequestData()
        for req_id, tokens in self.tokens.items():
            if req_id in new_ids:
                continue
            fresh = self._grow(req_id, len(tokens))
            cached.req_ids.append(req_id)
            cached.new_block_ids.append(fresh or None)
            cached.num_computed_tokens.append(len(tokens) - 1)
            cached.num_scheduled_tokens.append(1)
        total = len(cached.req_ids) + sum(n.num_scheduled_tokens for n in self.new)
        self.backend.execute_model(SchedulerOutput(self.new, cached, total))
        self.new = []
        out = self.backend.sample_tokens(None)
        for req_id, sampled in zip(out.req_ids, out.sampled_token_ids, strict=True):
            self.tokens[req_id] += sampled
        return out


# -- 1. kernels -------------------------------------------------------------------------------


def _attention_batch(q_lens: list[int], context: list[int], heads: tuple[int, int, int],
                     block_size: int, dtype: Any, device: str, seed: int) -> tuple[Any, ...]:  # fmt: skip
    import torch

    num_heads, num_kv_heads, head_size = heads
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context, q_lens, strict=True)]
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(q_lens) + 1, max(per_seq) + 1, dtype=torch.int32)
    rows = torch.randperm(len(q_lens) + 1, generator=gen)[: len(q_lens)].to(torch.int32)
    used = 0
    for row, n in zip(rows.tolist(), per_seq, strict=True):
        table[row, :n] = perm[used : used + n].to(torch.int32)
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    tensors = (
        torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype),
        torch.randn(shape, generator=gen).to(dtype),
        torch.randn(shape, generator=gen).to(dtype),
        table,
        rows,
        torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
    )
    return tuple(t.to(device) for t in tensors)


def check_kernels(table: Table, args: argparse.Namespace) -> None:
    import torch
    from engine_core_cuda.kernels.kv_write import write_kv
    from engine_core_cuda.kernels.paged_attention import paged_attention
    from engine_core_cuda.kernels.reference import paged_attention_reference, write_kv_reference

    gpu = args.device != "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    tol = 2e-2 if gpu else 2e-5
    big = (32, 8, 128) if gpu else (8, 2, 32)
    ctx = args.context if gpu else 20
    rng = random.Random(0)
    decode_b = 64 if gpu else 4
    cases: list[tuple[str, list[int], list[int], tuple[int, int, int], int, int]] = [
        (f"decode b={decode_b} ctx~{ctx}", [1] * decode_b,
         [ctx + rng.randint(-9, 9) for _ in range(decode_b)], big, 16, 1),
        (f"decode b={decode_b} split-KV x8", [1] * decode_b,
         [ctx + rng.randint(-9, 9) for _ in range(decode_b)], big, 16, 8),
        ("mixed: chunks after mid-block hits", [300, 1, 77, 1, 128] if gpu else [30, 1, 7, 1],
         [104, 700, 83, 0, 0] if gpu else [12, 70, 8, 0], big, 16, 1),
    ]  # fmt: skip
    longest = 200 if gpu else 24
    for seed in range(12 if gpu else 3):
        group, kv = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 8] if gpu else [1, 2])
        n = rng.randint(1, 6 if gpu else 3)
        q_lens = [rng.choice([1, rng.randint(2, longest)]) for _ in range(n)]
        context = [rng.choice([0, 16, rng.randint(0, 4 * longest)]) for _ in range(n)]
        head_size = rng.choice([64, 80, 128]) if gpu else 16
        cases.append((f"random shapes #{seed}", q_lens, context, (group * kv, kv, head_size),
                      rng.choice([16, 32]), rng.choice([1, 4])))  # fmt: skip
    random_errors: list[float] = []
    random_ok = True
    for seed, (name, q_lens, context, heads, block_size, segments) in enumerate(cases):
        batch = _attention_batch(q_lens, context, heads, block_size, dtype, args.device, seed)
        scale = heads[2] ** -0.5
        got = paged_attention(*batch, scale=scale, max_query_len=max(q_lens),
                              num_segments=segments)  # fmt: skip
        expected = paged_attention_reference(*batch, scale=scale)
        err = (got.float() - expected.float()).abs().max().item()
        ok = torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol)
        if name.startswith("random"):
            random_errors.append(err)
            random_ok = random_ok and ok
        else:
            table.add(f"kernels/attention {name}", f"max|err| {err:.2e}", f"<= {tol:.0e}", ok)
    table.add(f"kernels/attention {len(random_errors)} random shapes",
              f"max|err| {max(random_errors):.2e}", f"<= {tol:.0e}", random_ok)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    kv = [
        torch.randn(64, big[1], big[2], generator=gen).to(dtype).to(args.device) for _ in range(2)
    ]
    caches = [torch.zeros(8, 16, big[1], big[2], dtype=dtype, device=args.device) for _ in range(4)]
    slots = torch.randperm(128, generator=gen)[:64].to(args.device)
    slots[::7] = -1
    write_kv(kv[0], kv[1], caches[0], caches[1], slots)
    write_kv_reference(kv[0], kv[1], caches[2], caches[3], slots)
    exact = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    table.add("kernels/write_kv 64 tokens", "bit-exact" if exact else "differs", "exact", exact)
    check_elementwise_kernels(table, args.device, dtype, tol, big)


def check_elementwise_kernels(table: Table, device: str, dtype: Any, tol: float,
                              heads: tuple[int, int, int]) -> None:  # fmt: skip
    """RMSNorm (with the residual add), rotary embedding and SwiGLU against their references."""
    import torch
    from engine_core_cuda._hf_config import RopeConfig
    from engine_core_cuda._rope import RotaryTables
    from engine_core_cuda.kernels import reference as ref
    from engine_core_cuda.kernels.activation import silu_and_mul
    from engine_core_cuda.kernels.rms_norm import add_rms_norm, rms_norm
    from engine_core_cuda.kernels.rotary import rotary_embedding

    gen = torch.Generator().manual_seed(2)
    num_heads, num_kv_heads, head_size = heads
    hidden = num_heads * head_size

    def randn(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    def row(name: str, got: Any, expected: Any) -> None:
        err = (got.float() - expected.float()).abs().max().item()
        ok = torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol)
        table.add(f"kernels/{name}", f"max|err| {err:.2e}", f"<= {tol:.0e}", ok)

    x, residual, weight = randn(37, hidden), randn(37, hidden), 1 + 0.1 * randn(hidden)
    row("rms_norm", rms_norm(x, weight, 1e-5), ref.rms_norm_reference(x, weight, 1e-5))
    r1, r2 = residual.clone(), residual.clone()
    got = add_rms_norm(x, r1, weight, 1e-5)
    row("add_rms_norm", got, ref.add_rms_norm_reference(x, r2, weight, 1e-5))
    row("add_rms_norm residual", r1, r2)
    rope = RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    tables = RotaryTables(rope, head_size, 4096, dtype, torch.device(device))
    qkv = randn(37, (num_heads + 2 * num_kv_heads) * head_size)
    sizes = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
    positions = torch.randint(0, 4096, (37,), generator=gen).to(device)
    expected = qkv.clone()
    for target in (qkv, expected):
        q, k, _ = target.split(sizes, dim=-1)
        q, k = q.view(37, num_heads, head_size), k.view(37, num_kv_heads, head_size)
        fn = rotary_embedding if target is qkv else ref.rotary_embedding_reference
        fn(positions, q, k, tables.cos, tables.sin)
    row("rotary_embedding (in place, strided)", qkv, expected)
    gate_up = randn(37, 2 * 3 * hidden + 32)
    row("silu_and_mul", silu_and_mul(gate_up), ref.silu_and_mul_reference(gate_up))


# -- 2. greedy parity -------------------------------------------------------------------------


def _transformers_greedy(model_dir: Path, weights: dict[str, Any], device: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    model = model.float().to(device).eval()
    missing, unexpected = model.load_state_dict(
        {k: v.float() for k, v in weights.items()}, strict=False
    )
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied when it is missing
        raise RuntimeError(f"weights do not fit transformers' model: {missing} {unexpected}")

    def greedy(prompt: list[int], n: int) -> list[int]:
        config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None,
                                  pad_token_id=0)  # fmt: skip
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt], device=device), generation_config=config)
        return out[0, len(prompt) :].tolist()

    return greedy


def check_parity(table: Table, args: argparse.Namespace, root: Path) -> None:
    from engine_core_cuda._loader import checkpoint_tensors
    from engine_core_cuda.reference_model import reference_greedy

    from engine_core.sampling_params import SamplingParams

    use_hf = args.reference == "auto"
    if use_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            use_hf = False
    rng = random.Random(5)
    lengths = (1, 7, 16, 33, 90) if args.device != "cpu" else (1, 7, 20)
    prompts = {f"p{i}": [rng.randrange(2, 512) for _ in range(n)] for i, n in enumerate(lengths)}
    max_tokens = 16 if args.device != "cpu" else 5
    for kind, extra in TINY.items():
        model_dir = write_config(root, f"tiny-{kind}", {**_TINY_COMMON, **extra})
        backend = make_backend(model_dir, args.device, dtype="float32", max_model_len=256,
                               options={"max_graph_batch_size": 8})  # fmt: skip
        model_config = backend.model_config
        try:
            sharpen(backend, seed=len(kind))
            backend.initialize_kv_cache(64)
            driver = Driver(backend, backend.config.block_size)
            for req_id, prompt in prompts.items():
                driver.add(req_id, prompt, SamplingParams(temperature=0.0))
            for _ in range(max_tokens):
                driver.step()
            weights = {k: v.detach().clone() for k, v in
                       checkpoint_tensors(backend.runner.model).items()}  # fmt: skip
            graphs = backend.runner.graphs is not None
        finally:
            release(backend)
        reference = (
            _transformers_greedy(model_dir, weights, args.device)
            if use_hf
            else lambda p, n, w=weights, c=model_config: reference_greedy(w, c, p, n)
        )
        equal = sum(
            driver.tokens[r][len(p) :] == reference(p, max_tokens) for r, p in prompts.items()
        )
        source = "transformers" if use_hf else "builtin reference"
        table.add(f"parity/{kind} fp32 greedy vs {source}",
                  f"{equal}/{len(prompts)} prompts equal (graphs {'on' if graphs else 'off'})",
                  "all", equal == len(prompts))  # fmt: skip


# -- 3. conformance ---------------------------------------------------------------------------


def check_conformance(table: Table, args: argparse.Namespace, root: Path) -> None:
    try:
        from engine_core_cuda import CudaBackend

        from engine_core.config import EngineConfig
        from engine_core.testing import check_backend
    except ImportError as exc:
        table.add("conformance suite", f"skipped: {exc}", "", None)
        return
    model_dir = write_config(root, "tiny-conformance", {**_TINY_COMMON, **TINY["llama"]})
    config = EngineConfig(
        model=str(model_dir), backend="cuda", dtype="float32", max_model_len=512,
        backend_options={"device": args.device, "load_format": "dummy",
                         "max_graph_batch_size": 16},
    )  # fmt: skip

    def factory(config: Any) -> Any:
        backend = CudaBackend(config)
        sharpen(backend, seed=11)
        return backend

    started = time.perf_counter()
    try:
        check_backend(factory, config)
        table.add("conformance suite (fp32, graphs on)",
                  f"all checks in {time.perf_counter() - started:.0f} s", "pass", True)  # fmt: skip
    except AssertionError as exc:
        table.add("conformance suite (fp32, graphs on)", str(exc)[:44], "pass", False)


# -- 4. throughput ----------------------------------------------------------------------------


def _decode_run(backend: Any, batch_size: int, context: int, warmup: int, steps: int,
                vocab: int) -> tuple[float, list[list[int]], float]:  # fmt: skip
    """Seconds per decode step, the sampled tokens, and the mean context per timed step."""
    import torch

    from engine_core.sampling_params import SamplingParams

    rng = random.Random(batch_size)
    driver = Driver(backend, backend.config.block_size)
    params = SamplingParams(temperature=0.0)
    for i in range(batch_size):
        # The first `context` tokens count as cached (a prefix-cache hit): no prefill needed.
        prompt = [rng.randrange(vocab) for _ in range(context + 1)]
        driver.add(f"r{i}", prompt, params, hit=context)
    for _ in range(warmup + 1):  # the first step computes position `context`
        driver.step()
    if backend.device.type == "cuda":
        torch.cuda.synchronize(backend.device)
    started = time.perf_counter()
    sampled = [driver.step().sampled_token_ids for _ in range(steps)]  # each ends in a sync
    elapsed = (time.perf_counter() - started) / steps
    driver.finish()
    mean_context = context + warmup + 2 + (steps - 1) / 2
    flat = [[s[0] for s in step] for step in sampled]
    return elapsed, flat, mean_context


def check_throughput(table: Table, args: argparse.Namespace, root: Path) -> None:
    gpu = args.device != "cpu"
    shape = {**(LLAMA3_8B if gpu else TOY_8B), "num_hidden_layers": args.layers if gpu else 2}
    model_dir = write_config(root, "llama3-8b-shaped", shape)
    batch_sizes = args.batch_sizes if gpu else [min(b, 4) for b in args.batch_sizes]
    batch_sizes = sorted(set(batch_sizes))
    context, steps, warmup = (args.context, args.steps, 3) if gpu else (24, 3, 1)
    block_size = 16
    per_seq_blocks = -(-(context + warmup + steps + 3) // block_size)
    num_blocks = max(batch_sizes) * per_seq_blocks + 1
    results: dict[bool, dict[int, tuple[float, list[list[int]]]]] = {}
    for graphs in (True, False) if gpu else (False,):
        backend = make_backend(
            model_dir, args.device, dtype="bfloat16" if gpu else "float32",
            max_model_len=context + warmup + steps + 64, max_num_seqs=max(batch_sizes),
            options={"cuda_graphs": graphs, "max_graph_batch_size": max(batch_sizes)},
        )  # fmt: skip
        try:
            if graphs or not gpu:
                kv_bytes = backend.available_kv_cache_memory()
                spec = backend.kv_cache_spec()
                blocks = kv_bytes // spec.bytes_per_block(block_size)
                table.add("startup: KV cache after profiling", f"{kv_bytes / 2**30:.1f} GiB = "
                          f"{blocks} blocks of {block_size}", f">= {num_blocks}",
                          blocks >= num_blocks)  # fmt: skip
            started = time.perf_counter()
            backend.initialize_kv_cache(num_blocks)
            if graphs:
                table.add("startup: KV allocation + graph capture",
                          f"{time.perf_counter() - started:.1f} s", "", None)  # fmt: skip
            model = backend.runner.model
            weight_bytes = sum(
                p.numel() * p.element_size() for n, p in model.named_parameters()
                if not (n == "model.embed_tokens.weight" and model.lm_head is not None)
            )  # fmt: skip
            spec = backend.kv_cache_spec()
            token_kv_bytes = spec.bytes_per_block(1)
            results[graphs] = {}
            for b in batch_sizes:
                seconds, tokens, mean_ctx = _decode_run(backend, b, context, warmup, steps,
                                                        shape["vocab_size"])  # fmt: skip
                results[graphs][b] = (seconds, tokens)
                roofline = (weight_bytes + b * mean_ctx * token_kv_bytes) / args.bandwidth
                ratio = roofline / seconds
                enforce = gpu and graphs and b in (min(batch_sizes), max(batch_sizes))
                table.add(
                    f"decode b={b} ctx={context} graphs {'on' if graphs else 'off'}",
                    f"{seconds * 1e3:.2f} ms/step {b / seconds:,.0f} tok/s "
                    f"roof {roofline * 1e3:.2f} ms",
                    f"ratio {ratio:.2f}" + (f">={args.target}" if enforce else ""),
                    (ratio >= args.target) if enforce else None,
                )
        finally:
            release(backend)
    if gpu:
        for b in batch_sizes:
            (on, on_tokens), (off, off_tokens) = results[True][b], results[False][b]
            # Information only: graph correctness is checked by the parity rows (float32);
            # near-ties of a random bfloat16 model make token equality fragile.
            same = on_tokens == off_tokens
            table.add(f"cuda graphs b={b}: speedup, same tokens", f"x{off / on:.2f}, "
                      f"{'same' if same else 'different'} tokens", "", None)  # fmt: skip


def _engine_decode(model_dir: Path, args: argparse.Namespace, batch_size: int, context: int,
                   steps: int, async_scheduling: bool) -> float:  # fmt: skip
    """Output tokens per second of ``batch_size`` greedy requests decoding ``steps`` tokens
    after their prompt, stepped by an in-process engine core (timed after the first steps)."""
    from engine_core_cuda import CudaBackend

    from engine_core import SamplingParams
    from engine_core._core.protocol import EngineCoreRequest
    from engine_core._engine.core import EngineCore
    from engine_core.config import EngineConfig

    gpu = args.device != "cpu"
    config = EngineConfig(
        model=str(model_dir), backend="cuda", dtype="bfloat16" if gpu else "float32",
        backend_options={"device": args.device, "load_format": "dummy",
                         "max_graph_batch_size": batch_size},
        max_model_len=context + steps + 64, max_num_seqs=batch_size,
        max_num_batched_tokens=max(batch_size * (context + 1), 8192),
        num_kv_blocks=batch_size * (-(-(context + steps + 64) // 16)) + 1,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    core = EngineCore(config, backend_cls=CudaBackend)
    try:
        rng = random.Random(batch_size)
        vocab = core.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        for i in range(batch_size):
            prompt = [rng.randrange(vocab) for _ in range(context)]
            core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
        num_tokens = 0
        started = 0.0
        for n in range(steps + 4):
            out = core.step()
            if n == 3:  # prefill and the first decode steps are not timed
                started = time.perf_counter()
            elif n > 3:
                num_tokens += sum(len(t) for t in out.new_token_ids)
            if not core.has_unfinished_requests():
                break
        return num_tokens / (time.perf_counter() - started)
    finally:
        core.close()


def check_overlap(table: Table, args: argparse.Namespace, root: Path) -> None:
    gpu = args.device != "cpu"
    shape = {**(LLAMA3_8B if gpu else TOY_8B), "num_hidden_layers": args.layers if gpu else 2}
    model_dir = write_config(root, "llama3-8b-shaped-engine", shape)
    batch_sizes = sorted(set(args.batch_sizes if gpu else [min(b, 4) for b in args.batch_sizes]))
    context, steps = (args.context, max(args.steps, 32)) if gpu else (24, 6)
    for b in batch_sizes:
        off = _engine_decode(model_dir, args, b, context, steps, async_scheduling=False)
        on = _engine_decode(model_dir, args, b, context, steps, async_scheduling=True)
        table.add(f"engine decode b={b}: async off / on", f"{off:,.0f} / {on:,.0f} tok/s",
                  f"x{on / off:.2f}", None)  # fmt: skip


# -- main -------------------------------------------------------------------------------------


def header(args: argparse.Namespace) -> str:
    import torch
    import triton

    if args.device != "cpu":
        props = torch.cuda.get_device_properties(torch.device(args.device))
        device = (f"{props.name}, {props.multi_processor_count} SMs, "
                  f"{props.total_memory / 2**30:.0f} GiB")  # fmt: skip
    else:
        device = f"CPU smoke run ({os.cpu_count()} cores, Triton interpreter)"
    return (
        f"gpu_check: {device}; torch {torch.__version__} (CUDA {torch.version.cuda}), triton "
        f"{triton.__version__}, Python {platform.python_version()}\n"
        f"config: batch sizes {args.batch_sizes}, context {args.context}, {args.steps} steps, "
        f"{args.layers} layers, roofline at {args.bandwidth / 1e12:.2f} TB/s, "
        f"target {args.target:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device is available (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}); run it on a GPU machine, or with --device cpu for a toy "
            "smoke run of the script itself",
            file=sys.stderr,
        )
        return NO_CUDA_EXIT
    print(header(args), flush=True)
    table = Table()
    steps: dict[str, Callable[[], None]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        root = Path(tmp)
        steps = {
            "kernels": lambda: check_kernels(table, args),
            "parity": lambda: check_parity(table, args, root),
            "conformance": lambda: check_conformance(table, args, root),
            "throughput": lambda: check_throughput(table, args, root),
            "overlap": lambda: check_overlap(table, args, root),
        }
        for name in args.only:
            started = time.perf_counter()
            try:
                steps[name]()
            except Exception as exc:  # one broken check must not hide the others
                traceback.print_exc()
                table.add(f"{name}: crashed", f"{type(exc).__name__}: {exc}"[:44], "", False)
            print(f"  ({name}: {time.perf_counter() - started:.1f} s)", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps([r.__dict__ for r in table.rows], indent=1))
    failed = table.failed
    print(f"gpu_check: {len(table.rows) - len(failed)} rows ok, {len(failed)} failed"
          + (": " + "; ".join(r.check for r in failed) if failed else ""))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
