"""The CPU's chunked exponential race draws the reference's tokens: the same 32-bit hash in int32
words, the same scores, the same first maximum, whatever the chunking."""

from __future__ import annotations

import pytest
import torch
from engine_core_cuda import _random
from engine_core_cuda._random import exponential_noise, exponential_race
from engine_core_cuda._sampler import SamplingBatch, sample

EDGE_SEEDS = [0, 1, -1, 2**63 - 1, -(2**63), 0x9E3779B9, 2**32, -(2**32) - 7]


def _reference(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return (probs / exponential_noise(seeds, positions, probs.shape[1])).argmax(dim=-1)


def test_the_int32_mixer_has_the_reference_bits() -> None:
    generator = torch.Generator().manual_seed(0)
    words = torch.cat(
        [
            torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 0xFFFF, 0x10000]),
            torch.randint(0, 2**32, (4093,), generator=generator),
        ]
    )
    x = _random._as_int32(words)
    _random._mix32_(x, torch.empty_like(x))
    assert torch.equal(x.to(torch.int64) & 0xFFFFFFFF, _random._mix32(words))


@pytest.mark.parametrize("chunk_elements", [16 * 7, 1 << 16], ids=["many-chunks", "default"])
def test_the_race_draws_the_reference_tokens(
    monkeypatch: pytest.MonkeyPatch, chunk_elements: int
) -> None:
    monkeypatch.setattr(_random, "_CHUNK_ELEMENTS", chunk_elements)
    generator = torch.Generator().manual_seed(1)
    rows, vocab = 96, 1037  # not a multiple of any chunk width
    seeds = torch.tensor(
        EDGE_SEEDS + torch.randint(-(2**62), 2**62, (rows - len(EDGE_SEEDS),),
                                   generator=generator).tolist()
    )  # fmt: skip
    positions = torch.randint(0, 2**33, (rows,), generator=generator)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    logits[::3, ::2] = float("-inf")  # masked tokens: probability 0
    probs = logits.softmax(dim=-1)
    flat = torch.full((8, vocab), 1.0 / vocab)  # every token alike: the noise alone decides
    for p, s, q in ((probs, seeds, positions), (flat, seeds[:8], positions[:8])):
        assert torch.equal(exponential_race(p, s, q), _reference(p, s, q))
    one_hot = torch.zeros(2, vocab)
    one_hot[:, vocab - 1] = 1.0
    assert exponential_race(one_hot, seeds[:2], positions[:2]).tolist() == [vocab - 1] * 2


def test_a_row_draws_the_same_token_in_any_batch() -> None:
    generator = torch.Generator().manual_seed(2)
    probs = torch.randn(40, 500, generator=generator).softmax(dim=-1)
    seeds = torch.randint(-(2**62), 2**62, (40,), generator=generator)
    positions = torch.randint(0, 10_000, (40,), generator=generator)
    together = exponential_race(probs, seeds, positions)
    alone = [int(exponential_race(probs[i : i + 1], seeds[i : i + 1], positions[i : i + 1]))
             for i in (0, 17, 39)]  # fmt: skip
    assert alone == [int(together[i]) for i in (0, 17, 39)]
    assert exponential_race(probs[:0], seeds[:0], positions[:0]).shape == (0,)


def test_the_sampler_on_the_cpu_uses_the_race() -> None:
    """Temperature, top-k and top-p rows next to greedy ones: the reference's tokens."""
    generator = torch.Generator().manual_seed(3)
    rows, vocab = 12, 300
    logits = torch.randn(rows, vocab, generator=generator) * 2
    batch = SamplingBatch(
        seeds=torch.randint(-(2**62), 2**62, (rows,), generator=generator),
        positions=torch.arange(rows) * 11,
        all_greedy=False,
        greedy=torch.arange(rows) % 4 == 0,
        temperature=torch.full((rows,), 0.7),
        top_k=torch.tensor([vocab, 5] * (rows // 2)),
        top_p=torch.full((rows,), 0.9),
    )
    tokens = sample(logits, batch)
    scaled = logits / 0.7
    kept = torch.stack([_random_kept(scaled[i], int(batch.top_k[i])) for i in range(rows)])  # type: ignore[index]
    expected = _reference(kept.softmax(dim=-1), batch.seeds, batch.positions)
    expected = torch.where(batch.greedy, logits.argmax(dim=-1), expected)  # type: ignore[arg-type]
    assert torch.equal(tokens, expected)


def _random_kept(row: torch.Tensor, top_k: int, top_p: float = 0.9) -> torch.Tensor:
    """The row with top-k then top-p applied (-inf outside), as the reference sorts it."""
    values, order = row.sort(descending=False)
    values = values.masked_fill(values < values[len(values) - top_k], float("-inf"))
    cumulative = values.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[-1] = False
    values = values.masked_fill(drop, float("-inf"))
    return values.scatter(0, order, values)
