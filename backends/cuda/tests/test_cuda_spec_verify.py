"""Verification of draft tokens on hand-made logits, against non-speculative decoding of the
same rows and a plain torch reference."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pytest
import torch
from engine_core_cuda._input_batch import CachedRequestState, InputBatch
from engine_core_cuda._random import exponential_noise, request_seed
from engine_core_cuda._sampler import sample
from engine_core_cuda._sampling_inputs import build_sampling_batch
from engine_core_cuda._spec_verify import DraftRows, build_verify_batch, record_verified, verify

from engine_core import SamplingParams
from engine_core.abc import NewRequestData

VOCAB = 16
PROMPT_LEN = 3
DEVICE = torch.device("cpu")


def _batch(
    params: list[SamplingParams], eos: int = 15
) -> tuple[InputBatch, list[CachedRequestState]]:
    batch = InputBatch(
        max_num_reqs=len(params), max_model_len=32, block_size=4, vocab_size=VOCAB,
        engine_seed=0, device=DEVICE,
    )  # fmt: skip
    states = []
    for i, p in enumerate(params):
        prompt = [(i + k) % 7 for k in range(PROMPT_LEN)]
        new = NewRequestData(f"r{i}", prompt, p, [i], 0, PROMPT_LEN, [], [eos])
        states.append(batch.add(new))
    batch.flush()
    return batch, states


def _non_speculative(
    params: list[SamplingParams], logits: list[torch.Tensor], impl: Literal["torch", "triton"]
) -> list[list[int]]:
    """Each request decodes ``len(logits[i])`` positions one at a time, position ``j`` scored by
    row ``j``, through the ordinary sampling path."""
    batch, states = _batch(params)
    tokens: list[list[int]] = []
    for state, rows in zip(states, logits, strict=True):
        out: list[int] = []
        for j in range(len(rows)):
            row = torch.tensor([state.row])
            position = torch.tensor([state.num_tokens])
            sampling = build_sampling_batch(batch, [state], row, position, None)
            token = sample(rows[j : j + 1], sampling, impl)
            batch.record_sampled(row, position, token)
            state.num_tokens += 1
            out.append(int(token))
        tokens.append(out)
    return tokens


def _verify(
    params: list[SamplingParams],
    logits: list[torch.Tensor],
    drafts: list[list[int]],
    impl: Literal["torch", "triton"],
) -> tuple[list[list[int]], InputBatch, list[CachedRequestState]]:
    batch, states = _batch(params)
    draft_rows = DraftRows.of(drafts)
    rows = torch.tensor([s.row for s in states])
    positions = torch.tensor([s.num_tokens for s in states])
    sampling = build_verify_batch(batch, states, rows, positions, draft_rows, None)
    verified = verify(torch.cat(logits), sampling, draft_rows, impl)
    record_verified(batch, rows, positions, draft_rows, verified)
    return verified.tokens, batch, states


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=20),
    SamplingParams(
        temperature=0.0,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        max_tokens=20,
    ),  # fmt: skip
    SamplingParams(temperature=0.0, min_tokens=3, max_tokens=20),
    SamplingParams(temperature=0.9, seed=11, max_tokens=20),
    SamplingParams(
        temperature=0.7,
        seed=5,
        top_k=6,
        min_p=0.02,
        frequency_penalty=0.8,
        logit_bias={3: 2.0},
        max_tokens=20,
    ),  # fmt: skip
    SamplingParams(temperature=1.2, top_p=0.8, max_tokens=20),  # unseeded: engine seed + id
]


def _logits(seed: int, num_rows: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in PARAMS:
        rows = torch.randn(num_rows, VOCAB, generator=generator) * 2.0
        rows[:, 15] += 3.0  # EOS likely, so the min_tokens ban matters
        rows[:, 4] += 1.0  # a token that repeats, so the penalties matter
        out.append(rows)
    return out


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("case", ["all_right", "all_wrong", "mixed", "none"])
def test_verification_returns_the_non_speculative_tokens(
    impl: Literal["torch", "triton"], case: str
) -> None:
    k = 4
    logits = _logits(1, k + 1)
    reference = _non_speculative(PARAMS, logits, impl)
    drafts: list[list[int]] = []
    for i, tokens in enumerate(reference):
        wrong = [(t + 1) % VOCAB for t in tokens[:k]]
        if case == "all_right":
            drafts.append(tokens[:k])
        elif case == "all_wrong":
            drafts.append(wrong)
        elif case == "mixed":  # request i gets i % (k + 1) right drafts, then a wrong one
            right = i % (k + 1)
            drafts.append(tokens[:right] + wrong[right : right + 1])
        else:
            drafts.append([])
    rows = [r[: 1 + len(d)] for r, d in zip(logits, drafts, strict=True)]
    tokens, _, _ = _verify(PARAMS, rows, drafts, impl)
    for got, d, ref in zip(tokens, drafts, reference, strict=True):
        accepted = len(got) - 1
        assert got[:accepted] == d[:accepted]
        assert accepted == len(d) or got[accepted] != d[accepted]
        assert got == ref[: len(got)]
    expected = {
        "all_right": [k + 1] * len(PARAMS),
        "all_wrong": [1] * len(PARAMS),
        "mixed": [min(i % (k + 1), k) + 1 for i in range(len(PARAMS))],
        "none": [1] * len(PARAMS),
    }[case]
    assert [len(t) for t in tokens] == expected
    if case == "all_right":
        assert reference[2][:2].count(15) == 0  # min_tokens held EOS back, draft rows included


def test_min_tokens_bans_by_the_output_count_at_each_position() -> None:
    params = [SamplingParams(temperature=0.0, min_tokens=2, max_tokens=9)]
    logits = torch.zeros(4, VOCAB)
    logits[:, 15] = 5.0  # EOS is the argmax everywhere
    logits[:, 2] = 1.0
    tokens, _, _ = _verify(params, [logits], [[2, 2, 2]], "torch")
    # Positions 0 and 1 (outputs 0 and 1) must not stop; position 2 may.
    assert tokens == [[2, 2, 15]]


def test_penalties_count_the_drafts_before_each_position() -> None:
    params = [SamplingParams(temperature=0.0, presence_penalty=2.0, max_tokens=9)]
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 3.0
    logits[:, 8] = 2.0
    logits[:, 9] = 1.5
    # Row 0 picks 7; row 1 sees 7 once (3 - 2 = 1 < 2): 8; row 2 sees both: 9.
    tokens, batch, states = _verify(params, [logits], [[7, 8]], "torch")
    assert tokens == [[7, 8, 9]]
    assert batch.output_counts is not None
    counts = batch.output_counts[states[0].row]
    assert counts[[7, 8, 9]].tolist() == [1, 1, 1]
    assert int(counts.sum()) == 3
    base = states[0].num_tokens
    assert batch.token_ids[states[0].row, base : base + 3].tolist() == [7, 8, 9]


def test_rejected_rows_leave_the_batch_as_it_was() -> None:
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.5, max_tokens=9)]
    logits = torch.zeros(4, VOCAB)
    logits[:, 5] = 1.0
    batch, states = _batch(params)
    state = states[0]
    base = state.num_tokens
    # The drafts were written into the row before the forward pass (as the backend does).
    batch.token_ids[state.row, base : base + 3] = torch.tensor([5, 6, 6], dtype=torch.int32)
    draft_rows = DraftRows.of([[5, 6, 6]])
    rows, positions = torch.tensor([state.row]), torch.tensor([base])
    sampling = build_verify_batch(batch, states, rows, positions, draft_rows, None)
    verified = verify(logits, sampling, draft_rows)
    record_verified(batch, rows, positions, draft_rows, verified)
    assert verified.tokens == [[5, 5]]
    # Accepted 5, then 5 over the wrong draft; the positions after keep the drafts (the next
    # step overwrites them), and only the two returned tokens count.
    assert batch.token_ids[state.row, base : base + 3].tolist() == [5, 5, 6]
    assert batch.output_counts is not None
    assert batch.output_counts[state.row].tolist()[5:7] == [2, 0]


def test_grammar_rows_apply_per_position() -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=9)] * 2
    batch, states = _batch(params)
    states[1].constrained = True
    logits = torch.zeros(5, VOCAB)
    logits[:, 1] = 2.0
    logits[:, 3] = 1.0
    draft_rows = DraftRows.of([[1], [3, 1]])
    # Request 1's three positions: only 3; only 1; 1 or 3 (1 wins).
    bitmask = np.array([[1 << 3], [1 << 1], [(1 << 1) | (1 << 3)]], dtype=np.int32)
    rows = torch.tensor([s.row for s in states])
    positions = torch.tensor([s.num_tokens for s in states])
    sampling = build_verify_batch(batch, states, rows, positions, draft_rows, bitmask)
    assert verify(logits, sampling, draft_rows).tokens == [[1, 1], [3, 1, 1]]
    with pytest.raises(RuntimeError, match="verifies 3 constrained positions"):
        build_verify_batch(batch, states, rows, positions, draft_rows, bitmask[:2])


def test_against_a_plain_torch_reference() -> None:
    """Greedy rows are the argmax chain; seeded rows at T > 0 are the exponential race with the
    noise of (seed, position), written out here without the sampler."""
    k = 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3)]
    generator = torch.Generator().manual_seed(7)
    logits = [torch.randn(k + 1, VOCAB, generator=generator) for _ in params]
    batch, states = _batch(params)
    start = states[0].num_tokens
    expected: list[list[int]] = []
    for p, rows in zip(params, logits, strict=True):
        if p.temperature == 0.0:
            chain = rows.argmax(dim=-1).tolist()
        else:
            seed = request_seed("unused", p.seed, 0)
            positions = torch.arange(start, start + k + 1)
            noise = exponential_noise(torch.full((k + 1,), seed), positions, VOCAB)
            chain = ((rows / p.temperature).softmax(dim=-1) / noise).argmax(dim=-1).tolist()
        expected.append(chain)
    # Drafts: the first two positions right, the third wrong.
    drafts = [chain[:2] + [(chain[2] + 1) % VOCAB] for chain in expected]
    draft_rows = DraftRows.of(drafts)
    rows = torch.tensor([s.row for s in states])
    positions = torch.tensor([s.num_tokens for s in states])
    sampling = build_verify_batch(batch, states, rows, positions, draft_rows, None)
    verified = verify(torch.cat(logits), sampling, draft_rows)
    assert verified.tokens == [chain[:3] for chain in expected]
    assert verified.num_accepted.tolist() == [2, 2]
