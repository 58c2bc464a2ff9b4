"""The sparse mixture-of-experts block (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss) that replaces a
decoder layer's MLP in the layers :attr:`~engine_core_cuda._moe_config.MoeConfig.sparse_layers`.

A router (``gate``: a ``[experts, hidden]`` matrix, no bias) scores every expert for each token
and keeps the ``top_k`` best (:func:`~engine_core_cuda.kernels.moe_torch.route_topk`); the
experts' weights are stacked (``w13``: each expert's gate and up rows, ``w2``: its down matrix)
so one fused kernel (:meth:`KernelOps.fused_moe`) computes every token's weighted sum of its
experts' SwiGLU MLPs. Qwen2-MoE adds a shared expert, an ordinary MLP scaled by
``sigmoid(shared_expert_gate(x))``.

Checkpoints name the experts one by one (``…mlp.experts.E.gate_proj.weight``, Mixtral's
``…block_sparse_moe.experts.E.w1.weight``); :meth:`SparseMoeBlock.checkpoint_targets` maps each
name into its slot of the stacked weights for the loader. gpt-oss stores them stacked
(``…mlp.experts.gate_up_proj`` ``[experts, hidden, 2 * inter]``, gate and up interleaved column
by column, ``…down_proj`` ``[experts, inter, hidden]``, each with a ``_bias``; its router is
``…mlp.router``): :meth:`SparseMoeBlock.stacked_loaders` rearranges them into ``w13``/``w2``
(quantised per row as they are stored when the experts hold FP8, ``quantization="fp8"``).

Under tensor parallelism every rank holds every expert with a slice of its intermediate
dimension (and of the shared expert's): the partial outputs are summed by one all-reduce at the
end of the block (gpt-oss's down-projection bias is held by rank 0 alone, so it is added once:
:func:`~engine_core_cuda._tp.shard.stacked_expert_part`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine_core_cuda._fp8 import FP8_DTYPE, quantize_rows
from engine_core_cuda._hf_config import ModelConfig
from engine_core_cuda._kernel_ops import KernelOps
from engine_core_cuda._layers import MLP
from engine_core_cuda._tp.shard import stacked_expert_part
from engine_core_cuda.kernels.moe_torch import route_topk

if TYPE_CHECKING:
    from engine_core_cuda._tp.parallel import TensorParallel
    from engine_core_cuda._tp.shard import StackedPart

__all__ = ["Experts", "Router", "SparseMoeBlock"]

Target = tuple[torch.Tensor, int, int]
"""A checkpoint tensor's destination: (tensor, first row, number of rows)."""


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Router(nn.Module):
    """``logits = x W^T`` over the experts, then top-k (softmax or sigmoid scores, optionally
    renormalised)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        assert config.moe is not None
        self.moe = config.moe
        self.weight = _param(config.moe.num_experts, config.hidden_size, dtype=dtype, device=device)
        self.bias = (
            _param(config.moe.num_experts, dtype=dtype, device=device)
            if config.moe.router_bias
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [tokens, top_k] in x's dtype, expert ids [tokens, top_k])``."""
        moe = self.moe
        return route_topk(F.linear(x, self.weight, self.bias), moe.top_k, scoring=moe.scoring,
                          renormalize=moe.renormalize, out_dtype=x.dtype)  # fmt: skip


class Experts(nn.Module):
    """The routed experts' stacked weights: ``w13`` ``[experts, 2 * inter, hidden]`` (gate rows,
    then up rows) and ``w2`` ``[experts, hidden, inter]``; FP8 weights carry per-output-channel
    scales ``w13_scale``, ``w2_scale`` (None otherwise)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        assert config.moe is not None
        e, inter, hidden = config.moe.num_experts, config.moe.intermediate_size, config.hidden_size
        self.intermediate_size = inter
        self.w13 = _param(e, 2 * inter, hidden, dtype=dtype, device=device)
        self.w2 = _param(e, hidden, inter, dtype=dtype, device=device)
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None
        self.b13: nn.Parameter | None = None
        """gpt-oss: the gate and up projections' biases ``[experts, 2 * inter]`` (None: none)."""
        self.b2: nn.Parameter | None = None
        """gpt-oss: the down projection's bias ``[experts, hidden]``."""
        if config.moe.stacked:
            self.b13 = _param(e, 2 * inter, dtype=dtype, device=device)
            self.b2 = _param(e, hidden, dtype=dtype, device=device)


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"model: weight {name!r} has shape {tuple(tensor.shape)} after rearranging, "
            f"expected {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)


def _store(experts: Experts, attr: str, tensor: torch.Tensor, name: str) -> None:
    """``tensor`` into the experts' matrix ``attr`` (``w13``, ``w2``): FP8 storage
    (``quantization="fp8"``) gets it quantised per row, with its scales."""
    param = getattr(experts, attr)
    if param.dtype == FP8_DTYPE:
        scale = getattr(experts, f"{attr}_scale")
        assert scale is not None
        tensor, rows = quantize_rows(tensor)
        _copy(scale, rows, f"{name} (its per-row scales)")
    _copy(param, tensor, name)


def _deinterleave(tensor: torch.Tensor) -> torch.Tensor:
    """Rows (dim 1) ``g0, u0, g1, u1, …`` -> ``g0, g1, …, u0, u1, …``."""
    return torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)


