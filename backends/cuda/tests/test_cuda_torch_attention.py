"""The batched torch attention (the ``"torch"`` kernels') against the per-sequence reference."""

from __future__ import annotations

import random

import pytest
import torch
from engine_core_cuda.kernels.reference import paged_attention_reference
from engine_core_cuda.kernels.torch_attention import paged_attention_torch
from test_cuda_kernels import Batch, make_batch


def _check(batch: Batch, atol: float = 2e-5) -> None:
    scale = batch.q.shape[-1] ** -0.5
    out = torch.full_like(batch.q, float("nan"))
    got = paged_attention_torch(*batch.args, scale=scale, max_query_len=0, out=out)
    assert got is out
    expected = paged_attention_reference(*batch.args, scale=scale)
    torch.testing.assert_close(got, expected, atol=atol, rtol=atol)


def test_a_decode_only_batch_of_different_lengths() -> None:
    context = [0, 6, 7, 8, 15, 16, 43]
    _check(make_batch([1] * len(context), context, num_heads=8, num_kv_heads=2, head_size=16,
                      block_size=8, seed=1))  # fmt: skip


def test_decodes_mixed_with_prefill_chunks_after_cache_hits() -> None:
    # Chunks of close lengths run padded together; a lopsided mix runs one chunk at a time.
    _check(make_batch([1, 13, 1, 20, 1], [30, 12, 0, 3, 9], num_heads=6, num_kv_heads=3,
                      head_size=32, block_size=8, seed=2))  # fmt: skip
    _check(make_batch([1, 2, 2, 40, 1], [30, 12, 0, 3, 9], num_heads=6, num_kv_heads=3,
                      head_size=32, block_size=8, seed=2))  # fmt: skip


@pytest.mark.parametrize("seed", range(8))
def test_random_shapes(seed: int) -> None:
    rng = random.Random(100 + seed)
    num_kv_heads, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 8])
    num_seqs = rng.randint(1, 6)
    q_lens = [rng.choice([1, 1, rng.randint(2, 30)]) for _ in range(num_seqs)]
    context = [rng.choice([0, rng.randint(0, 60)]) for _ in range(num_seqs)]
    _check(make_batch(q_lens, context, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                      head_size=rng.choice([16, 24]), block_size=rng.choice([4, 5, 16]),
                      seed=seed))  # fmt: skip


def test_half_precision() -> None:
    _check(make_batch([1, 9, 1], [20, 7, 3], num_heads=4, num_kv_heads=2, head_size=16,
                      block_size=8, seed=3, dtype=torch.float16), atol=2e-3)  # fmt: skip
