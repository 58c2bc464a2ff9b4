"""``bench/gpu_check.py``'s ``moe``, ``fp8`` and ``gpt_oss`` checks at toy sizes on the CPU (Triton
interpreted), run in this process: their rows pass or are information, and the MoE roofline's
arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_check_script import gpu_check_module

_module = gpu_check_module


def test_moe_roofline_counts_the_experts_a_batch_touches() -> None:
    gc = _module()
    config = gc.QWEN3_30B_A3B
    assert gc.experts_touched(128, 8, 1) == pytest.approx(8)
    assert 125 < gc.experts_touched(128, 8, 64) < 128
    one = gc.moe_decode_roofline(config, 1, 512, 4.8e12, 989e12)
    # ~3.3 B parameters touched at batch 1 (bf16) plus the LM head and KV: ~2 ms on an H200.
    assert 6e9 < one.bytes < 8e9 and one.bound == "memory"
    many = gc.moe_decode_roofline(config, 256, 512, 4.8e12, 989e12)
    # Nearly every expert (~30 B parameters, 61 GB) and 256 x 512 tokens of KV (12.9 GB).
    assert 70e9 < many.bytes < 76e9 and many.bound == "memory"
    # gpt-oss-20b: its window layers read at most 128 positions of KV.
    oss = gc.moe_shape(gc.GPT_OSS_20B)
    assert (oss["num_experts"], oss["moe_intermediate_size"]) == (32, 2880)
    full = {**oss, "layer_types": ["full_attention"] * 24}
    kv_per_layer = 256 * 2 * 8 * 64 * 2 * (4096 - 128)  # batch 256: what 12 window layers skip
    skipped = gc.moe_decode_roofline(full, 256, 4096, 4.8e12, 989e12).bytes - gc.moe_decode_roofline(
        oss, 256, 4096, 4.8e12, 989e12).bytes  # fmt: skip
    assert skipped == pytest.approx(12 * kv_per_layer)
    # FP8 weights: one byte per parameter of the attention projections and the experts touched.
    bf16 = gc.moe_decode_roofline(oss, 1, 4096, 4.8e12, 989e12)
    fp8 = gc.moe_decode_roofline(oss, 1, 4096, 4.8e12, 989e12, 2, 1)
    projections = 2880 * (64 + 2 * 8) * 64 + 64 * 64 * 2880
    touched = gc.experts_touched(32, 4, 1) * 3 * 2880 * 2880
    assert bf16.bytes - fp8.bytes == pytest.approx(24 * (projections + touched))
    assert bf16.flops == fp8.flops


@pytest.mark.parametrize("check", ["moe", "fp8", "gpt_oss"])
def test_cpu_smoke_rows(tmp_path: Path, check: str) -> None:
    gc = _module()
    args = gc.parse_args(["--device", "cpu", "--out", str(tmp_path)])
    table = gc.Table()
    getattr(gc, f"check_{check}")(table, args, tmp_path)
    assert not table.failed, [r.line() for r in table.failed]
    names = [r.check for r in table.rows]
    if check == "moe":
        assert "moe: fused kernel vs torch, 3 tokens fp8 weights" in names
        assert any(n.startswith("moe: fused vs per-expert loop") for n in names)
        assert "moe: decode b=1 ctx=24 (Qwen3-30B-A3B shape)" in names
    elif check == "gpt_oss":
        assert names == ["gpt_oss: decode b=1 ctx=24 (gpt-oss-20b shape)",
                         "gpt_oss: decode b=2 ctx=24 (gpt-oss-20b shape)",
                         "gpt_oss: decode b=1 ctx=24 (gpt-oss-20b shape, fp8 weights)",
                         "gpt_oss: decode b=2 ctx=24 (gpt-oss-20b shape, fp8 weights)"]  # fmt: skip
    else:
        assert "fp8: KV blocks in 8 GiB, fp8 vs bf16" in names
        assert "fp8: decode b=1 ctx=24 fp8 weights (8B shape)" in names
        assert "fp8: KV write conversion vs torch" in names


def test_lora_cpu_smoke_rows(tmp_path: Path) -> None:
    gc = _module()
    args = gc.parse_args(["--device", "cpu", "--out", str(tmp_path)])
    assert args.lora_target == 0.85
    table = gc.Table()
    gc.check_lora(table, args, tmp_path)
    assert not table.failed, [r.line() for r in table.failed]
    names = [r.check for r in table.rows]
    assert names == ["lora: shrink/expand vs torch, qkv 5 tokens",
                     "lora: shrink/expand vs torch, gate_up 5 tokens",
                     "lora: decode b=4 ctx=24, 8 rank-16 adapters vs base",
                     "lora: decode b=4 ctx=24, 8 rank-16 adapters vs base, fp8 weights"]  # fmt: skip
