"""The fused MoE Triton kernel (interpreted) against the torch reference at tiny sizes: the
expert alignment's invariants, float32 and float16, SwiGLU and GeGLU, FP8 weights with
per-channel scales, uneven and empty experts; kernel configurations from a tuned table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_core_cuda.kernels import fused_moe as fm
from engine_core_cuda.kernels.fused_moe import align_by_expert, fused_moe
from engine_core_cuda.kernels.moe_torch import fused_moe_torch, route_topk


def _problem(tokens: int, hidden: int, inter: int, experts: int, top_k: int, seed: int,
             dtype: torch.dtype = torch.float32):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (0.1 * torch.randn(experts, 2 * inter, hidden, generator=gen)).to(dtype)
    w2 = (0.1 * torch.randn(experts, hidden, inter, generator=gen)).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = route_topk(logits, top_k, renormalize=True, out_dtype=dtype)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_alignment_sorts_pairs_by_expert_in_padded_segments(block_m: int) -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2], [2, 0]])
    pairs = ids.numel()
    sorted_ids, experts = align_by_expert(ids, 5, block_m)
    assert sorted_ids.numel() % block_m == 0 and experts.numel() == sorted_ids.numel() // block_m
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    flat = ids.reshape(-1)
    for b, expert in enumerate(experts.tolist()):
        block = sorted_ids[b * block_m : (b + 1) * block_m]
        block = block[block < pairs]
        if expert < 0:
            assert block.numel() == 0
        else:
            assert torch.all(flat[block.long()] == expert)
    used = [e for e in experts.tolist() if e >= 0]
    assert used == sorted(used) and 1 not in used and 4 not in used  # unused experts: no block


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k", "activation"),
    [(1, 32, 16, 4, 2, "silu"), (7, 48, 40, 4, 2, "silu"), (19, 64, 32, 6, 3, "gelu_pytorch_tanh")],
)  # fmt: skip
def test_float32_matches_the_reference(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, activation: str
) -> None:
    x, w13, w2, weights, ids = _problem(tokens, hidden, inter, experts, top_k, seed=tokens)
    got = fused_moe(x, w13, w2, weights, ids, activation)
    expected = fused_moe_torch(x, w13, w2, weights, ids, activation)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_one_expert_takes_every_token_and_others_none() -> None:
    x, w13, w2, weights, _ = _problem(9, 32, 16, 4, 2, seed=5)
    ids = torch.tensor([[3, 1]] * 9)
    got = fused_moe(x, w13, w2, weights, ids, config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16})
    torch.testing.assert_close(got, fused_moe_torch(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


def test_float16_and_fp8_weights_within_tolerance() -> None:
    x, w13, w2, weights, ids = _problem(6, 32, 16, 4, 2, seed=11, dtype=torch.float16)
    got = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, fused_moe_torch(x, w13, w2, weights, ids), atol=2e-3, rtol=2e-3)
    # FP8 weights, per-output-channel scales: the kernel converts tiles and scales accumulators.
    s13 = w13.float().abs().amax(-1) / 448.0
    s2 = w2.float().abs().amax(-1) / 448.0
    q13 = (w13.float() / s13[..., None]).to(torch.float8_e4m3fn)
    q2 = (w2.float() / s2[..., None]).to(torch.float8_e4m3fn)
    got = fused_moe(x, q13, q2, weights, ids, "silu", s13, s2)
    expected = fused_moe_torch(x, q13, q2, weights, ids, "silu", s13, s2)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
    # and the FP8 result is near the unquantised one (the quantisation error, not a bug)
    full = fused_moe_torch(x, w13, w2, weights, ids).float()
    assert (got.float() - full).norm() / full.norm() < 0.1


def test_tuned_table_picks_the_nearest_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = fm.config_file_name(8, 32, 64, torch.bfloat16, "NVIDIA H200")
    assert name == "E=8,N=32,K=64,dtype=bfloat16,device=NVIDIA_H200.json"
    table = {"1": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
             "64": {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}}  # fmt: skip
    (tmp_path / name).write_text(json.dumps(table))
    monkeypatch.setenv(fm.CONFIG_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(fm, "INTERPRETED", False)
    fm._table.cache_clear()
    try:
        assert fm.kernel_config(3, 8, 2, 32, 64, torch.bfloat16, "NVIDIA H200")["BLOCK_M"] == 16
        assert fm.kernel_config(50, 8, 2, 32, 64, torch.bfloat16, "NVIDIA H200")["BLOCK_M"] == 32
        # no table for another shape: the defaults
        other = fm.kernel_config(50, 8, 2, 48, 64, torch.bfloat16, "NVIDIA H200")
        assert other == fm.default_config(50, 8, 2, 48, 64)
    finally:
        fm._table.cache_clear()


def test_tune_script_smoke_writes_a_table_the_kernel_reads(tmp_path: Path) -> None:
    """``bench/tune_moe.py --device cpu``: toy shape, interpreted, two configs; its table has
    the kernel's file name and one config per batch size."""
    import importlib.util

    script = Path(__file__).resolve().parents[3] / "bench" / "tune_moe.py"
    spec = importlib.util.spec_from_file_location("tune_moe", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--device", "cpu", "--batch-sizes", "1,5", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.iterdir()
    assert path.name == fm.config_file_name(4, 32, 32, torch.float32, "cpu")
    table = json.loads(path.read_text())
    assert set(table) == {"1", "5"}
    assert all(config in module.candidates("cpu") for config in table.values())
