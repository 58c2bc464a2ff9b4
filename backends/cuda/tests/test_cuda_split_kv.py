"""How many split-KV segments a decode batch gets, and the kernel with many of them."""

from __future__ import annotations

import pytest
from engine_core_cuda._attention import (
    MAX_SEGMENTS,
    MAX_SPLIT_QUERY_LEN,
    MIN_SEGMENT_TOKENS,
    split_kv_segments,
)
from test_cuda_kernels import check_attention, make_batch

H200_SMS = 132


def test_batch_one_at_long_context_fills_the_gpu() -> None:
    segments = split_kv_segments(1, 8, H200_SMS, 32768, 1)
    assert segments * 8 >= 4 * H200_SMS  # the old cap of 16 gave 128 programs
    assert segments & (segments - 1) == 0
    assert 32768 // segments >= MIN_SEGMENT_TOKENS


def test_segments_grow_with_context_and_shrink_with_the_batch() -> None:
    by_context = [split_kv_segments(1, 8, H200_SMS, n, 1) for n in (256, 1024, 4096, 32768)]
    assert by_context == sorted(by_context) and by_context[0] == 1 and by_context[-1] > 16
    by_batch = [split_kv_segments(b, 8, H200_SMS, 32768, 1) for b in (1, 4, 16, 64, 256)]
    assert by_batch == sorted(by_batch, reverse=True) and by_batch[-1] == 1
    assert split_kv_segments(1, 1, 10_000, 1 << 30, 1) == MAX_SEGMENTS


def test_no_split_for_prefill_or_off_the_gpu() -> None:
    assert split_kv_segments(1, 8, H200_SMS, 32768, MAX_SPLIT_QUERY_LEN + 1) == 1
    assert split_kv_segments(1, 8, 0, 32768, 1) == 1


def test_verification_steps_split_as_decode_steps_do() -> None:
    decode = split_kv_segments(1, 8, H200_SMS, 32768, 1)
    assert decode > 1
    assert [split_kv_segments(1, 8, H200_SMS, 32768, q) for q in (2, 5, 9)] == [decode] * 3


@pytest.mark.parametrize("num_segments", [4, 16])
def test_split_queries_of_several_tokens(num_segments: int) -> None:
    """Verification steps: 1 + drafts queries per sequence, causal within them, some queries of
    a sequence seeing no key of a segment the others see."""
    batch = make_batch([1, 5, 3, 9], [70, 41, 8, 130], num_heads=4, num_kv_heads=2,
                       head_size=16, block_size=8, seed=11)  # fmt: skip
    check_attention(batch, num_segments=num_segments, tile_size=16)


def test_many_segments_most_of_them_empty() -> None:
    # 64 segments over ~100 keys: most programs see no tile and must not disturb the merge.
    batch = make_batch([1, 1], [97, 3], num_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                       seed=7)  # fmt: skip
    check_attention(batch, num_segments=64, tile_size=16)
