"""engine-core-cuda: the production backend of engine-core.

Torch model code for decoder-only HF checkpoints (``LlamaForCausalLM``, ``MistralForCausalLM`` with
its sliding window, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma2ForCausalLM``,
``Gemma3ForCausalLM``; the mixture-of-experts ``Qwen3MoeForCausalLM``, ``Qwen2MoeForCausalLM``,
``MixtralForCausalLM``, ``GptOssForCausalLM`` (MXFP4 experts dequantised at load) with a fused MoE
kernel), FP8 weights (FP8 checkpoints, or ``EngineConfig.quantization="fp8"``) and an optional FP8
KV cache, one paged KV-cache tensor sized from free device memory, Triton kernels for writing K/V
and for paged attention over mixed prefill/decode batches (full, sliding-window and chunked-local
layers, soft caps, sinks; ``docs/cuda_kv_groups.md``), on-device sampling, and CUDA graphs for
decode. Use it with ``EngineConfig(backend="cuda", model=<HF directory>)``; the entry point ``cuda``
in the group ``engine_core.backends`` names :data:`engine_core_cuda._provider.provider`, which
imports neither torch nor triton.

With ``backend_options={"device": "cpu"}`` the same code runs on the CPU (torch CPU tensors, Triton
kernels in interpreter mode), which is how CI tests it. The environment variable
``ENGINE_CORE_CUDA_DEVICE`` sets the device used when the options name none (and the device the
provider answers "usable here?" for when it is asked without a config). The dtype is
``EngineConfig.dtype``; ``"auto"`` means bfloat16 on a GPU and float32 on the CPU.

``backend_options`` (unknown names raise ``ValueError``): ``device``, ``kernels``
(``"triton"`` | ``"torch"``), ``cuda_graphs``, ``max_graph_batch_size``, ``kv_cache_bytes``,
``profile_dir``, ``load_format`` (``"safetensors"`` | ``"dummy"``), ``distributed_backend``,
``cpu_threads`` (torch's threads on the CPU: default ``OMP_NUM_THREADS`` when set, else the
usable cores less one), ``kv_offload`` (the host KV tier's ``copy``, ``deadline_s`` and test
``fault``; the tier itself is ``EngineConfig.kv_offload_bytes``: ``docs/cuda_kv_offload.md``);
see :class:`engine_core_cuda._options.CudaOptions`. On the CPU the
decode rows of full-attention float32 layers read K/V in place through a small C kernel built
once per machine (:mod:`engine_core_cuda.kernels.cpu_attention`), float32 RMS norms and rotary
embeddings run through two more (:mod:`engine_core_cuda.kernels.cpu_ops`), and large linear
weights are packed for oneDNN (:func:`engine_core_cuda._layers.pack_cpu_linears`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_core_cuda._backend import CudaBackend

__version__ = "0.1.0"
__all__ = ["CudaBackend"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing the package (as discovery does) does not import torch.
    if name == "CudaBackend":
        from engine_core_cuda._backend import CudaBackend

        return CudaBackend
    raise AttributeError(f"module 'engine_core_cuda' has no attribute {name!r}")
