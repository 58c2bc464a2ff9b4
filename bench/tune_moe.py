"""Tune the fused MoE kernel's configuration per batch size for one expert geometry, and write
the table the kernel reads (``engine_core_cuda/kernels/moe_configs/E=…,N=…,K=…,dtype=…,device=…
.json``, or ``--out``).

On a GPU (the default shape is Qwen3-30B-A3B's: 128 experts, top-8, intermediate 768, hidden
2048, bfloat16)::

    python bench/tune_moe.py --batch-sizes 1,16,64,256,1024

On the CPU (``--device cpu``) it is a smoke run: toy sizes, Triton interpreted, two configs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (a toy smoke run)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=768, help="each expert's intermediate size")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--fp8", action="store_true", help="FP8 weights with per-channel scales")
    p.add_argument("--batch-sizes", default="1,16,64,256,1024")
    p.add_argument("--iters", type=int, default=20, help="timed calls per config")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: the kernel's)")
    args = p.parse_args(argv)
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error("--batch-sizes must be comma-separated ints")
    if args.device == "cpu":  # toy smoke sizes
        args.experts, args.top_k, args.intermediate, args.hidden = 4, 2, 32, 32
        args.dtype, args.iters = "float32", 1
        args.batch_sizes = args.batch_sizes[:2]
    return args


def candidates(device: str) -> list[dict[str, int]]:
    """The configurations tried (a small grid on a GPU, two on the CPU)."""
    if device == "cpu":
        return [{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1},
                {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}]  # fmt: skip
    grid = itertools.product([16, 32, 64, 128], [32, 64, 128], [64, 128], [4, 8], [3, 4])
    return [{"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s}
            for m, n, k, w, s in grid if not (m == 128 and n == 128 and w == 4)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from engine_core_cuda.kernels import fused_moe as fm
    from engine_core_cuda.kernels.moe_torch import fused_moe_torch, route_topk

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    e, inter, hidden = args.experts, args.intermediate, args.hidden
    w13 = (0.02 * torch.randn(e, 2 * inter, hidden, generator=gen, device=device)).to(dtype)
    w2 = (0.02 * torch.randn(e, hidden, inter, generator=gen, device=device)).to(dtype)
    s13 = s2 = None
    if args.fp8:
        s13 = w13.float().abs().amax(-1) / 448.0
        s2 = w2.float().abs().amax(-1) / 448.0
        w13 = (w13.float() / s13[..., None]).to(torch.float8_e4m3fn)
        w2 = (w2.float() / s2[..., None]).to(torch.float8_e4m3fn)
    name = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)
    table: dict[str, Any] = {}
    for batch in args.batch_sizes:
        x = torch.randn(batch, hidden, generator=gen, device=device).to(dtype)
        logits = torch.randn(batch, e, generator=gen, device=device)
        weights, ids = route_topk(logits, args.top_k, renormalize=True, out_dtype=dtype)
        expected = fused_moe_torch(x, w13, w2, weights, ids, "silu", s13, s2).float()
        best: tuple[float, dict[str, int]] | None = None
        for config in candidates(args.device):
            try:
                got = fm.fused_moe(x, w13, w2, weights, ids, "silu", s13, s2, config=config)
            except Exception as exc:  # noqa: BLE001 (a config the device cannot run: skipped)
                print(f"batch {batch}: {config} failed: {type(exc).__name__}", file=sys.stderr)
                continue
            error = float((got.float() - expected).abs().max())
            if error > 0.05 * float(expected.abs().max()) + 1e-3:
                print(f"batch {batch}: {config} wrong (max error {error:.3g})", file=sys.stderr)
                continue
            times = []
            for _ in range(args.iters):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                fm.fused_moe(x, w13, w2, weights, ids, "silu", s13, s2, config=config)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            median = statistics.median(times)
            if best is None or median < best[0]:
                best = (median, config)
        if best is None:
            print(f"batch {batch}: no configuration ran", file=sys.stderr)
            return 1
        table[str(batch)] = best[1]
        print(f"batch {batch:5d}: {best[0] * 1e6:9.1f} us  {best[1]}")
    weight_dtype = torch.float8_e4m3fn if args.fp8 else dtype
    out_dir = args.out or fm.CONFIG_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / fm.config_file_name(e, inter, hidden, weight_dtype, name)
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
