"""Exact verification of draft tokens: the normal sampler run at every draft position.

A request that decodes with ``s`` drafts computes ``1 + s`` positions in one forward pass: its
last known token at position ``c`` and the drafts at ``c + 1 .. c + s``. The logits of input
position ``c + j`` score position ``c + 1 + j`` (row ``j``, ``0 <= j <= s``). Each row is sampled
exactly as non-speculative decoding would sample that position had the drafts before it been
generated:

* penalties count the output so far plus drafts ``0 .. j - 1``;
* stop tokens are banned while the output at that position is below ``min_tokens``;
* the row has its own grammar bitmask row;
* the random noise is keyed by (seed, position ``c + 1 + j``), so seeded requests at T > 0 draw
  what they would draw without speculation.

The accepted drafts are the longest prefix equal to those samples (``a`` of them), and the step
returns ``a + 1`` tokens: the accepted drafts and the sample of row ``a`` (the correction, or
the bonus token when every draft is accepted). For greedy requests this is the argmax chain; at
T > 0 with deterministic drafts it accepts draft ``d`` with probability ``p(d)`` and otherwise
draws from ``p`` without ``d``, which is rejection sampling's distribution, and the tokens equal
the non-speculative ones.

Everything happens on the device; the host reads the samples and the accepted counts with one
copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from engine_core_cuda._input_batch import CachedRequestState, InputBatch
from engine_core_cuda._sampler import SamplingBatch, sample, unpack_bitmask
from engine_core_cuda._sampling_inputs import build_sampling_batch

__all__ = ["DraftRows", "Verified", "build_verify_batch", "record_verified", "verify"]


@dataclass(slots=True)
class DraftRows:
    """The host-side layout of a step's verified rows: request ``i`` owns rows
    ``row_start[i] .. row_start[i] + num_drafts[i]`` (one per draft, plus the bonus row)."""

    drafts: list[list[int]]
    """Per request, the draft tokens it verifies (empty: it samples one row as usual)."""
    row_start: np.ndarray
    """``[B + 1]`` int64 first row of each request, then the number of rows."""
    row_request: np.ndarray
    """``[R]`` int64 request index of each row."""
    row_offset: np.ndarray
    """``[R]`` int64 index ``j`` of each row within its request."""

    @classmethod
    def of(cls, drafts: list[list[int]]) -> DraftRows:
        counts = np.fromiter((1 + len(d) for d in drafts), dtype=np.int64, count=len(drafts))
        row_start = np.zeros(len(drafts) + 1, dtype=np.int64)
        np.cumsum(counts, out=row_start[1:])
        row_request = np.repeat(np.arange(len(drafts), dtype=np.int64), counts)
        row_offset = np.arange(int(row_start[-1]), dtype=np.int64) - row_start[row_request]
        return cls(drafts, row_start, row_request, row_offset)

    @property
    def num_rows(self) -> int:
        return int(self.row_start[-1])

    @property
    def max_drafts(self) -> int:
        return max((len(d) for d in self.drafts), default=0)


def _draft_counts(rows: DraftRows) -> tuple[list[int], list[int]]:
    """(row, token) pairs adding drafts ``0 .. j - 1`` to row ``j``'s output counts."""
    row_index: list[int] = []
    tokens: list[int] = []
    for i, drafts in enumerate(rows.drafts):
        first = int(rows.row_start[i])
        for j in range(1, len(drafts) + 1):
            row_index.extend([first + j] * j)
            tokens.extend(drafts[:j])
    return row_index, tokens


