"""The building blocks of a Llama-family decoder layer: RMSNorm, attention with fused QKV projection
(optional bias, per-head q/k norm and attention sinks) of a layer's kind (full, sliding window,
chunked local: :class:`~engine_core_cuda._layer_kinds.LayerAttention`), and the fused gate/up SwiGLU
(or GeGLU) MLP.

Parameters are created empty on the target device; :mod:`engine_core_cuda._loader` fills them.
Fused weights are loaded shard by shard (``q``, ``k``, ``v`` into ``qkv_proj``; ``gate``, ``up``
into ``gate_up_proj``), so one matrix multiplication replaces three (or two). The elementwise
work (norms, rotary embedding, activation) runs through the step's
:class:`~engine_core_cuda._kernel_ops.KernelOps`.

The residual stream is carried beside the hidden states, as in vLLM: each norm first adds the
previous block's output to the residual (``x + block(norm(x))`` of HF, reassociated without
changing the arithmetic), which lets one kernel do the add and the norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine_core_cuda._attention import AttentionContext, KVCache
from engine_core_cuda._hf_config import ModelConfig
from engine_core_cuda._kernel_ops import KernelOps
from engine_core_cuda._layer_kinds import LayerAttention
from engine_core_cuda._rope import RotaryTables

if TYPE_CHECKING:
    from engine_core_cuda._lora import LoRALinear
    from engine_core_cuda._tp.parallel import TensorParallel

__all__ = [
    "Attention",
    "DecoderLayer",
    "Linear",
    "MLP",
    "RMSNorm",
    "pack_cpu_linears",
    "unpack_cpu_linears",
]


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` made of named row shards (e.g. ``q``, ``k``, ``v``)."""

    def __init__(
        self,
        in_features: int,
        shards: dict[str, int],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.reduce = reduce
        """Row parallelism: sums the ranks' partial products; the bias is added once after."""
        out_features = sum(shards.values())
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.weight_scale: nn.Parameter | None = None
        """FP8 weights (:mod:`engine_core_cuda._fp8`): one float32 scale per output row."""
        self.shards: dict[str, tuple[int, int]] = {}
        """Shard name -> (first row, number of rows)."""
        self.packed: torch.Tensor | None = None
        """On the CPU: the weight reordered once for oneDNN (:func:`pack_cpu_linears`)."""
        self.lora: LoRALinear | None = None
        """Multi-LoRA: the adapters' device slots of this projection
        (:mod:`engine_core_cuda._lora`), whose low-rank products are added to the output (before a
        row-parallel reduce: each rank's share of ``lora_A`` gives a partial sum)."""
        start = 0
        for name, size in shards.items():
            self.shards[name] = (start, size)
            start += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.reduce is None else None
        if self.weight_scale is not None:
            from engine_core_cuda._fp8 import fp8_linear

            y = fp8_linear(x, self.weight, self.weight_scale, bias)
        elif self.packed is not None and (
            self.packed.dtype != torch.float32
            or PACKED_ROWS[0] <= x.numel() // x.shape[-1] <= PACKED_ROWS[1]
        ):
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, bias)
        if self.lora is not None:
            self.lora.add_to(x, y)
        if self.reduce is None:
            return y
        y = self.reduce(y)
        return y if self.bias is None else y + self.bias


PACK_MIN_ELEMENTS = 512 * 512
"""The smallest float32 weight worth a packed copy: a packed product costs ~20 us more to set
up than ``F.linear``'s, which only a large product's faster reads pay back (measured on one
AVX2 thread: 0.63-0.9x ``F.linear``'s time at 2-16 rows for 512 x 512 and larger weights,
3-8x slower for 64 x 64 to 64 x 384)."""

PACKED_ROWS = (2, 64)
"""The row counts a packed float32 weight multiplies: one row is a matrix-vector product, where
``F.linear`` is 1.2-2x faster; past 64 rows (prefill chunks) the two are within a few percent
and ``F.linear`` is kept."""


def pack_cpu_linears(
    modules: list[nn.Module], batch_size: int, min_elements: int | None = None
) -> int:
    """Reorder the float32 / bfloat16 CPU weights of every :class:`Linear` under ``modules``
    once, after loading, into oneDNN's blocked layout (as vLLM's CPU backend does): a decode
    step's ``[rows, in] x [in, out]`` products then read the weights in the order the kernel
    consumes them, 1.1-1.6x faster than ``F.linear`` at 2-16 rows on one thread. The products
    round differently from ``F.linear`` (float32 sums in another order). ``batch_size`` is the
    row count the layout is chosen for. A packed copy is kept beside the weight (which stays for
    everything else that reads it); float32 weights of fewer than ``min_elements`` (default
    :data:`PACK_MIN_ELEMENTS`) stay unpacked, and a packed float32 weight serves only
    :data:`PACKED_ROWS` (``F.linear`` the rest). Returns how many were packed; none when oneDNN
    is unavailable or ``ENGINE_CORE_CPU_LINEAR=torch``. bfloat16 weights are packed only where
    oneDNN has a bfloat16 path on this CPU (AVX512-BW/VL/DQ or AVX-NE-CONVERT): on an AVX2-only
    CPU the reorder raises, so those stay on ``F.linear``."""
    import os

    if (
        os.environ.get("ENGINE_CORE_CPU_LINEAR") == "torch"
        or not torch.backends.mkldnn.is_available()
    ):
        return 0
    dtypes = (torch.float32, torch.bfloat16) if cpu_bf16_packing() else (torch.float32,)
    if min_elements is None:
        min_elements = PACK_MIN_ELEMENTS
    packed = 0
    for root in modules:
        for module in root.modules():
            w = getattr(module, "weight", None)
            if (
                isinstance(module, Linear)
                and module.weight_scale is None
                and w is not None
                and w.device.type == "cpu"
                and w.dtype in dtypes
                and (w.dtype != torch.float32 or w.numel() >= min_elements)
            ):
                module.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_size)
                packed += 1
    return packed


