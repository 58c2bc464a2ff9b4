"""Turning a :class:`SchedulerOutput` into the device inputs of one forward pass.

The host applies the scheduler's diffs to its :class:`CachedRequestState` records (O(requests)),
builds per-token positions and row indices (O(scheduled tokens)) and sends them in one transfer;
input ids and cache slots are gathered on the device from the persistent tensors, the slots once per
KV-cache group (each group's block table places the token in a block of its own).

The block ids of a request (``NewRequestData.block_ids``, ``CachedRequestData.new_block_ids``)
come as one list for a one-group layout or as one list per group
(:func:`~engine_core_cuda._kv_layout.group_block_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_core.abc import SchedulerOutput
from engine_core_cuda._input_batch import CachedRequestState, InputBatch
from engine_core_cuda._kv_layout import group_block_ids
from engine_core_cuda._spec_verify import DraftRows

__all__ = ["StepInputs", "apply_scheduler_output", "build_step_inputs", "slots_of"]


@dataclass(slots=True)
class StepInputs:
    """One step's batch: host bookkeeping and device tensors."""

    states: list[CachedRequestState]
    """Batch order: cached requests, then new ones."""
    starts: list[int]
    """Per request, ``num_computed_tokens`` before this step."""
    query_start_loc_host: np.ndarray
    samples: list[bool]
    """Per request, whether it samples a token this step (its prompt is complete)."""
    num_tokens: int
    max_query_len: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mappings: tuple[torch.Tensor, ...]
    """Each token's cache slot in each KV-cache group."""
    seq_rows: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    draft_rows: DraftRows | None = None
    """Speculative decoding: the logits rows of each request (``1 + drafts``), None when no
    request of the step has drafts (one row each, its last position)."""
    logits_indices: torch.Tensor | None = None
    """With ``draft_rows``: the token index of each logits row (its request's ``1 + drafts``
    last positions)."""

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def apply_scheduler_output(
    batch: InputBatch, scheduler_output: SchedulerOutput
) -> tuple[list[CachedRequestState], list[int], list[int]]:
    """Apply the step's diffs: drop finished and preempted requests, extend block tables, add new
    requests. Returns the batch's states, computed-token counts before the step and scheduled
    token counts; raises ``RuntimeError`` when the scheduler's view disagrees with the backend's."""
    for req_id in scheduler_output.finished_req_ids:
        batch.remove(req_id)
    for req_id in scheduler_output.preempted_req_ids:
        batch.remove(req_id)
    cached = scheduler_output.cached
    states: list[CachedRequestState] = []
    starts: list[int] = []
    counts: list[int] = []
    for index, (state, new_blocks, computed, num) in enumerate(cached.diffs(batch.requests)):
        if new_blocks:
            batch.append_blocks(state, group_block_ids(new_blocks, batch.num_kv_groups))
        state.drafts = cached.drafts_of(index)
        if state.drafts:
            _stage_drafts(batch, state, computed, num)
        states.append(state)
        starts.append(computed)
        counts.append(num)
    for new in scheduler_output.new_reqs:
        if new.req_id in batch.requests:
            raise RuntimeError(f"new request {new.req_id!r} is already live in the backend")
        states.append(batch.add(new))
        starts.append(new.num_computed_tokens)
        counts.append(new.num_scheduled_tokens)
    block_size = batch.block_size
    for state, start, num in zip(states, starts, counts, strict=True):
        end = start + num
        known = state.num_tokens + len(state.drafts)
        if num <= 0 or end > known or end > state.num_blocks * block_size:
            raise RuntimeError(
                f"request {state.req_id!r}: cannot compute tokens [{start}, {end}) of "
                f"{known} with {state.num_blocks} blocks of {block_size}"
            )
        state.num_computed_tokens = end
    return states, starts, counts


def _stage_drafts(batch: InputBatch, state: CachedRequestState, computed: int, num: int) -> None:
    """Write a decoding request's drafts after its last known token."""
    num_drafts = len(state.drafts)
    if computed != state.num_tokens - 1 or num != 1 + num_drafts:
        raise RuntimeError(
            f"request {state.req_id!r} has {num_drafts} drafts but is scheduled for {num} "
            f"tokens from {computed} of {state.num_tokens} (drafts need 1 + drafts from the "
            "last known token)"
        )
    if state.num_tokens + num_drafts >= batch.max_model_len:
        raise RuntimeError(
            f"request {state.req_id!r}: {num_drafts} drafts after {state.num_tokens} tokens "
            f"leave no position for the sampled token within max_model_len "
            f"{batch.max_model_len}"
        )
    batch.stage_tokens(state, state.num_tokens, state.drafts)


def build_step_inputs(
    batch: InputBatch,
    states: list[CachedRequestState],
    starts: list[int],
    counts: list[int],
) -> StepInputs:
    """The device inputs of a batch whose diffs were applied."""
    device = batch.device
    num_reqs = len(states)
    num_scheduled = np.asarray(counts, dtype=np.int32)
    start_arr = np.asarray(starts, dtype=np.int32)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    rows = np.fromiter((s.row for s in states), dtype=np.int32, count=num_reqs)
    token_req = np.repeat(np.arange(num_reqs, dtype=np.int32), num_scheduled)
    positions = (
        np.arange(num_tokens, dtype=np.int32) - query_start_loc[token_req] + start_arr[token_req]
    )
    parts = [rows, start_arr + num_scheduled, query_start_loc, positions, rows[token_req]]
    draft_rows = None
    if any(state.drafts for state in states):
        draft_rows = DraftRows.of([state.drafts for state in states])
        # Row j of request i: token qsl[i + 1] - 1 - drafts + j.
        num_drafts = np.diff(draft_rows.row_start) - 1
        last = query_start_loc[1:] - 1 - num_drafts
        parts.append((last[draft_rows.row_request] + draft_rows.row_offset).astype(np.int32))
    packed = np.concatenate(parts)
    host = torch.from_numpy(packed)
    dev = host.to(device, non_blocking=True) if device.type == "cuda" else host
    seq_rows = dev[:num_reqs]
    seq_lens = dev[num_reqs : 2 * num_reqs]
    qsl = dev[2 * num_reqs : 3 * num_reqs + 1]
    positions_dev = dev[3 * num_reqs + 1 : 3 * num_reqs + 1 + num_tokens].long()
    token_rows = dev[3 * num_reqs + 1 + num_tokens : 3 * num_reqs + 1 + 2 * num_tokens].long()
    logits_indices = None
    if draft_rows is not None:
        logits_indices = dev[3 * num_reqs + 1 + 2 * num_tokens :].long()
    input_ids = batch.token_ids[token_rows, positions_dev].long()
    slot_mappings = slots_of(batch, token_rows, positions_dev)
    samples = [
        start + num == state.num_tokens + len(state.drafts)
        for state, start, num in zip(states, starts, counts, strict=True)
    ]
    return StepInputs(
        states=states,
        starts=starts,
        query_start_loc_host=query_start_loc,
        samples=samples,
        num_tokens=num_tokens,
        max_query_len=int(num_scheduled.max()),
        input_ids=input_ids,
        positions=positions_dev,
        slot_mappings=slot_mappings,
        seq_rows=seq_rows,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        draft_rows=draft_rows,
        logits_indices=logits_indices,
    )


def slots_of(
    batch: InputBatch, rows: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The cache slot of the token at ``positions`` of the persistent ``rows``, in each KV-cache
    group (int64 device tensors)."""
    block_size = batch.block_size
    offsets = positions % block_size
    return tuple(
        table[rows, positions // block_size].long() * block_size + offsets
        for table in batch.block_tables
    )