def _row_banned(
    states: list[CachedRequestState], rows: DraftRows, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Stop tokens masked on each row whose output count at its position is below
    ``min_tokens``."""
    index: list[int] = []
    tokens: list[int] = []
    for i, state in enumerate(states):
        if not state.stop_ids:
            continue
        first = int(rows.row_start[i])
        for j in range(len(rows.drafts[i]) + 1):
            if state.num_output_tokens + j < state.params.min_tokens:
                index.extend([first + j] * len(state.stop_ids))
                tokens.extend(state.stop_ids)
    if not index:
        return None
    packed = torch.tensor([index, tokens], dtype=torch.int64).to(device)
    return packed[0], packed[1]


def build_verify_batch(
    batch: InputBatch,
    states: list[CachedRequestState],
    rows: torch.Tensor,
    positions: torch.Tensor,
    draft_rows: DraftRows,
    bitmask: np.ndarray | None,
) -> SamplingBatch:
    """The sampling inputs of every verified row. ``states``/``rows``/``positions``: the
    requests that sample, their persistent rows and the position of their first sampled token
    (``c + 1``); ``bitmask``: the int32 grammar rows of the constrained ones among them, ``1 +
    len(drafts)`` consecutive rows each, in batch order (None: no request is constrained)."""
    device = batch.device
    row_request = torch.from_numpy(draft_rows.row_request).to(device)
    row_offset = torch.from_numpy(draft_rows.row_offset).to(device)
    row_states = [states[i] for i in draft_rows.row_request.tolist()]
    result = build_sampling_batch(
        batch, row_states, rows[row_request], positions[row_request] + row_offset, None
    )
    if result.output_counts is not None:
        index, tokens = _draft_counts(draft_rows)
        if index:
            packed = torch.tensor([index, tokens], dtype=torch.int64).to(device)
            ones = torch.ones(len(index), dtype=result.output_counts.dtype, device=device)
            result.output_counts = result.output_counts.index_put(
                (packed[0], packed[1]), ones, accumulate=True
            )
    result.banned = _row_banned(states, draft_rows, device)
    if bitmask is not None:
        result.allowed = _allowed_rows(states, draft_rows, bitmask, batch.vocab_size, device)
    return result


def _allowed_rows(
    states: list[CachedRequestState],
    draft_rows: DraftRows,
    bitmask: np.ndarray,
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    index: list[int] = []
    for i, state in enumerate(states):
        if state.constrained:
            index.extend(range(int(draft_rows.row_start[i]), int(draft_rows.row_start[i + 1])))
    if bitmask.ndim != 2 or len(bitmask) != len(index):
        raise RuntimeError(
            f"grammar bitmask has shape {bitmask.shape} but the batch verifies {len(index)} "
            "constrained positions"
        )
    if not index:
        return None
    words = torch.from_numpy(np.ascontiguousarray(bitmask, dtype=np.int32)).to(device)
    return torch.tensor(index, dtype=torch.int64).to(device), unpack_bitmask(words, vocab_size)


@dataclass(slots=True)
class Verified:
    """The outcome of :func:`verify`."""

    tokens: list[list[int]]
    """Per request, its accepted drafts then one sampled token."""
    samples: torch.Tensor
    """``[R]`` int64 sample of every row (device)."""
    num_accepted: torch.Tensor
    """``[B]`` int64 accepted drafts per request (device)."""


def verify(
    logits: torch.Tensor,
    batch: SamplingBatch,
    draft_rows: DraftRows,
    impl: Literal["torch", "triton"] = "torch",
) -> Verified:
    """Sample every row of ``logits`` (``[R, V]`` float32, rows laid out by ``draft_rows``)
    with ``batch`` (from :func:`build_verify_batch`) and accept each request's longest prefix
    of drafts equal to the samples."""
    device = logits.device
    samples = sample(logits, batch, impl)
    num_requests = len(draft_rows.drafts)
    width = 1 + draft_rows.max_drafts
    # [B, width] samples and drafts; slots past a request's rows hold -1 (never equal).
    padded_drafts = np.full((num_requests, width), -1, dtype=np.int64)
    for i, drafts in enumerate(draft_rows.drafts):
        padded_drafts[i, : len(drafts)] = drafts
    flat = torch.from_numpy(draft_rows.row_request * width + draft_rows.row_offset).to(device)
    grid = torch.full((num_requests * width,), -2, dtype=torch.int64, device=device)
    grid[flat] = samples
    grid = grid.view(num_requests, width)
    matches = grid == torch.from_numpy(padded_drafts).to(device)
    num_accepted = matches.to(torch.int64).cumprod(dim=1).sum(dim=1)
    host = torch.cat([grid, num_accepted[:, None]], dim=1).tolist()  # the one device->host copy
    tokens = [row[: row[-1] + 1] for row in host]
    return Verified(tokens, samples, num_accepted)


def record_verified(
    batch: InputBatch,
    rows: torch.Tensor,
    positions: torch.Tensor,
    draft_rows: DraftRows,
    verified: Verified,
) -> None:
    """Write each request's returned tokens into its persistent row (at ``positions[i] + j``,
    over the drafts there) and count them for the penalties; rows past a request's accepted
    drafts leave the batch as it was."""
    device = rows.device
    row_request = torch.from_numpy(draft_rows.row_request).to(device)
    row_offset = torch.from_numpy(draft_rows.row_offset).to(device)
    keep = row_offset <= verified.num_accepted[row_request]
    target_rows = rows[row_request]
    target_positions = positions[row_request] + row_offset
    current = batch.token_ids[target_rows, target_positions]
    batch.token_ids[target_rows, target_positions] = torch.where(
        keep, verified.samples.to(current.dtype), current
    )
    if batch.output_counts is not None:
        batch.output_counts.index_put_(
            (target_rows, verified.samples), keep.to(torch.int32), accumulate=True
        )
