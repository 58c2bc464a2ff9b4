"""Assembling a step's :class:`SamplingBatch` from the persistent rows.

Sampling parameters live on the device (written once per request); a step gathers the rows it
samples and enables only the stages some row needs. Host-side flags decide which stages run, so
a batch of plain greedy requests costs one argmax.
"""

from __future__ import annotations

import torch

from engine_core_cuda._input_batch import (
    FREQUENCY,
    MIN_P,
    PRESENCE,
    REPETITION,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    CachedRequestState,
    InputBatch,
)
from engine_core_cuda._sampler import SamplingBatch, unpack_bitmask

__all__ = ["build_sampling_batch"]


def _banned(
    states: list[CachedRequestState], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row index, token id) pairs of stop tokens masked below ``min_tokens``."""
    index: list[int] = []
    tokens: list[int] = []
    for k, state in enumerate(states):
        if state.stop_ids and state.num_output_tokens < state.params.min_tokens:
            index.extend([k] * len(state.stop_ids))
            tokens.extend(state.stop_ids)
    if not index:
        return None
    packed = torch.tensor([index, tokens], dtype=torch.int64).to(device)
    return packed[0], packed[1]


def _logit_bias(
    states: list[CachedRequestState], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(row index, token id, bias) of every ``logit_bias`` entry of ``states``."""
    index: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for k, state in enumerate(states):
        bias = state.params.logit_bias
        if bias:
            index.extend([k] * len(bias))
            tokens.extend(bias)
            values.extend(bias.values())
    if not index:
        return None
    packed = torch.tensor([index, tokens], dtype=torch.int64).to(device)
    return packed[0], packed[1], torch.tensor(values, dtype=torch.float32).to(device)


def build_sampling_batch(
    batch: InputBatch,
    states: list[CachedRequestState],
    rows: torch.Tensor,
    positions: torch.Tensor,
    bitmask_rows: tuple[list[int], torch.Tensor] | None,
) -> SamplingBatch:
    """The sampling inputs of ``states`` (persistent ``rows``, sampling at ``positions``);
    ``bitmask_rows``: (indices among ``states``, their int32 bitmask rows)."""
    device = batch.device
    all_greedy = all(s.greedy for s in states)
    need_floats = not all_greedy or any(s.uses_penalties for s in states)
    floats = batch.float_params[rows] if need_floats else None
    ints = batch.int_params[rows]
    result = SamplingBatch(seeds=ints[:, SEED], positions=positions, all_greedy=all_greedy)
    if not all_greedy:
        assert floats is not None
        result.greedy = torch.tensor([s.greedy for s in states], dtype=torch.bool).to(device)
        sampling = [s.params for s in states if not s.greedy]
        if any(p.temperature != 1.0 for p in sampling):
            result.temperature = floats[:, TEMPERATURE]
        if any(p.top_k > 0 for p in sampling):
            result.top_k = ints[:, TOP_K]
        if any(p.top_p < 1.0 for p in sampling):
            result.top_p = floats[:, TOP_P]
        if any(p.min_p > 0.0 for p in sampling):
            result.min_p = floats[:, MIN_P]
    penalized = [s.params for s in states if s.uses_penalties]
    if penalized:
        assert floats is not None and batch.output_counts is not None
        assert batch.prompt_mask is not None
        result.output_counts = batch.output_counts[rows]
        result.prompt_mask = batch.prompt_mask[rows]
        if any(p.presence_penalty != 0.0 for p in penalized):
            result.presence_penalty = floats[:, PRESENCE]
        if any(p.frequency_penalty != 0.0 for p in penalized):
            result.frequency_penalty = floats[:, FREQUENCY]
        if any(p.repetition_penalty != 1.0 for p in penalized):
            result.repetition_penalty = floats[:, REPETITION]
    result.banned = _banned(states, device)
    result.logit_bias = _logit_bias(states, device)
    if bitmask_rows is not None:
        index, words = bitmask_rows
        allowed = unpack_bitmask(words, batch.vocab_size)
        result.allowed = (torch.tensor(index, dtype=torch.int64).to(device), allowed)
    return result
