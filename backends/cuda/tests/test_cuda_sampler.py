"""The on-device sampler on hand-made logits: each stage, the noise, and logprobs."""

from __future__ import annotations

import math
from typing import Literal

import pytest
import torch
from engine_core_cuda._random import request_seed, uniform
from engine_core_cuda._sampler import (
    SamplingBatch,
    apply_logit_bias,
    compute_logprobs,
    sample,
    unpack_bitmask,
)

VOCAB = 6
LOGITS = torch.tensor(
    [
        [2.0, 1.0, 0.5, 0.0, -1.0, 3.0],
        [0.1, 0.2, 4.0, 0.3, 3.9, 0.0],
    ]
)


def _batch(rows: int, **fields: object) -> SamplingBatch:
    base: dict[str, object] = {
        "seeds": torch.arange(rows, dtype=torch.int64) + 7,
        "positions": torch.zeros(rows, dtype=torch.int64),
        "all_greedy": True,
    }
    base.update(fields)
    return SamplingBatch(**base)  # type: ignore[arg-type]


def _random(rows: int, **fields: object) -> SamplingBatch:
    return _batch(rows, all_greedy=False, greedy=torch.zeros(rows, dtype=torch.bool), **fields)


def test_greedy_is_the_argmax() -> None:
    assert sample(LOGITS, _batch(2)).tolist() == [5, 2]


def test_banned_tokens_are_masked_then_the_next_best_wins() -> None:
    banned = (torch.tensor([0, 1]), torch.tensor([5, 2]))
    assert sample(LOGITS, _batch(2, banned=banned)).tolist() == [0, 4]


def test_logit_bias_is_added_before_the_argmax_and_leaves_the_logits_as_they_were() -> None:
    raw = LOGITS.clone()
    # Row 0: token 5 banned, token 1 raised by 1.5 (2.5 beats 2.0); row 1: token 0 forced.
    bias = (torch.tensor([0, 0, 1]), torch.tensor([5, 1, 0]), torch.tensor([-100.0, 1.5, 100.0]))
    biased = apply_logit_bias(LOGITS, bias)
    assert biased[0].tolist() == [2.0, 2.5, 0.5, 0.0, -1.0, -97.0]
    assert sample(LOGITS, _batch(2, logit_bias=bias)).tolist() == [1, 0]
    assert torch.equal(LOGITS, raw)
    # Random rows see it too: a forced token is drawn whatever the noise.
    forced = (torch.tensor([0, 1]), torch.tensor([3, 3]), torch.tensor([100.0, 100.0]))
    assert sample(LOGITS, _random(2, logit_bias=forced)).tolist() == [3, 3]


def test_grammar_bitmask_keeps_only_allowed_tokens() -> None:
    # Row 1 only: allow tokens 0 and 3 (bits 0 and 3 of word 0).
    words = torch.tensor([[0b1001]], dtype=torch.int32)
    allowed = unpack_bitmask(words, VOCAB)
    assert allowed.tolist() == [[True, False, False, True, False, False]]
    batch = _batch(2, allowed=(torch.tensor([1]), allowed))
    assert sample(LOGITS, batch).tolist() == [5, 3]


def test_bitmask_words_with_the_sign_bit_and_a_short_row() -> None:
    words = torch.tensor([[-(2**31)]], dtype=torch.int32)  # only bit 31
    allowed = unpack_bitmask(words, 40)
    assert allowed[0].nonzero().flatten().tolist() == [31]  # tokens 32..39: no word, disallowed


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    counts = torch.zeros(2, VOCAB, dtype=torch.int32)
    prompt = torch.zeros(2, VOCAB, dtype=torch.bool)
    prompt[0, 5] = True  # 3.0 / 2 = 1.5 < 2.0: token 0 wins
    counts[1, 2] = 1  # 4.0 / 2 = 2.0 < 3.9: token 4 wins
    batch = _batch(
        2,
        output_counts=counts,
        prompt_mask=prompt,
        repetition_penalty=torch.tensor([2.0, 2.0]),
    )
    assert sample(LOGITS, batch).tolist() == [0, 4]
    logits = torch.tensor([[-1.0, -0.6]])
    seen = torch.tensor([[True, False]])
    batch = _batch(
        1,
        output_counts=torch.zeros(1, 2, dtype=torch.int32),
        prompt_mask=seen,
        repetition_penalty=torch.tensor([0.5]),
    )
    assert sample(logits, batch).tolist() == [0]  # -1.0 * 0.5 = -0.5 > -0.6


