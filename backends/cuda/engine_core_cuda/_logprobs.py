"""Logprobs of sampled tokens and of prompt tokens, as :class:`TokenLogprobs`.

Prompt position ``p`` is scored by the logits of position ``p - 1``. When a prompt is prefilled
in chunks, the first position of the next chunk is scored with the last logits of this one; its
entry is held back and reported with the chunk that computes that position, so each step reports
exactly the prompt positions it computed. Position 0 has no entry (None), nor has the first
computed position after a prefix-cache hit (its logits were never computed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine_core.abc import TokenLogprobs
from engine_core_cuda._input_batch import CachedRequestState, InputBatch
from engine_core_cuda._sampler import LogprobsTensors, compute_logprobs

__all__ = ["PROMPT_LOGPROBS_CHUNK", "prompt_logprobs", "to_token_logprobs"]

PROMPT_LOGPROBS_CHUNK = 512
"""Prompt positions scored at once (bounds the ``[rows, vocab]`` float32 temporaries)."""


def to_token_logprobs(
    tensors: LogprobsTensors, token_ids: list[int], num_tops: list[int]
) -> list[TokenLogprobs]:
    """One entry per row: the row's token first, then its top ``num_tops[i]``."""
    logprobs = tensors.token_logprobs.tolist()
    ranks = tensors.token_ranks.tolist()
    top_ids = tensors.top_ids.tolist()
    top_logprobs = tensors.top_logprobs.tolist()
    return [
        TokenLogprobs(
            [token, *top_ids[i][:k]],
            [logprobs[i], *top_logprobs[i][:k]],
            [ranks[i], *range(1, k + 1)],
        )
        for i, (token, k) in enumerate(zip(token_ids, num_tops, strict=True))
    ]


def prompt_logprobs(
    batch: InputBatch,
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    entries: list[tuple[CachedRequestState, int, int, int]],
) -> dict[str, list[TokenLogprobs | None]]:
    """Prompt logprobs of this step. ``entries``: (request, ``num_computed_tokens`` before the
    step, tokens scheduled, offset of its first token in ``hidden``) for each request that asked
    for them and computed prompt positions this step."""
    flat_index: list[int] = []
    rows: list[int] = []
    targets: list[int] = []
    num_tops: list[int] = []
    spans: list[tuple[CachedRequestState, int, int, int, int]] = []
    for state, start, num, offset in entries:
        num_prompt = state.num_prompt_tokens
        end = min(start + num, num_prompt)
        # Logits of positions [start, last) score positions [start + 1, last + 1).
        last = min(start + num, num_prompt - 1)
        first_row = len(flat_index)
        for q in range(start, last):
            flat_index.append(offset + q - start)
            rows.append(state.row)
            targets.append(q + 1)
        num_tops.extend([state.num_prompt_logprobs or 0] * max(0, last - start))
        spans.append((state, start, end, first_row, len(flat_index)))
    scored = _score(batch, hidden, compute_logits, flat_index, rows, targets, num_tops)
    found: dict[str, list[TokenLogprobs | None]] = {}
    for state, start, end, first_row, last_row in spans:
        computed = scored[first_row:last_row]  # positions start + 1, start + 2, ...
        held = state.pending_prompt_logprobs
        head: TokenLogprobs | None = None if start == 0 else held
        result: list[TokenLogprobs | None] = [head, *computed[: end - start - 1]]
        state.pending_prompt_logprobs = (
            computed[end - start - 1] if len(computed) >= end - start else None
        )
        found[state.req_id] = result
    return found


def _score(
    batch: InputBatch,
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    flat_index: list[int],
    rows: list[int],
    targets: list[int],
    num_tops: list[int],
) -> list[TokenLogprobs]:
    if not flat_index:
        return []
    device = hidden.device
    index = torch.tensor(flat_index, dtype=torch.int64).to(device)
    target_ids = batch.token_ids[
        torch.tensor(rows, dtype=torch.int64).to(device),
        torch.tensor(targets, dtype=torch.int64).to(device),
    ].long()
    max_top = max(num_tops)
    scored: list[TokenLogprobs] = []
    for chunk in range(0, len(flat_index), PROMPT_LOGPROBS_CHUNK):
        stop = chunk + PROMPT_LOGPROBS_CHUNK
        logits = compute_logits(hidden[index[chunk:stop]])
        tokens = target_ids[chunk:stop]
        tensors = compute_logprobs(logits, tokens, max_top)
        scored.extend(to_token_logprobs(tensors, tokens.tolist(), num_tops[chunk:stop]))
    return scored
