"""Which keys a query sees, per layer kind, for the torch paths of paged attention (the Triton
kernel computes the same in ``_first_visible``), and the checks of the per-layer arguments.

Causal attention lets the query at position ``p`` see keys ``0 .. p``; a sliding window of ``w``
narrows that to ``p - w + 1 .. p`` (Mistral, Gemma: ``w`` keys, the query's own included), and
chunked local attention of ``chunk`` tokens to ``p // chunk * chunk .. p`` (Llama 4: attention
restarts every ``chunk`` tokens). Both are Hugging Face's masks of the same names.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_attention_options", "first_visible", "first_visible_int"]


def first_visible_int(position: int, window: int | None, chunk: int | None) -> int:
    """The first key position the query at ``position`` sees."""
    start = 0
    if window is not None:
        start = max(start, position - window + 1)
    if chunk is not None:
        start = max(start, position // chunk * chunk)
    return start


def first_visible(positions: torch.Tensor, window: int | None, chunk: int | None) -> torch.Tensor:
    """:func:`first_visible_int` of every query position of ``positions`` (an int tensor)."""
    start = torch.zeros_like(positions)
    if window is not None:
        start = torch.clamp(positions - window + 1, min=0)
    if chunk is not None:
        start = torch.maximum(start, torch.div(positions, chunk, rounding_mode="floor") * chunk)
    return start


def check_attention_options(
    num_heads: int,
    window: int | None,
    chunk: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> None:
    """``ValueError``/``TypeError`` naming the argument that is not a window or chunk of at least
    one token, a positive finite soft cap, or one float sink logit per query head."""
    for name, value in (("window", window), ("chunk", chunk)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int or None, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite number > 0, got {softcap!r}")
    if sinks is not None:
        if not sinks.is_floating_point():
            raise TypeError(f"sinks must be a float tensor, got {sinks.dtype}")
        if tuple(sinks.shape) != (num_heads,):
            raise ValueError(
                f"sinks must hold one logit per query head ({num_heads}), got shape "
                f"{tuple(sinks.shape)}"
            )
