"""A step with drafts, sampled: the rows of the requests that sample, verified
(:mod:`engine_core_cuda._spec_verify`), written back into the batch, with logprobs of the
returned tokens."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch

from engine_core.abc import TokenLogprobs
from engine_core_cuda._input_batch import InputBatch
from engine_core_cuda._logprobs import to_token_logprobs
from engine_core_cuda._sampler import compute_logprobs
from engine_core_cuda._spec_verify import DraftRows, build_verify_batch, record_verified, verify
from engine_core_cuda._step_inputs import StepInputs

__all__ = ["sample_with_drafts"]


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


def sample_with_drafts(
    batch: InputBatch,
    step: StepInputs,
    logits: torch.Tensor,
    picks: list[int],
    bitmask: Any | None,
    impl: Literal["torch", "triton"],
) -> tuple[list[list[int]], list[list[TokenLogprobs] | None] | None]:
    """Verify the drafts of the requests ``picks`` (indices into the step's batch) from
    ``logits`` (the step's rows, laid out by ``step.draft_rows``): per request of the step
    (batch order), its returned tokens and, when some request asked, logprobs of each."""
    assert step.draft_rows is not None
    device = logits.device
    states = [step.states[i] for i in picks]
    draft_rows = DraftRows.of([s.drafts for s in states])
    if len(picks) < len(step.states):
        all_rows = step.draft_rows
        index = np.concatenate(
            [np.arange(all_rows.row_start[i], all_rows.row_start[i + 1]) for i in picks]
        )
        logits = logits[torch.from_numpy(index).to(device)]
    rows = step.seq_rows[torch.tensor(picks, dtype=torch.int64).to(device)].long()
    positions = torch.tensor([s.num_tokens for s in states], dtype=torch.int64).to(device)
    grammar = _grammar_rows(step, picks, bitmask)
    sampling = build_verify_batch(batch, states, rows, positions, draft_rows, grammar)
    verified = verify(logits, sampling, draft_rows, impl)
    record_verified(batch, rows, positions, draft_rows, verified)
    sampled: list[list[int]] = [[] for _ in step.states]
    for i, tokens in zip(picks, verified.tokens, strict=True):
        sampled[i] = tokens
        state = step.states[i]
        state.num_tokens += len(tokens)
        # The rejected drafts were computed but are not part of the sequence.
        state.num_computed_tokens -= len(state.drafts) + 1 - len(tokens)
    found = _logprobs(states, logits, draft_rows, verified.tokens)
    if found is None:
        return sampled, None
    logprobs: list[list[TokenLogprobs] | None] = [None] * len(step.states)
    for i, entries in zip(picks, found, strict=True):
        logprobs[i] = entries
    return sampled, logprobs


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
