"""The Triton kernels (interpreted on the CPU) against their pure-torch references."""

from __future__ import annotations

import importlib
import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from engine_core_cuda._device import _triton_interprets, prepare_triton
from engine_core_cuda._hf_config import RopeConfig
from engine_core_cuda._rope import RotaryTables
from engine_core_cuda.kernels import KERNEL_MODULES
from engine_core_cuda.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from engine_core_cuda.kernels.kv_write import write_kv
from engine_core_cuda.kernels.paged_attention import paged_attention
from engine_core_cuda.kernels.reference import (
    add_rms_norm_reference,
    gelu_tanh_and_mul_reference,
    gemma_add_rms_norm_reference,
    gemma_rms_norm_reference,
    paged_attention_reference,
    rms_norm_reference,
    rotary_embedding_reference,
    silu_and_mul_reference,
    write_kv_reference,
)
from engine_core_cuda.kernels.rms_norm import (
    add_rms_norm,
    gemma_add_rms_norm,
    gemma_rms_norm,
    rms_norm,
)
from engine_core_cuda.kernels.rotary import rotary_embedding


def test_triton_and_every_kernel_module_run_interpreted() -> None:
    """Triton's own functions are interpreted too (not only the kernel modules' flag): had
    anything imported triton before the conftest chose the mode, they would be compiled and
    prepare_triton would refuse the CPU."""
    assert _triton_interprets() is True
    assert all(importlib.import_module(name).INTERPRETED for name in KERNEL_MODULES)
    prepare_triton(torch.device("cpu"))


def test_prepare_triton_refuses_a_process_that_imported_triton_compiled() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch, triton\n"
        "from engine_core_cuda._device import prepare_triton\n"
        "try:\n"
        "    prepare_triton(torch.device('cpu'))\n"
        "except RuntimeError as e:\n"
        "    print('refused:', e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: Triton was imported in this process before")


@dataclass
class Batch:
    """A paged KV cache holding ``seq_lens`` tokens per sequence, whose last ``q_lens`` are
    the queries of the step."""

    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_rows: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.key_cache, self.value_cache, self.block_table, self.seq_rows,
                self.query_start_loc, self.seq_lens)  # fmt: skip