def test_frequency_and_presence_penalties_subtract_per_occurrence_and_once() -> None:
    counts = torch.zeros(2, VOCAB, dtype=torch.int32)
    counts[0, 5] = 3  # 3.0 - 0.4 * 3 = 1.8 < 2.0
    counts[1, 2] = 5  # 4.0 - 0.5 (presence, once) = 3.5 < 3.9
    batch = _batch(
        2,
        output_counts=counts,
        prompt_mask=torch.zeros(2, VOCAB, dtype=torch.bool),
        frequency_penalty=torch.tensor([0.4, 0.0]),
        presence_penalty=torch.tensor([0.0, 0.5]),
    )
    assert sample(LOGITS, batch).tolist() == [0, 4]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_mixed_greedy_and_random_rows(impl: Literal["torch", "triton"]) -> None:
    batch = _random(2, top_k=torch.tensor([1, VOCAB]))
    batch.greedy = torch.tensor([False, True])
    assert sample(LOGITS, batch, impl).tolist() == [5, 2]  # top-1 sampling is the argmax


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", torch.tensor([1, 1])),
        ("top_p", torch.tensor([0.01, 0.01])),
        ("top_p", torch.tensor([1e-8, 1e-8])),
        ("min_p", torch.tensor([1.0, 1.0])),
    ],  # fmt: skip
)
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_filters_that_keep_only_the_best_token(
    field: str, value: torch.Tensor, impl: Literal["torch", "triton"]
) -> None:
    for position in range(20):
        batch = _random(2, positions=torch.full((2,), position), **{field: value})
        assert sample(LOGITS, batch, impl).tolist() == [5, 2]


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    rows = 20000
    logits = probs.log().expand(rows, -1).contiguous()
    batch = _random(rows, seeds=torch.full((rows,), 3), positions=torch.arange(rows))
    freq = torch.bincount(sample(logits, batch), minlength=4).float() / rows
    assert torch.allclose(freq, probs, atol=0.01), freq


def test_top_k_and_top_p_restrict_the_support() -> None:
    rows = 4000
    logits = torch.tensor([1.0, 0.9, 0.8, -5.0, 0.7]).expand(rows, -1).contiguous()
    seeds = torch.full((rows,), 11)
    top_k = _random(rows, seeds=seeds, positions=torch.arange(rows), top_k=torch.full((rows,), 2))
    assert sorted(set(sample(logits, top_k).tolist())) == [0, 1]
    # Probabilities ~[0.29, 0.26, 0.24, 0.001, 0.21]: the smallest set reaching 0.6 is 0, 1, 2.
    top_p = _random(rows, seeds=seeds, positions=torch.arange(rows), top_p=torch.full((rows,), 0.6))
    assert sorted(set(sample(logits, top_p).tolist())) == [0, 1, 2]


def test_temperature_sharpens_the_distribution() -> None:
    rows = 4000
    logits = torch.tensor([1.0, 0.0]).expand(rows, -1).contiguous()
    positions = torch.arange(rows)
    seeds = torch.full((rows,), 5)
    cold = _random(rows, seeds=seeds, positions=positions, temperature=torch.full((rows,), 0.25))
    hot = _random(rows, seeds=seeds, positions=positions)
    cold_share = sample(logits, cold).eq(0).float().mean().item()
    hot_share = sample(logits, hot).eq(0).float().mean().item()
    assert cold_share == pytest.approx(1 / (1 + math.exp(-4)), abs=0.02)
    assert hot_share == pytest.approx(1 / (1 + math.exp(-1)), abs=0.02)


def test_noise_depends_only_on_seed_and_position() -> None:
    seeds = torch.tensor([1, 2, 1, -5])
    positions = torch.tensor([10, 10, 10, 3])
    u = uniform(seeds, positions, 50)
    assert torch.equal(u[0], u[2])
    assert not torch.equal(u[0], u[1])
    alone = uniform(seeds[3:], positions[3:], 50)
    assert torch.equal(alone[0], u[3])
    assert float(u.min()) > 0.0 and float(u.max()) <= 1.0


def test_request_seed() -> None:
    assert request_seed("r", 42, 0) == 42
    assert request_seed("r", 2**64 - 1, 0) == -1  # stored as a signed 64-bit int
    derived = request_seed("r", None, 0)
    assert derived == request_seed("r", None, 0)
    assert derived != request_seed("s", None, 0) and derived != request_seed("r", None, 1)


def test_logprobs_and_ranks() -> None:
    tensors = compute_logprobs(LOGITS, torch.tensor([0, 4]), 2)
    expected = LOGITS.log_softmax(-1)
    assert torch.allclose(tensors.token_logprobs, expected[[0, 1], [0, 4]])
    assert tensors.token_ranks.tolist() == [2, 2]
    assert tensors.top_ids.tolist() == [[5, 0], [2, 4]]
    assert torch.allclose(tensors.top_logprobs, expected.topk(2).values)
