"""Triton kernels and their pure-torch references.

- :mod:`.kv_write`: write new keys and values into their KV-cache slots;
- :mod:`.paged_attention`: attention of a mixed batch (prefill chunks after prefix-cache hits
  and single-token decodes) over the paged KV cache;
- :mod:`.reference`: the same computations in plain torch, the ground truth for tests.

The Triton modules import ``triton`` and fix their compile mode on import; on the CPU call
``engine_core_cuda._device.prepare_triton`` first (it sets ``TRITON_INTERPRET=1``).
"""
