"""The custom operations of the model, from one implementation chosen once per backend: the
Triton kernels (``"triton"``) or plain torch (``"torch"``: the references, with attention
batched over the decode rows and the KV write, rotary embedding and norms in fewer operations).

Importing the Triton modules fixes their compile mode, so on the CPU call
:func:`engine_core_cuda._device.prepare_triton` before creating ``KernelOps("triton")``.
"""

from __future__ import annotations

from typing import Any, Literal

from engine_core_cuda.kernels import reference
from engine_core_cuda.kernels.moe_torch import fused_moe_torch
from engine_core_cuda.kernels.torch_attention import paged_attention_torch
from engine_core_cuda.kernels.torch_ops import (
    add_gemma_rms_norm_torch,
    add_rms_norm_torch,
    rms_norm_torch,
    rotary_embedding_torch,
    write_kv_torch,
)

__all__ = ["KERNEL_IMPLS", "KernelOps"]

KERNEL_IMPLS = ("triton", "torch")


class KernelOps:
    """``write_kv``, ``paged_attention``, ``rms_norm``, ``add_rms_norm`` (and Gemma's
    ``gemma_rms_norm``, ``gemma_add_rms_norm``), ``rotary_embedding``, ``silu_and_mul`` and
    ``gelu_tanh_and_mul`` with the contracts of :mod:`engine_core_cuda.kernels`, and
    ``fused_moe`` (the experts of a mixture-of-experts block,
    :func:`~engine_core_cuda.kernels.moe_torch.fused_moe_torch`'s contract)."""

    def __init__(self, impl: Literal["triton", "torch"]) -> None:
        if impl not in KERNEL_IMPLS:
            raise ValueError(f"impl must be one of {', '.join(KERNEL_IMPLS)}, got {impl!r}")
        self.impl = impl
        if impl == "triton":
            from engine_core_cuda.kernels.activation import gelu_tanh_and_mul, silu_and_mul
            from engine_core_cuda.kernels.fused_moe import fused_moe
            from engine_core_cuda.kernels.kv_write import write_kv
            from engine_core_cuda.kernels.paged_attention import paged_attention
            from engine_core_cuda.kernels.rms_norm import (
                add_rms_norm,
                gemma_add_rms_norm,
                gemma_rms_norm,
                rms_norm,
            )
            from engine_core_cuda.kernels.rotary import rotary_embedding

            self.write_kv = write_kv
            self.paged_attention: Any = paged_attention
            self.rms_norm = rms_norm
            self.add_rms_norm = add_rms_norm
            self.rotary_embedding = rotary_embedding
            self.silu_and_mul = silu_and_mul
            self.gelu_tanh_and_mul = gelu_tanh_and_mul
            self.gemma_rms_norm = gemma_rms_norm
            self.gemma_add_rms_norm = gemma_add_rms_norm
            self.fused_moe: Any = fused_moe
        else:
            self.write_kv = write_kv_torch
            self.paged_attention = paged_attention_torch
            self.rms_norm = rms_norm_torch
            self.add_rms_norm = add_rms_norm_torch
            self.rotary_embedding = rotary_embedding_torch
            self.silu_and_mul = reference.silu_and_mul_reference
            self.gelu_tanh_and_mul = reference.gelu_tanh_and_mul_reference
            self.gemma_rms_norm = reference.gemma_rms_norm_reference
            self.gemma_add_rms_norm = add_gemma_rms_norm_torch
            self.fused_moe = fused_moe_torch

    @property
    def graph_capturable(self) -> bool:
        """Whether the ops run without host synchronization (the torch attention reads the
        sequence lengths back to the host)."""
        return self.impl == "triton"
