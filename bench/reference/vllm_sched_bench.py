#!/usr/bin/env python3
"""CPU-only timing of vLLM's own v1 Scheduler (vllm.v1.core.sched.scheduler).

Builds the Scheduler the way vLLM's unit tests do (tests/v1/core/utils.py
`create_scheduler`): a VllmConfig from a local model directory that holds only
a tiny Llama config.json (no weights, no tokenizer, no network), and a
hand-made KVCacheConfig with one full-attention group and no tensors. No GPU,
no model runner: each step we call

    so  = scheduler.schedule()
    mro = fake ModelRunnerOutput (one sampled token per request whose prompt
          is fully computed after this step; [] for partial prefill chunks)
    eco = scheduler.update_from_output(so, mro)

and time schedule() and update_from_output() separately (plus, optionally,
vLLM's own msgpack encoding of the EngineCoreOutputs, i.e. what the
EngineCore output thread serializes before the ZMQ send).

Workloads (the same as bench/bench_scheduler.py):
  W1  256 requests x 128 random prompt tokens, max_tokens 128, all at once
  W2  1024 requests, same shape, max_num_seqs 1024, max_num_batched_tokens 8192
  W3  512 requests = 1024-token shared prefix + 32 unique tokens, max_tokens 16
  KV  KVCacheManager alone: get_computed_blocks + allocate_slots for 1024
      requests (prefill), then 128 decode allocate_slots rounds, then free

This file only imports the installed vllm package; it copies none of vLLM's
code. It runs only where vLLM is installed: a separate virtual environment with
`pip install vllm==0.33.0` (about 9 GB; it pulls a CUDA torch, which is fine
there because only the scheduler runs). Run it right before or after
bench/bench_scheduler.py on the same machine, so the two compare side by side:
    $VLLM_VENV/bin/python bench/reference/vllm_sched_bench.py --no-prefix-caching-runs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

try:
    import torch  # noqa: E402, F401
    import vllm  # noqa: E402
except ImportError as exc:  # pragma: no cover - depends on the environment
    sys.exit(f"vllm_sched_bench.py needs vLLM installed (pip install vllm==0.33.0): {exc}")
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

try:
    from vllm.v1.serial_utils import MsgpackEncoder  # noqa: E402
except Exception:  # pragma: no cover - optional
    MsgpackEncoder = None

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
VOCAB = TINY_LLAMA["vocab_size"]
DEVICE = os.environ.get("BENCH_DEVICE", "cpu")


def make_model_dir(root: str) -> str:
    d = os.path.join(root, "tiny-llama")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    return d


def build_scheduler(
    model_dir: str,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_blocks: int,
    block_size: int = 16,
    max_model_len: int = 4096,
    enable_prefix_caching: bool = True,
):
    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        dtype="float16",
        seed=42,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=model_config.is_encoder_decoder,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        # No GPU here: name the device explicitly instead of auto-detecting it
        # (auto-detection raises "Failed to infer device type").
        device_config=DeviceConfig(device=DEVICE),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    cache_config.num_gpu_blocks = num_blocks
    sched = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,  # the engine runs with stats on by default
    )
    # Same block hasher the EngineCore builds (default algo in this version).
    block_hasher = None
    if enable_prefix_caching:
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        block_hasher = get_request_block_hasher(block_size, hash_fn)
    return sched, block_hasher, vllm_config


def make_requests(prompts, max_tokens, block_hasher, prefix="r"):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(
            Request(
                request_id=f"{prefix}{i}",
                prompt_token_ids=p,
                sampling_params=sp,
                pooling_params=None,
                block_hasher=block_hasher,
            )
        )
    return reqs


def fake_runner_output(sched: Scheduler, so, rng: random.Random) -> ModelRunnerOutput:
    """One sampled token per scheduled request whose prompt is complete after
    this step (mirrors the GPU runner discarding tokens of partial prefills)."""
    req_ids = list(so.num_scheduled_tokens.keys())
    sampled = []
    reqs = sched.requests
    for rid in req_ids:
        r = reqs[rid]
        # schedule() already advanced num_computed_tokens by the scheduled count
        if r.num_computed_tokens >= r.num_tokens:
            sampled.append([rng.randrange(3, VOCAB)])
        else:
            sampled.append([])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def pct(xs, q):
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_workload(
    name,
    model_dir,
    prompts,
    max_tokens,
    *,
    max_num_seqs,
    max_num_batched_tokens,
    num_blocks,
    enable_prefix_caching=True,
    encode_outputs=True,
    seed=0,
):
    rng = random.Random(seed)
    sched, hasher, _ = build_scheduler(
        model_dir,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_blocks=num_blocks,
        enable_prefix_caching=enable_prefix_caching,
    )
    enc = MsgpackEncoder() if (encode_outputs and MsgpackEncoder) else None

    gc.collect()
    t0 = time.perf_counter()
    reqs = make_requests(prompts, max_tokens, hasher)
    t_create = time.perf_counter() - t0
    t0 = time.perf_counter()
    for r in reqs:
        sched.add_request(r)
    t_add = time.perf_counter() - t0

    steps = []  # (kind, n_sched, t_sched, t_mro, t_update, t_enc, n_tokens)
    t_start = time.perf_counter()
    n_out_tokens = 0
    pc_queries = pc_hits = 0
    while sched.has_unfinished_requests():
        a = time.perf_counter()
        so = sched.schedule()
        b = time.perf_counter()
        mro = fake_runner_output(sched, so, rng)
        c = time.perf_counter()
        eco = sched.update_from_output(so, mro)
        d = time.perf_counter()
        for v in eco.values():
            st = getattr(v, "scheduler_stats", None)
            pcs = getattr(st, "prefix_cache_stats", None) if st is not None else None
            if pcs is not None:
                pc_queries += pcs.queries
                pc_hits += pcs.hits
        t_e = 0.0
        if enc is not None:
            for v in eco.values():
                enc.encode(v)
            t_e = time.perf_counter() - d
        n_sched = len(so.num_scheduled_tokens)
        is_decode = so.total_num_scheduled_tokens == n_sched and not so.scheduled_new_reqs
        n_out_tokens += sum(1 for s in mro.sampled_token_ids if s)
        steps.append(
            (
                "decode" if is_decode else "prefill/mixed",
                n_sched,
                b - a,
                c - b,
                d - c,
                t_e,
                so.total_num_scheduled_tokens,
            )
        )
        if len(steps) > 100000:
            raise RuntimeError("runaway loop")
    wall = time.perf_counter() - t_start

    dec = [s for s in steps if s[0] == "decode"]
    pre = [s for s in steps if s[0] != "decode"]
    # "full batch" decode steps: every request still running (before tail-off)
    full = [s for s in dec if s[1] == max(x[1] for x in dec)] if dec else []

    def summarize(ss):
        if not ss:
            return {}
        sch = [s[2] * 1e6 for s in ss]
        upd = [s[4] * 1e6 for s in ss]
        tot = [(s[2] + s[4]) * 1e6 for s in ss]
        encs = [s[5] * 1e6 for s in ss]
        nreq = statistics.fmean(s[1] for s in ss)
        return {
            "steps": len(ss),
            "avg_reqs_per_step": nreq,
            "schedule_mean_us": statistics.fmean(sch),
            "schedule_p50_us": pct(sch, 0.5),
            "update_mean_us": statistics.fmean(upd),
            "update_p50_us": pct(upd, 0.5),
            "sched+update_mean_us": statistics.fmean(tot),
            "sched+update_p50_us": pct(tot, 0.5),
            "sched+update_p99_us": pct(tot, 0.99),
            "per_req_us": statistics.fmean(tot) / max(nreq, 1e-9),
            "encode_mean_us": statistics.fmean(encs),
            "fake_runner_output_mean_us": statistics.fmean(s[3] * 1e6 for s in ss),
        }

    # Prefix-cache stats are handed out (and reset) by the scheduler in every
    # step's SchedulerStats; the loop above summed them. Add any remainder.
    kv = sched.kv_cache_manager
    rest = kv.make_prefix_cache_stats() if hasattr(kv, "make_prefix_cache_stats") else None
    if rest is not None:
        pc_queries += rest.queries
        pc_hits += rest.hits
    hit = None
    if pc_queries:
        hit = {
            "queries_tokens": pc_queries,
            "hits_tokens": pc_hits,
            "hit_rate": pc_hits / pc_queries,
        }
    res = {
        "workload": name,
        "num_requests": len(prompts),
        "prompt_len": len(prompts[0]),
        "max_tokens": max_tokens,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "num_blocks": num_blocks,
        "prefix_caching": enable_prefix_caching,
        "create_requests_s": t_create,
        "create_requests_us_per_req": t_create * 1e6 / len(prompts),
        "add_request_us_per_req": t_add * 1e6 / len(prompts),
        "loop_wall_s": wall,
        "total_steps": len(steps),
        "output_tokens": n_out_tokens,
        "tokens_per_s_cpu_only": n_out_tokens / wall,
        "prefill_phase": summarize(pre),
        "decode_phase": summarize(dec),
        "decode_full_batch": summarize(full),
        "prefix_cache": hit,
    }
    del sched
    gc.collect()
    return res


def kv_manager_bench(model_dir, n_req=1024, prompt_len=128, decode_steps=128, seed=0):
    """KVCacheManager alone (taken from a fresh Scheduler): prefill allocation
    for n_req requests, then decode_steps rounds of 1-token allocations."""
    rng = random.Random(seed)
    sched, hasher, _ = build_scheduler(
        model_dir,
        max_num_seqs=n_req,
        max_num_batched_tokens=8192,
        num_blocks=n_req * ((prompt_len + decode_steps) // 16 + 2) + 100,
    )
    kv = sched.kv_cache_manager
    prompts = [[rng.randrange(3, VOCAB) for _ in range(prompt_len)] for _ in range(n_req)]
    reqs = make_requests(prompts, decode_steps + 1, hasher, prefix="kv")
    gc.collect()
    t_get = t_alloc = 0.0
    for r in reqs:
        a = time.perf_counter()
        blocks, n_hit, *_ = kv.get_computed_blocks(r)
        b = time.perf_counter()
        out = kv.allocate_slots(r, prompt_len - n_hit, n_hit, blocks)
        c = time.perf_counter()
        assert out is not None, "out of blocks"
        r.num_computed_tokens = prompt_len
        t_get += b - a
        t_alloc += c - b
    t_dec = []
    for _ in range(decode_steps):
        a = time.perf_counter()
        for r in reqs:
            r.append_output_token_ids(rng.randrange(3, VOCAB))
            kv.allocate_slots(r, 1)
            r.num_computed_tokens += 1
        t_dec.append(time.perf_counter() - a)
    a = time.perf_counter()
    for r in reqs:
        kv.free(r)
    t_free = time.perf_counter() - a
    return {
        "requests": n_req,
        "prompt_len": prompt_len,
        "get_computed_blocks_us_per_req": t_get * 1e6 / n_req,
        "allocate_slots_prefill_us_per_req": t_alloc * 1e6 / n_req,
        "decode_round_mean_us": statistics.fmean(t_dec) * 1e6,
        "decode_append+allocate_us_per_req": statistics.fmean(t_dec) * 1e6 / n_req,
        "free_us_per_req": t_free * 1e6 / n_req,
    }


def rand_prompts(rng, n, length):
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller request counts")
    ap.add_argument(
        "--no-prefix-caching-runs",
        action="store_true",
        help="skip the W1/W2 reruns with prefix caching off",
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rng = random.Random(1234)
    tmp = tempfile.mkdtemp(prefix="vllm_sched_bench_")
    model_dir = make_model_dir(tmp)
    scale = 4 if a.quick else 1

    env = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    print("env:", json.dumps(env), flush=True)
    results = {"env": env, "runs": []}

    n1, n2, n3 = 256 // scale, 1024 // scale, 512 // scale
    runs = [
        (
            "W1",
            rand_prompts(rng, n1, 128),
            128,
            dict(max_num_seqs=256, max_num_batched_tokens=8192, num_blocks=8192),
        ),
        (
            "W2",
            rand_prompts(rng, n2, 128),
            128,
            dict(max_num_seqs=1024, max_num_batched_tokens=8192, num_blocks=20000),
        ),
    ]
    shared = [rng.randrange(3, VOCAB) for _ in range(1024)]
    w3 = [shared + [rng.randrange(3, VOCAB) for _ in range(32)] for _ in range(n3)]
    runs.append(
        ("W3", w3, 16, dict(max_num_seqs=512, max_num_batched_tokens=8192, num_blocks=20000))
    )

    for name, prompts, mt, kw in runs:
        r = run_workload(name, model_dir, prompts, mt, **kw)
        results["runs"].append(r)
        print(f"done {name}: wall {r['loop_wall_s']:.2f}s steps {r['total_steps']}", flush=True)
        if name in ("W1", "W2") and not a.no_prefix_caching_runs:
            r = run_workload(
                name + "-noPC", model_dir, prompts, mt, enable_prefix_caching=False, **kw
            )
            results["runs"].append(r)
            print(f"done {name}-noPC: wall {r['loop_wall_s']:.2f}s", flush=True)

    results["kv_manager"] = kv_manager_bench(model_dir, n_req=1024 // scale)

    # ---- table ----
    print("\nvLLM", env["vllm"], "v1 Scheduler on CPU (no GPU), microseconds per engine step")
    hdr = (
        f"{'run':<8} {'reqs':>5} {'steps':>5} {'wall s':>7} {'phase':<8} {'n':>4} "
        f"{'sched':>8} {'update':>8} {'s+u mean':>9} {'s+u p50':>8} {'s+u p99':>8} "
        f"{'us/req':>7} {'enc':>7}"
    )
    print(hdr)
    for r in results["runs"]:
        for ph, key in (
            ("prefill", "prefill_phase"),
            ("decode", "decode_phase"),
            ("dec-full", "decode_full_batch"),
        ):
            s = r[key]
            if not s:
                continue
            print(
                f"{r['workload']:<8} {r['num_requests']:>5} {r['total_steps']:>5} "
                f"{r['loop_wall_s']:>7.2f} {ph:<8} {s['steps']:>4} "
                f"{s['schedule_mean_us']:>8.0f} {s['update_mean_us']:>8.0f} "
                f"{s['sched+update_mean_us']:>9.0f} {s['sched+update_p50_us']:>8.0f} "
                f"{s['sched+update_p99_us']:>8.0f} {s['per_req_us']:>7.2f} "
                f"{s['encode_mean_us']:>7.0f}"
            )
    print()
    for r in results["runs"]:
        pc = r["prefix_cache"]
        print(
            f"{r['workload']:<8} create Request {r['create_requests_us_per_req']:.1f} us/req, "
            f"add_request {r['add_request_us_per_req']:.1f} us/req, "
            f"CPU-only tok/s {r['tokens_per_s_cpu_only']:.0f}"
            + (
                f", prefix hit rate {pc['hit_rate'] * 100:.1f}% "
                f"({pc['hits_tokens']}/{pc['queries_tokens']} tokens)"
                if pc
                else ""
            )
        )
    k = results["kv_manager"]
    print(
        f"\nKVCacheManager alone, {k['requests']} reqs x {k['prompt_len']} tok: "
        f"get_computed_blocks {k['get_computed_blocks_us_per_req']:.1f} us/req, "
        f"allocate_slots(prefill) {k['allocate_slots_prefill_us_per_req']:.1f} us/req, "
        f"decode round {k['decode_round_mean_us']:.0f} us "
        f"({k['decode_append+allocate_us_per_req']:.2f} us/req incl. append_output_token_ids), "
        f"free {k['free_us_per_req']:.1f} us/req"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
        print("wrote", a.json)


if __name__ == "__main__":
    main()