def cpu_bf16_packing() -> bool:
    """Whether oneDNN can reorder and multiply bfloat16 weights on this CPU."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def unpack_cpu_linears(modules: list[nn.Module]) -> None:
    """Drop the packed copies (weights freed or about to be reloaded)."""
    for root in modules:
        for module in root.modules():
            if isinstance(module, Linear):
                module.packed = None


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32 and rounded as HF Llama does."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(size, dtype=dtype, device=device), requires_grad=False
        )
        self.eps = eps

    def forward(
        self, x: torch.Tensor, ops: KernelOps, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``; without a residual, ``(norm(x), x)``. The
        residual is updated in place."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps), x
        return ops.add_rms_norm(x, residual, self.weight, self.eps), residual


class Attention(nn.Module):
    """Self-attention over the paged KV cache, of the kind ``layer`` (default: full attention
    scaled by ``head_size ** -0.5``), through the block table of KV-cache group ``kv_group``."""

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
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_size = config.head_size
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.layer = layer if layer is not None else LayerAttention(scale=config.head_size**-0.5)
        self.kv_group = 0
        """Set by the model runner from the cache's layout (:mod:`engine_core_cuda._kv_layout`)."""
        self.kv_scales = (1.0, 1.0)
        """An FP8 KV cache's per-tensor (key, value) scales: the checkpoint's ``k_scale`` and
        ``v_scale`` when it has them."""
        self.rotary = rotary
        self.qkv_proj = Linear(
            config.hidden_size,
            {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=config.qkv_bias,
            dtype=dtype,
            device=device,
        )
        self.o_proj = Linear(
            self.q_size,
            {"o": config.hidden_size},
            bias=config.o_bias,
            dtype=dtype,
            device=device,
            reduce=parallel.all_reduce if parallel is not None else None,
        )
        self.sinks: nn.Parameter | None = None
        """gpt-oss: one learned logit per query head in the softmax's denominator."""
        if config.attention_sinks:
            self.sinks = nn.Parameter(
                torch.empty(self.num_heads, dtype=dtype, device=device), requires_grad=False
            )
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_size, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_size, config.rms_norm_eps, dtype, device)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, cache: KVCache, ctx: AttentionContext
    ) -> torch.Tensor:
        ops = ctx.ops
        num_tokens = x.shape[0]
        # Views into the projection: the kernels take strided heads, nothing is copied.
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_size), ops)[0].view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_size), ops)[0].view(k.shape)
        ops.rotary_embedding(positions, q, k, self.rotary.cos, self.rotary.sin)
        ctx.write_kv(k, v, cache, self.kv_group, self.kv_scales)
        out = ctx.attend(q, cache, self.layer, self.kv_group, self.sinks, self.kv_scales)
        return self.o_proj(out.view(num_tokens, self.q_size))


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up in one matrix; ``act`` is silu, or
    gelu-tanh (``config.hidden_act == "gelu_pytorch_tanh"``). ``intermediate_size`` defaults
    to the config's (a MoE model's shared expert has its own)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        parallel: TensorParallel | None = None,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size,
            {"gate": size, "up": size},
            bias=config.mlp_bias,
            dtype=dtype,
            device=device,
        )
        self.down_proj = Linear(
            size,
            {"down": config.hidden_size},
            bias=config.mlp_bias,
            dtype=dtype,
            device=device,
            reduce=parallel.all_reduce if parallel is not None else None,
        )

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        act = ops.gelu_tanh_and_mul if self.gelu else ops.silu_and_mul
        return self.down_proj(act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks on the residual stream; with ``moe`` the MLP is the
    sparse mixture-of-experts block (:class:`~engine_core_cuda._moe.SparseMoeBlock`)."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryTables,
        dtype: torch.dtype,
        device: torch.device,
        parallel: TensorParallel | None = None,
        layer: LayerAttention | None = None,
        moe: bool = False,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, rotary, dtype, device, parallel, layer)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, device
        )
        self.mlp: nn.Module
        if moe:
            from engine_core_cuda._moe import SparseMoeBlock

            self.mlp = SparseMoeBlock(config, dtype, device, parallel)
        else:
            self.mlp = MLP(config, dtype, device, parallel)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cache: KVCache,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``: the layer's output is their sum."""
        h, residual = self.input_layernorm(x, ctx.ops, residual)
        h = self.self_attn(positions, h, cache, ctx)
        h, residual = self.post_attention_layernorm(h, ctx.ops, residual)
        return self.mlp(h, ctx.ops), residual
