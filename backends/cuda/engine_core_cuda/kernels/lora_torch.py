"""The pure-torch reference of the multi-LoRA kernels (:mod:`.lora`): the same contract, over
segments given on the host (``(start, end, slot)`` runs of tokens, slot -1 for the base model),
one pair of matrix products per segment."""

from __future__ import annotations

import torch

__all__ = ["Segment", "lora_expand_torch", "lora_shrink_torch", "segments_of"]

Segment = tuple[int, int, int]
"""``(first token, end token, device slot)``."""


def segments_of(
    seg_start: torch.Tensor, seg_slot: torch.Tensor, num_segments: int
) -> list[Segment]:
    """The host segments of the kernels' segment tensors."""
    starts = seg_start[: num_segments + 1].tolist()
    slots = seg_slot[:num_segments].tolist()
    return [(starts[i], starts[i + 1], slots[i]) for i in range(num_segments)]


def lora_shrink_torch(
    x: torch.Tensor, a: torch.Tensor, y: torch.Tensor, segments: list[Segment]
) -> None:
    """``y[t] = x[t] @ a[slot(t)]^T`` (float32) for the tokens of segments with a slot."""
    for start, end, slot in segments:
        if slot >= 0 and end > start:
            y[start:end] = (x[start:end] @ a[slot].t()).float()


def lora_expand_torch(
    y: torch.Tensor, b: torch.Tensor, out: torch.Tensor, segments: list[Segment]
) -> None:
    """``out[t] += y[t] @ b[slot(t)]^T`` in ``out``'s dtype for the tokens of segments with a
    slot."""
    for start, end, slot in segments:
        if slot >= 0 and end > start:
            rows = out[start:end]
            rows.copy_(rows.float() + y[start:end] @ b[slot].t().float())
