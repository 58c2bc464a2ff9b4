"""Mixture-of-experts in plain torch: the router's top-k and the experts' computation, the
ground truth of the fused Triton kernel (:mod:`engine_core_cuda.kernels.fused_moe`) and the
``"torch"`` kernels' implementation.

Expert weights are stacked: ``w13`` ``[experts, 2 * inter, hidden]`` (each expert's gate rows,
then its up rows, as ``nn.Linear`` weights) and ``w2`` ``[experts, hidden, inter]``. Optional
per-output-channel scales (``w13_scale`` ``[experts, 2 * inter]``, ``w2_scale``
``[experts, hidden]``) multiply the products of FP8 weights; optional biases (gpt-oss) are
added to the projections.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "SWIGLU_ALPHA", "SWIGLU_LIMIT", "fused_moe_torch", "route_topk"]

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "swigluoai")
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def route_topk(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [tokens, top_k], expert ids [tokens, top_k] int64)`` from router logits
    ``[tokens, experts]``: scores in float32 (softmax over the experts, or a sigmoid each), the
    ``top_k`` highest, divided by their sum when ``renormalize``, cast to ``out_dtype``
    (default: the logits' dtype)."""
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits.float())
    else:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype or logits.dtype), ids


def _gated(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float,
           limit: float) -> torch.Tensor:  # fmt: skip
    """``act(gate) * up``; gpt-oss's ``"swigluoai"``: ``(clamp(up, ±limit) + 1) * g *
    sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swigluoai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")


def _weight(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """One expert's weight in ``dtype`` (FP8 weights times their per-row scales)."""
    if scale is None:
        return w if w.dtype == dtype else w.to(dtype)
    return (w.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


def fused_moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))`` over each token's
    experts ``e = topk_ids[t, j]``, ``[tokens, hidden]`` in ``x``'s dtype: one loop iteration
    per expert that some token chose (as transformers computes it). ``b13`` ``[experts, 2 *
    inter]`` and ``b2`` ``[experts, hidden]`` are the projections' biases (gpt-oss);
    ``swiglu_alpha``/``swiglu_limit`` parametrise ``"swigluoai"``."""
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    inter = w2.shape[2]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // topk_ids.shape[1]
        h = F.linear(x[tokens], _weight(w13[expert], _row(w13_scale, expert), x.dtype),
                     _row(b13, expert))  # fmt: skip
        h = _gated(h[:, :inter], h[:, inter:], activation, swiglu_alpha, swiglu_limit)
        h = F.linear(h, _weight(w2[expert], _row(w2_scale, expert), x.dtype), _row(b2, expert))
        h = h * topk_weights.reshape(-1)[pairs, None].to(h.dtype)
        out.index_add_(0, tokens, h)
    return out


def _row(scale: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if scale is None else scale[expert]
