"""The decoder-only causal LM of the Llama family (Llama, Mistral, Qwen2, Qwen3), of its
mixture-of-experts relatives (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss:
:mod:`engine_core_cuda._moe`) and of Gemma 2 and Gemma 3 (text).

The differences between the architectures are flags of :class:`ModelConfig`: QKV bias (Qwen2),
per-head q/k RMSNorm (Qwen3, Gemma 3), tied embeddings, RoPE scaling, each layer's kind of attention
(sliding window: Mistral, Gemma, gpt-oss; attention sinks: gpt-oss) and its RoPE (Gemma 3's window
layers; YaRN: gpt-oss), Gemma's decoder layer (:mod:`engine_core_cuda._gemma`), embedding scale and
final logit soft-cap. Parameter names follow the HF checkpoints except for the fused ``qkv_proj``
and ``gate_up_proj``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine_core_cuda._attention import AttentionContext, KVCache
from engine_core_cuda._gemma import GemmaDecoderLayer, GemmaRMSNorm
from engine_core_cuda._hf_config import ModelConfig, RopeConfig
from engine_core_cuda._layers import DecoderLayer, RMSNorm
from engine_core_cuda._rope import RotaryTables

if TYPE_CHECKING:
    from engine_core_cuda._tp.parallel import TensorParallel

__all__ = ["CausalLM"]


class _Decoder(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        parallel: TensorParallel | None,
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding
        if parallel is None:
            self.embed_tokens = nn.Embedding(
                config.vocab_size, config.hidden_size, dtype=dtype, device=device
            )
        else:
            from engine_core_cuda._tp.embedding import VocabParallelEmbedding

            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, parallel, dtype, device
            )
        self.embed_tokens.weight.requires_grad_(False)
        tables: dict[RopeConfig, RotaryTables] = {}
        for i in range(config.num_layers):
            rope = config.layer_rope(i)
            if rope not in tables:  # layers of one RoPE share its tables
                tables[rope] = RotaryTables(rope, config.head_size, max_positions, dtype, device)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, tables[config.layer_rope(i)], dtype, device, parallel,
                              config.layer_attention(i))
            if config.is_gemma
            else DecoderLayer(config, tables[config.layer_rope(i)], dtype, device, parallel,
                              config.layer_attention(i), moe=config.layer_is_moe(i))
            for i in range(config.num_layers)
        )  # fmt: skip
        norm_cls = GemmaRMSNorm if config.is_gemma else RMSNorm
        self.norm = norm_cls(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.embed_scale: torch.Tensor | None
        scale = None
        if config.is_gemma:  # sqrt(hidden_size) rounded to float32, then to the model dtype, as HF
            scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype).to(device)
        self.register_buffer("embed_scale", scale, persistent=False)


class CausalLM(nn.Module):
    """``forward`` maps a step's tokens to final hidden states (writing their keys and values
    into the cache on the way); ``compute_logits`` maps chosen hidden states to float32 logits.

    With ``parallel`` (tensor parallelism), ``config`` is this rank's shard
    (:func:`engine_core_cuda._tp.shard.shard_model_config`): the embedding and the LM head hold
    a slice of the vocabulary, and every rank gets the gathered logits."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.model = _Decoder(config, max_positions, dtype, device, parallel)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(
                config.hidden_size,
                self.model.embed_tokens.num_embeddings,
                bias=False,
                dtype=dtype,
                device=device,
            )
            self.lm_head.weight.requires_grad_(False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection (the embedding matrix when the embeddings are tied)."""
        return (self.lm_head or self.model.embed_tokens).weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """Hidden states ``[tokens, hidden_size]`` after the final norm."""
        x = self.model.embed_tokens(input_ids)
        if self.model.embed_scale is not None:
            x = x * self.model.embed_scale
        residual = None
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, cache, ctx)
        return self.model.norm(x, ctx.ops, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits ``[rows, vocab_size]`` of hidden states ``[rows, hidden_size]``,
        written into ``out`` (contiguous float32) when given, soft-capped when the model says
        so (``cap * tanh(logits / cap)``, Gemma 2). Under tensor parallelism each rank holds a
        slice of the vocabulary; the slices are gathered."""
        logits = self._logits(hidden, out)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in place: ``out`` holds the result
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def _logits(self, hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        weight = self.lm_head_weight
        if self.parallel is not None:
            logits = torch.nn.functional.linear(hidden, weight).float()
            logits = self.parallel.gather_columns(logits, self.config.vocab_size)
            return logits if out is None else out.copy_(logits)
        if out is None:
            return torch.nn.functional.linear(hidden, weight).float()
        if weight.dtype == torch.float32:
            return torch.matmul(hidden, weight.t(), out=out)
        return out.copy_(torch.nn.functional.linear(hidden, weight))
