"""Triton kernels and their pure-torch references.

- :mod:`.kv_write`: write new keys and values into their KV-cache slots;
- :mod:`.paged_attention`: attention of a mixed batch (prefill chunks after prefix-cache hits
  and single-token decodes) over the paged KV cache;
- :mod:`.lora`: the multi-LoRA shrink and expand over a batch's adapter segments
  (:mod:`.lora_torch`: their torch reference);
- :mod:`.reference`: the same computations in plain torch, the ground truth for tests.

The Triton modules import ``triton`` and fix their compile mode on import; on the CPU call
``engine_core_cuda._device.prepare_triton`` first (it sets ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import sys

__all__ = ["KERNEL_MODULES", "compiled_variants"]

KERNEL_MODULES = (
    "engine_core_cuda.kernels.activation",
    "engine_core_cuda.kernels.fp8_quant",
    "engine_core_cuda.kernels.fused_moe",
    "engine_core_cuda.kernels.kv_write",
    "engine_core_cuda.kernels.lora",
    "engine_core_cuda.kernels.paged_attention",
    "engine_core_cuda.kernels.rms_norm",
    "engine_core_cuda.kernels.rotary",
    "engine_core_cuda.kernels.sampling",
)
"""The Triton kernel modules (each imports ``triton``, fixing its mode)."""


def compiled_variants() -> dict[str, int]:
    """Compiled variants per Triton kernel of the already imported kernel modules, in this
    process (compiled mode only: the interpreter compiles nothing)."""
    counts: dict[str, int] = {}
    for module_name in KERNEL_MODULES:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name, value in vars(module).items():
            caches = getattr(value, "device_caches", None)
            if isinstance(caches, dict):
                counts[f"{module_name.rsplit('.', 1)[1]}.{name}"] = sum(
                    len(entry[0]) for entry in caches.values()
                )
    return counts
