"""The decoder layer of Gemma 2 and Gemma 3 (text), from the Llama family's parts.

What differs from Llama (the rest is :mod:`engine_core_cuda._layers`):

- the RMSNorm scales by ``1 + weight`` in float32 and rounds once (:class:`GemmaRMSNorm`), and
  so do Gemma 3's per-head q/k norms;
- both blocks are wrapped in norms: ``post_attention_layernorm`` normalizes the attention's
  output before it joins the residual stream, ``pre_feedforward_layernorm`` and
  ``post_feedforward_layernorm`` surround the MLP;
- the MLP gates with gelu-tanh (``config.hidden_act``), the attention scales scores by
  ``query_pre_attn_scalar ** -0.5`` and (Gemma 2) soft-caps them, the layers alternate between
  sliding-window and full attention, and Gemma 3's window layers have a RoPE base of their own: all
  per-layer arguments (:meth:`~engine_core_cuda._hf_config.ModelConfig.layer_attention`).

The model around the layers (:class:`~engine_core_cuda._model.CausalLM`) scales the
embeddings by ``sqrt(hidden_size)`` in the model dtype, ties the LM head to them and soft-caps
the final logits.

The residual stream is carried beside the hidden states as in the Llama layer: a norm that
takes the residual first adds the previous block's output to it, so the layer's output is
``(mlp output, residual)`` and the next layer's input norm completes the sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine_core_cuda._attention import AttentionContext, KVCache
from engine_core_cuda._hf_config import ModelConfig
from engine_core_cuda._kernel_ops import KernelOps
from engine_core_cuda._layer_kinds import LayerAttention
from engine_core_cuda._layers import MLP, Attention, RMSNorm
from engine_core_cuda._rope import RotaryTables

if TYPE_CHECKING:
    from engine_core_cuda._tp.parallel import TensorParallel

__all__ = ["GemmaDecoderLayer", "GemmaRMSNorm"]


class GemmaRMSNorm(RMSNorm):
    """``(1 + weight) * x / rms(x)``, computed in float32 and rounded once (HF's
    ``Gemma2RMSNorm``); the checkpoint's weight is kept as it is."""

    def forward(
        self, x: torch.Tensor, ops: KernelOps, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return ops.gemma_rms_norm(x, self.weight, self.eps), x
        return ops.gemma_add_rms_norm(x, residual, self.weight, self.eps), residual


class GemmaDecoderLayer(nn.Module):
    """Norms around the attention and around the MLP, on the residual stream."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryTables,
        dtype: torch.dtype,
        device: torch.device,
        parallel: TensorParallel | None = None,
        layer: LayerAttention | None = None,
    ) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype, device)
        self.self_attn = Attention(config, rotary, dtype, device, parallel, layer)
        if config.qk_norm:  # Gemma 3
            self.self_attn.q_norm = GemmaRMSNorm(config.head_size, eps, dtype, device)
            self.self_attn.k_norm = GemmaRMSNorm(config.head_size, eps, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype, device)
        self.mlp = MLP(config, dtype, device, parallel)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype, device)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cache: KVCache,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``: the layer's output is their sum."""
        ops = ctx.ops
        h, residual = self.input_layernorm(x, ops, residual)
        h = self.self_attn(positions, h, cache, ctx)
        h = self.post_attention_layernorm(h, ops)[0]
        h, residual = self.pre_feedforward_layernorm(h, ops, residual)
        h = self.mlp(h, ops)
        return self.post_feedforward_layernorm(h, ops)[0], residual