def make_batch(
    q_lens: list[int],
    context_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> Batch:
    """Blocks are shuffled, sequences use table rows out of order, spare rows hold garbage."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, q_lens, strict=True)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    width = max(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    num_rows = len(q_lens) + 2
    block_table = torch.randint(0, num_blocks, (num_rows, width), generator=gen, dtype=torch.int32)
    seq_rows = torch.randperm(num_rows, generator=gen)[: len(q_lens)].to(torch.int32)
    used = 0
    for row, n in zip(seq_rows.tolist(), blocks_per_seq, strict=True):
        block_table[row, :n] = perm[used : used + n].to(torch.int32)
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(
        q=torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype),
        key_cache=torch.randn(shape, generator=gen).to(dtype),
        value_cache=torch.randn(shape, generator=gen).to(dtype),
        block_table=block_table,
        seq_rows=seq_rows,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
    )


def check_attention(batch: Batch, *, num_segments: int = 1, tile_size: int = 32) -> None:
    scale = batch.q.shape[-1] ** -0.5
    max_query_len = int((batch.query_start_loc[1:] - batch.query_start_loc[:-1]).max())
    got = paged_attention(
        *batch.args,
        scale=scale,
        max_query_len=max_query_len,
        num_segments=num_segments,
        tile_size=tile_size,
    )
    expected = paged_attention_reference(*batch.args, scale=scale)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_segments", [1, 4])
def test_decodes_at_block_boundaries(num_segments: int) -> None:
    bs = 8
    context = [bs - 2, bs - 1, bs, 2 * bs - 1, 2 * bs, 5 * bs + 3]  # a decode makes it +1
    batch = make_batch([1] * len(context), context, num_heads=8, num_kv_heads=2, head_size=16,
                       block_size=bs, seed=1)  # fmt: skip
    check_attention(batch, num_segments=num_segments)


def test_prefill_chunks_after_a_cache_hit_in_the_middle_of_a_block() -> None:
    bs = 8
    # Chunks whose cached context ends mid-block, at a block end, and none; a decode among them.
    q_lens = [13, 5, 1, 20, 8]
    context = [bs + bs // 2, 2 * bs, 37, 0, 3]
    batch = make_batch(q_lens, context, num_heads=4, num_kv_heads=4, head_size=32,
                       block_size=bs, seed=2)  # fmt: skip
    check_attention(batch)


@pytest.mark.parametrize("seed", range(10))
def test_random_shapes(seed: int) -> None:
    rng = random.Random(seed)
    num_kv_heads = rng.choice([1, 2, 4])
    group = rng.choice([1, 2, 3, 4, 8])
    block_size = rng.choice([4, 5, 8, 16])
    num_seqs = rng.randint(1, 5)
    q_lens = [rng.choice([1, rng.randint(2, 40)]) for _ in range(num_seqs)]
    context = [rng.choice([0, block_size, rng.randint(0, 70)]) for _ in range(num_seqs)]
    batch = make_batch(
        q_lens,
        context,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_size=rng.choice([16, 24, 32, 40]),
        block_size=block_size,
        seed=seed,
    )
    check_attention(batch, num_segments=rng.choice([1, 2, 8]), tile_size=rng.choice([16, 32]))


def test_half_precision_within_tolerance() -> None:
    batch = make_batch([1, 9], [20, 7], num_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                       seed=3, dtype=torch.float16)  # fmt: skip
    scale = 16**-0.5
    got = paged_attention(*batch.args, scale=scale, max_query_len=9)
    expected = paged_attention_reference(*batch.args, scale=scale)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(("num_tokens", "num_heads", "head_size"), [(1, 1, 16), (37, 2, 24)])
def test_write_kv_matches_the_reference(num_tokens: int, num_heads: int, head_size: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    num_slots = 4 * 64
    # Keys and values as the model passes them: column slices of one fused projection.
    qkv = torch.randn(num_tokens, 3 * num_heads * head_size, generator=gen)
    _, key, value = qkv.split(num_heads * head_size, dim=-1)
    key = key.view(num_tokens, num_heads, head_size)
    value = value.view(num_tokens, num_heads, head_size)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens are not written
    caches = [torch.randn(64, 4, num_heads, head_size, generator=gen) for _ in range(2)]
    expected = [c.clone() for c in caches]
    write_kv(key, value, caches[0], caches[1], slots)
    write_kv_reference(key, value, expected[0], expected[1], slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    written = slots[slots >= 0]
    assert torch.equal(caches[0].view(-1, num_heads, head_size)[written], key[slots >= 0])


@pytest.mark.parametrize("cols", [64, 80])
def test_rms_norm_and_the_fused_residual_add(cols: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(7, cols, generator=gen)
    weight = 1 + 0.1 * torch.randn(cols, generator=gen)
    residual = torch.randn(7, cols, generator=gen)
    original = residual.clone()
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
    expected_residual = residual.clone()
    expected = add_rms_norm_reference(x, expected_residual, weight, 1e-6)
    got = add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(residual, expected_residual)  # updated in place
    assert torch.equal(residual, x + original)


def test_rotary_embedding_in_place_on_strided_heads() -> None:
    gen = torch.Generator().manual_seed(4)
    head_size, heads, kv_heads = 16, 6, 2
    tables = RotaryTables(RopeConfig(10000.0, "llama3", 4.0, 1.0, 4.0, 16), head_size, 64,
                          torch.float32, torch.device("cpu"))  # fmt: skip
    # q and k as the model passes them: views into one fused projection output.
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head_size, generator=gen)
    q, k, _ = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
    q, k = q.view(5, heads, head_size), k.view(5, kv_heads, head_size)
    positions = torch.tensor([0, 3, 17, 63, 5])
    expected_q, expected_k = q.clone(), k.clone()
    rotary_embedding_reference(positions, expected_q, expected_k, tables.cos, tables.sin)
    before = qkv.clone()
    rotary_embedding(positions, q, k, tables.cos, tables.sin)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)
    assert torch.equal(qkv[:, -kv_heads * head_size :], before[:, -kv_heads * head_size :])
    assert torch.equal(q[0], before[0, : heads * head_size].view(heads, head_size))  # position 0


def test_silu_and_mul() -> None:
    x = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x))


def test_gelu_tanh_and_mul() -> None:
    x = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(6)) * 4
    torch.testing.assert_close(gelu_tanh_and_mul(x), gelu_tanh_and_mul_reference(x))


def test_gemma_rms_norm_scales_by_one_plus_the_weight_in_float32() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 48, generator=gen)
    weight = 0.01 * torch.randn(48, generator=gen)  # Gemma's norm weights are near 0
    residual = torch.randn(5, 48, generator=gen)
    expected = gemma_rms_norm_reference(x, weight, 1e-6)
    torch.testing.assert_close(gemma_rms_norm(x, weight, 1e-6), expected)
    expected_residual = residual.clone()
    expected = gemma_add_rms_norm_reference(x, expected_residual, weight, 1e-6)
    torch.testing.assert_close(gemma_add_rms_norm(x, residual, weight, 1e-6), expected)
    assert torch.equal(residual, expected_residual)
    # In bfloat16 the weight is widened before 1 is added, and the product rounded once: Llama's
    # norm with a weight of 1 + w rounded to bfloat16 is not the same.
    half, small = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    h = half.float() * torch.rsqrt(half.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = gemma_rms_norm_reference(half, small, 1e-6)
    assert torch.equal(expected, (h * (1 + small.float())).to(torch.bfloat16))
    assert not torch.equal(rms_norm_reference(half, 1 + small, 1e-6), expected)
