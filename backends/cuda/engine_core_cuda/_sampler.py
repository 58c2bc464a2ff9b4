"""On-device sampling of one step: logits in, token ids (and logprobs) out.

Order, as in vLLM: the logit bias (:func:`apply_logit_bias`, its own step), penalties (repetition
over prompt and output, frequency and presence over the output), then the masks (stop tokens below
``min_tokens``, the grammar bitmask), then greedy rows take the argmax; the others divide by their
temperature, apply min-p, top-k and top-p, and draw with counter-based noise
(:mod:`engine_core_cuda._random`). Logprobs are those of the raw logits (the model's distribution,
before any processing).

Two implementations of the last part give the same tokens: ``"torch"`` (the reference: a sort for
top-k with top-p, the noise as ``[rows, vocab]`` tensors; on the CPU the race runs in chunks,
:func:`engine_core_cuda._random.exponential_race`) and ``"triton"``, one fused kernel per
step (:mod:`engine_core_cuda.kernels.sampling`). Processing that changes the logits (penalties,
masks, a logit bias) happens before, on the logits that :func:`sample` takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from engine_core_cuda._random import exponential_noise, exponential_race

__all__ = [
    "LogprobsTensors",
    "SamplingBatch",
    "apply_logit_bias",
    "compute_logprobs",
    "sample",
    "unpack_bitmask",
]


@dataclass(slots=True)
class SamplingBatch:
    """Per-step inputs of the rows that sample (tensors on the device, ``N`` rows).

    Optional fields are None when no row of the step needs them, so the common cases (all
    greedy, no penalties) skip their work entirely.
    """

    seeds: torch.Tensor
    """``[N]`` int64 request seeds."""
    positions: torch.Tensor
    """``[N]`` int64 position of the token being sampled (the random stream's counter)."""
    all_greedy: bool
    greedy: torch.Tensor | None = None
    """``[N]`` bool; None when every row is greedy."""
    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    """``[N]`` int64, ``vocab_size`` where disabled."""
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    """``[N, V]`` int32 occurrences of each token in the output so far (with penalties)."""
    prompt_mask: torch.Tensor | None = None
    """``[N, V]`` bool tokens present in the prompt (with penalties)."""
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    """(row indices, token ids) masked this step (stop tokens below ``min_tokens``)."""
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    """(row indices ``[K]``, allowed-token mask ``[K, V]``) from the grammar bitmask."""
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(row indices ``[B]``, token ids ``[B]``, float32 biases ``[B]``) of every row's
    ``logit_bias`` entries."""


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs of chosen rows: the given tokens' logprob and 1-based rank, and the top-k."""

    token_logprobs: torch.Tensor
    token_ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 words ``[K, W]`` (bit ``j`` of word ``j // 32``: token ``j`` allowed) -> bool
    ``[K, vocab_size]``; tokens past the words are disallowed."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.to(torch.int32)[:, :, None] >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])
    return torch.cat([allowed, pad], dim=1)


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    counts = batch.output_counts
    assert counts is not None and batch.prompt_mask is not None
    if batch.repetition_penalty is not None:
        penalty = batch.repetition_penalty[:, None]
        seen = batch.prompt_mask | (counts > 0)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty[:, None] * counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty[:, None] * (counts > 0)
    return logits


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k alone, without a sort: the k-th largest logit of each row is the threshold."""
    vocab_size = logits.shape[-1]
    k = top_k.clamp(1, vocab_size).unsqueeze(1)
    largest = logits.topk(int(k.max()), dim=-1).values  # sorted, largest first
    threshold = largest.gather(1, k - 1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.top_p is None:
        assert batch.top_k is not None
        return _apply_top_k(logits, batch.top_k)
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    if batch.top_k is not None:
        kth = (vocab_size - batch.top_k.clamp(1, vocab_size)).unsqueeze(1)
        threshold = sorted_logits.gather(1, kth)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if batch.top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - batch.top_p.unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(1, order, sorted_logits)


def _random_sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.temperature is not None:
        logits = logits / batch.temperature[:, None]
    if batch.min_p is not None:
        probs = logits.softmax(dim=-1)
        floor = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if batch.top_k is not None or batch.top_p is not None:
        logits = _apply_top_k_top_p(logits, batch)
    probs = logits.softmax(dim=-1)
    if probs.device.type == "cpu":  # the same tokens, without the [rows, vocab] noise tensors
        return exponential_race(probs, batch.seeds, batch.positions)
    noise = exponential_noise(batch.seeds, batch.positions, logits.shape[-1])
    return (probs / noise).argmax(dim=-1)


def apply_logit_bias(
    logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """``logits`` ``[N, V]`` with each (row, token, value) of ``bias`` added: a new tensor, so
    the raw logits (which logprobs report) stay as they are."""
    rows, token_ids, values = bias
    return logits.index_put((rows, token_ids), values, accumulate=True)


def _fused_sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    from engine_core_cuda.kernels.sampling import sample_rows

    return sample_rows(
        logits,
        batch.seeds,
        batch.positions,
        greedy=batch.greedy,
        temperature=batch.temperature,
        min_p=batch.min_p,
        top_k=batch.top_k,
        top_p=batch.top_p,
    )


def sample(
    logits: torch.Tensor, batch: SamplingBatch, impl: Literal["torch", "triton"] = "torch"
) -> torch.Tensor:
    """Token ids ``[N]`` (int64) from float32 ``logits`` ``[N, V]``; ``impl`` picks the
    implementation of the random part (see the module's docstring)."""
    if batch.logit_bias is not None:
        logits = apply_logit_bias(logits, batch.logit_bias)
    if batch.output_counts is not None:
        logits = _apply_penalties(logits, batch)
    if batch.banned is not None or batch.allowed is not None:
        logits = logits.clone() if batch.output_counts is None else logits
        if batch.banned is not None:
            logits[batch.banned] = float("-inf")
        if batch.allowed is not None:
            rows, allowed = batch.allowed
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    if impl == "triton":
        return _fused_sample(logits, batch)
    greedy_tokens = logits.argmax(dim=-1)
    random_tokens = _random_sample(logits, batch)
    assert batch.greedy is not None
    return torch.where(batch.greedy, greedy_tokens, random_tokens)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> LogprobsTensors:
    """Logprobs of ``token_ids`` (``[N]``) and the ``num_top`` most likely tokens under
    ``logits`` (``[N, V]``, float32)."""
    logprobs = logits.log_softmax(dim=-1)
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    token_ranks = (logprobs > token_logprobs.unsqueeze(1)).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return LogprobsTensors(token_logprobs, token_ranks, top_ids, top_logprobs)