def _interleave(tensor: torch.Tensor) -> torch.Tensor:
    """Rows (dim 1) ``g0, g1, …, u0, u1, …`` -> ``g0, u0, g1, u1, …`` (a new tensor)."""
    gate, up = tensor.chunk(2, dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) the gated shared expert."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        assert config.moe is not None
        self.moe = config.moe
        self.activation = config.moe.activation or config.hidden_act
        self.gate = Router(config, dtype, device)
        self.experts = Experts(config, dtype, device)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if self.moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(
                config, dtype, device, intermediate_size=self.moe.shared_expert_intermediate_size
            )
            self.shared_expert_gate = nn.Linear(
                config.hidden_size, 1, bias=False, dtype=dtype, device=device
            )
            self.shared_expert_gate.weight.requires_grad_(False)
        self.reduce = parallel.all_reduce if parallel is not None else None
        self.rank, self.size = (parallel.rank, parallel.size) if parallel is not None else (0, 1)

    def checkpoint_targets(self, name: str) -> dict[str, Target]:
        """Checkpoint tensor names -> destinations for the router and the routed experts of the
        block called ``name`` in the model (the shared expert's Linear layers map themselves)."""
        parent = f"{name.rpartition('.')[0]}.{self.moe.prefix}"
        router = f"{parent}.router" if self.moe.stacked else f"{parent}.gate"
        targets: dict[str, Target] = {
            f"{router}.weight": (self.gate.weight, 0, self.moe.num_experts)
        }
        if self.gate.bias is not None:
            targets[f"{router}.bias"] = (self.gate.bias, 0, self.moe.num_experts)
        if self.moe.stacked:
            return targets
        gate, up, down = self.moe.weight_names
        inter = self.experts.intermediate_size
        w13, w2 = self.experts.w13, self.experts.w2
        for e in range(self.moe.num_experts):
            prefix = f"{parent}.experts.{e}"
            targets[f"{prefix}.{gate}.weight"] = (w13[e], 0, inter)
            targets[f"{prefix}.{up}.weight"] = (w13[e], inter, inter)
            targets[f"{prefix}.{down}.weight"] = (w2[e], 0, w2.shape[1])
            s13, s2 = self.experts.w13_scale, self.experts.w2_scale
            if s13 is not None and s2 is not None:  # FP8 experts: per-row scales
                targets[f"{prefix}.{gate}.weight_scale"] = (s13[e], 0, inter)
                targets[f"{prefix}.{up}.weight_scale"] = (s13[e], inter, inter)
                targets[f"{prefix}.{down}.weight_scale"] = (s2[e], 0, s2.shape[1])
        return targets

    def stacked_loaders(self, name: str) -> dict[str, Callable[[torch.Tensor], None]]:
        """gpt-oss: checkpoint names of the stacked experts (as transformers' ``GptOssExperts``
        holds them) -> functions copying such a tensor (whole: under tensor parallelism they keep
        this rank's part) into ``w13``, ``b13``, ``w2``, ``b2`` (empty for the experts of other
        architectures)."""
        if not self.moe.stacked:
            return {}
        ex = self.experts
        assert ex.b13 is not None and ex.b2 is not None
        b13, b2 = ex.b13, ex.b2
        rank, size = self.rank, self.size
        parent = f"{name.rpartition('.')[0]}.{self.moe.prefix}.experts"
        gate_up, down = f"{parent}.gate_up_proj", f"{parent}.down_proj"

        def part(kind: StackedPart, tensor: torch.Tensor) -> torch.Tensor:
            return stacked_expert_part(kind, tensor, rank, size)

        return {
            gate_up: lambda t: _store(
                ex, "w13", _deinterleave(part("gate_up_proj", t).transpose(1, 2)), gate_up
            ),
            f"{gate_up}_bias": lambda t: _copy(
                b13, _deinterleave(part("gate_up_proj_bias", t)), f"{gate_up}_bias"
            ),
            down: lambda t: _store(ex, "w2", part("down_proj", t).transpose(1, 2), down),
            f"{down}_bias": lambda t: _copy(b2, part("down_proj_bias", t), f"{down}_bias"),
        }

    def stacked_checkpoint(self, name: str) -> dict[str, torch.Tensor]:
        """gpt-oss: the stacked experts in the checkpoint's layout (copies; the inverse of
        :meth:`stacked_loaders` for an unsharded block in the model dtype), under their
        checkpoint names."""
        if not self.moe.stacked:
            return {}
        ex = self.experts
        assert ex.b13 is not None and ex.b2 is not None
        parent = f"{name.rpartition('.')[0]}.{self.moe.prefix}.experts"
        return {
            f"{parent}.gate_up_proj": _interleave(ex.w13.detach()).transpose(1, 2).contiguous(),
            f"{parent}.gate_up_proj_bias": _interleave(ex.b13.detach()),
            f"{parent}.down_proj": ex.w2.detach().transpose(1, 2).contiguous(),
            f"{parent}.down_proj_bias": ex.b2.detach().clone(),
        }

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        weights, ids = self.gate(x)
        ex, moe = self.experts, self.moe
        out = ops.fused_moe(x, ex.w13, ex.w2, weights, ids, self.activation, ex.w13_scale,
                            ex.w2_scale, b13=ex.b13, b2=ex.b2, swiglu_alpha=moe.swiglu_alpha,
                            swiglu_limit=moe.swiglu_limit)  # fmt: skip
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x, ops)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out if self.reduce is None else self.reduce(out)
