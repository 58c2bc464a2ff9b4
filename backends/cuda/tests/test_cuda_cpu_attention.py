"""The CPU's native decode attention (K/V read in place from the paged cache) against the
per-sequence reference; where it does not apply, the torch path runs."""

from __future__ import annotations

import random

import pytest
import torch
from engine_core_cuda.kernels import cpu_attention, cpu_native
from engine_core_cuda.kernels.cpu_attention import decode_attention_native, native_available
from engine_core_cuda.kernels.reference import paged_attention_reference
from engine_core_cuda.kernels.torch_attention import paged_attention_torch
from test_cuda_kernels import Batch, make_batch

pytestmark = [
    pytest.mark.skipif(cpu_native.compiler() is None, reason="no C compiler"),
    pytest.mark.usefixtures("torch_threads"),
]


def _decode_args(batch: Batch) -> tuple[torch.Tensor, ...]:
    tokens = batch.query_start_loc[:-1].long()
    return (batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_rows,
            batch.seq_lens, tokens)  # fmt: skip


def _expected(batch: Batch) -> torch.Tensor:
    return paged_attention_reference(*batch.args, scale=batch.q.shape[-1] ** -0.5)


def test_it_builds_here() -> None:
    assert native_available()


@pytest.mark.parametrize("seed", range(6))
def test_decode_rows_match_the_reference(seed: int) -> None:
    rng = random.Random(200 + seed)
    num_kv_heads, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
    block_size = rng.choice([4, 8, 16])
    # Lengths of one key, exact block multiples and ragged ones.
    context = [0, block_size - 1, block_size, *(rng.randrange(1, 70) for _ in range(5))]
    batch = make_batch([1] * len(context), context, num_heads=num_kv_heads * group,
                       num_kv_heads=num_kv_heads, head_size=rng.choice([16, 32, 64]),
                       block_size=block_size, seed=seed)  # fmt: skip
    out = torch.full_like(batch.q, float("nan"))
    assert decode_attention_native(*_decode_args(batch), out, batch.q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, _expected(batch), atol=2e-5, rtol=2e-5)


def test_threads_split_the_sequences() -> None:
    batch = make_batch([1] * 9, [5, 40, 17, 3, 64, 1, 30, 8, 22], num_heads=8, num_kv_heads=2,
                       head_size=32, block_size=8, seed=7)  # fmt: skip
    torch.set_num_threads(3)
    out = torch.full_like(batch.q, float("nan"))
    assert decode_attention_native(*_decode_args(batch), out, batch.q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, _expected(batch), atol=2e-5, rtol=2e-5)


def test_strided_queries_and_a_mixed_batch() -> None:
    """Queries as a view of a wider projection (a row stride past the heads), decode rows
    between prefill chunks: the decode rows in place, the chunks through torch."""
    batch = make_batch([1, 9, 1, 1, 12], [30, 4, 0, 17, 9], num_heads=4, num_kv_heads=2,
                       head_size=16, block_size=8, seed=8)  # fmt: skip
    wide = torch.randn(batch.q.shape[0], 7, 16)
    wide[:, 1:5] = batch.q
    q = wide[:, 1:5]
    assert not q.is_contiguous()
    args = (q, *batch.args[1:])
    got = paged_attention_torch(*args, scale=0.25, max_query_len=12)
    torch.testing.assert_close(got, _expected(batch), atol=2e-5, rtol=2e-5)
    without = paged_attention_torch(*args, scale=0.25, max_query_len=12, native=False)
    torch.testing.assert_close(got, without, atol=2e-5, rtol=2e-5)


def test_what_it_does_not_take_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_batch([1, 1], [5, 9], num_heads=4, num_kv_heads=2, head_size=16,
                       block_size=8, seed=9, dtype=torch.bfloat16)  # fmt: skip
    out = torch.empty_like(batch.q)
    assert not decode_attention_native(*_decode_args(batch), out, 0.25)  # bfloat16
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "torch")
    monkeypatch.setattr(cpu_attention, "_resolved", False)  # read again at the next call
    monkeypatch.setattr(cpu_attention, "_loaded", None)
    assert not native_available()
    floats = make_batch([1, 1], [5, 9], num_heads=4, num_kv_heads=2, head_size=16,
                        block_size=8, seed=9)  # fmt: skip
    got = paged_attention_torch(*floats.args, scale=0.25, max_query_len=1)
    torch.testing.assert_close(got, _expected(floats), atol=2e-5, rtol=2e-5)
