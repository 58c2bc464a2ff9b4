"""A step with drafts, sampled: the rows of the requests that sample, verified
(:mod:`engine_core_cuda._spec_verify`), written back into the batch, with logprobs of the
returned tokens.

Under tensor parallelism rank 0 verifies and broadcasts every row's sample and each request's
accepted count in one tensor (``[rows + requests]`` int64); the other ranks, which hold the same
step (the same drafts, so the same rows), take them with :func:`receive_verified` and write the
same tokens into their batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch

from engine_core.abc import TokenLogprobs
from engine_core_cuda._input_batch import InputBatch
from engine_core_cuda._logprobs import to_token_logprobs
from engine_core_cuda._sampler import compute_logprobs
from engine_core_cuda._spec_verify import (
    DraftRows,
    Verified,
    build_verify_batch,
    record_verified,
    verify,
)
from engine_core_cuda._step_inputs import StepInputs

__all__ = ["receive_verified", "sample_with_drafts"]

Broadcast = Callable[[torch.Tensor], torch.Tensor]
"""Rank 0's tensor on every rank, in place (``TensorParallel.broadcast``)."""


def _grammar_rows(step: StepInputs, picks: list[int], bitmask: Any | None) -> np.ndarray | None:
    """The bitmask rows of the picked constrained requests (``1 + drafts`` each). Rows of a
    constrained request on a partial prefill chunk (one each) may be present or left out."""
    if bitmask is None:
        return None
    words = np.asarray(bitmask, dtype=np.int32)
    if words.ndim != 2:
        raise RuntimeError(f"grammar bitmask must be 2-D, got shape {words.shape}")
    keep: list[int] = []
    row = 0
    with_partial = len(words) != sum(
        1 + len(s.drafts) for i, s in enumerate(step.states) if s.constrained and step.samples[i]
    )
    for i, state in enumerate(step.states):
        if not state.constrained:
            continue
        if step.samples[i]:
            keep.extend(range(row, row + 1 + len(state.drafts)))
            row += 1 + len(state.drafts)
        elif with_partial:
            row += 1
    if row != len(words):
        raise RuntimeError(
            f"grammar bitmask has {len(words)} rows but the batch verifies {len(keep)} "
            "constrained positions"
        )
    return words[keep] if keep else None


def _verified_rows(
    step: StepInputs, picks: list[int], device: torch.device
) -> tuple[DraftRows, torch.Tensor, torch.Tensor]:
    """The picked requests' row layout, persistent batch rows and first positions."""
    states = [step.states[i] for i in picks]
    draft_rows = DraftRows.of([s.drafts for s in states])
    rows = step.seq_rows[torch.tensor(picks, dtype=torch.int64).to(device)].long()
    positions = torch.tensor([s.num_tokens for s in states], dtype=torch.int64).to(device)
    return draft_rows, rows, positions


def _advance(step: StepInputs, picks: list[int], tokens: list[list[int]]) -> list[list[int]]:
    """Count each picked request's returned tokens; per request of the step, its tokens."""
    sampled: list[list[int]] = [[] for _ in step.states]
    for i, returned in zip(picks, tokens, strict=True):
        sampled[i] = returned
        state = step.states[i]
        state.num_tokens += len(returned)
        # The rejected drafts were computed but are not part of the sequence.
        state.num_computed_tokens -= len(state.drafts) + 1 - len(returned)
    return sampled


def sample_with_drafts(
    batch: InputBatch,
    step: StepInputs,
    logits: torch.Tensor,
    picks: list[int],
    bitmask: Any | None,
    impl: Literal["torch", "triton"],
    broadcast: Broadcast | None = None,
) -> tuple[list[list[int]], list[list[TokenLogprobs] | None] | None]:
    """Verify the drafts of the requests ``picks`` (indices into the step's batch) from
    ``logits`` (the step's rows, laid out by ``step.draft_rows``): per request of the step
    (batch order), its returned tokens and, when some request asked, logprobs of each. With
    ``broadcast`` (rank 0 of several) the outcome goes to the other ranks."""
    assert step.draft_rows is not None
    device = logits.device
    states = [step.states[i] for i in picks]
    draft_rows, rows, positions = _verified_rows(step, picks, device)
    if len(picks) < len(step.states):
        all_rows = step.draft_rows
        index = np.concatenate(
            [np.arange(all_rows.row_start[i], all_rows.row_start[i + 1]) for i in picks]
        )
        logits = logits[torch.from_numpy(index).to(device)]
    grammar = _grammar_rows(step, picks, bitmask)
    sampling = build_verify_batch(batch, states, rows, positions, draft_rows, grammar)
    verified = verify(logits, sampling, draft_rows, impl)
    if broadcast is not None:
        broadcast(torch.cat([verified.samples, verified.num_accepted]))
    record_verified(batch, rows, positions, draft_rows, verified)
    sampled = _advance(step, picks, verified.tokens)
    found = _logprobs(states, logits, draft_rows, verified.tokens)
    if found is None:
        return sampled, None
    logprobs: list[list[TokenLogprobs] | None] = [None] * len(step.states)
    for i, entries in zip(picks, found, strict=True):
        logprobs[i] = entries
    return sampled, logprobs


def receive_verified(
    batch: InputBatch, step: StepInputs, picks: list[int], broadcast: Broadcast
) -> None:
    """On a rank other than 0: take the outcome of rank 0's :func:`sample_with_drafts` for the
    same step from its broadcast and write the same tokens into the batch."""
    device = batch.token_ids.device
    draft_rows, rows, positions = _verified_rows(step, picks, device)
    num_rows = draft_rows.num_rows
    packed = broadcast(torch.empty(num_rows + len(picks), dtype=torch.int64, device=device))
    samples, num_accepted = packed[:num_rows], packed[num_rows:]
    flat, accepted = samples.tolist(), num_accepted.tolist()
    starts = draft_rows.row_start.tolist()
    tokens = [flat[starts[k] : starts[k] + accepted[k] + 1] for k in range(len(picks))]
    record_verified(batch, rows, positions, draft_rows, Verified(tokens, samples, num_accepted))
    _advance(step, picks, tokens)


def _logprobs(
    states: list[Any],
    logits: torch.Tensor,
    draft_rows: DraftRows,
    tokens: list[list[int]],
) -> list[list[TokenLogprobs] | None] | None:
    asked = [k for k, s in enumerate(states) if s.params.logprobs is not None]
    if not asked:
        return None
    index: list[int] = []
    flat_tokens: list[int] = []
    num_tops: list[int] = []
    for k in asked:
        first = int(draft_rows.row_start[k])
        index.extend(range(first, first + len(tokens[k])))
        flat_tokens.extend(tokens[k])
        num_tops.extend([states[k].params.logprobs or 0] * len(tokens[k]))
    device = logits.device
    token_tensor = torch.tensor(flat_tokens, dtype=torch.int64).to(device)
    rows = torch.tensor(index, dtype=torch.int64).to(device)
    tensors = compute_logprobs(logits[rows], token_tensor, max(num_tops))
    entries = to_token_logprobs(tensors, flat_tokens, num_tops)
    result: list[list[TokenLogprobs] | None] = [None] * len(states)
    at = 0
    for k in asked:
        result[k] = entries[at : at + len(tokens[k])]
        at += len(tokens[k])
    return result
