"""Decode attention on the CPU that reads K/V in place from the paged cache: a small C kernel,
compiled once per machine with the system's C compiler and loaded with ``ctypes``.

The batched torch attention (:mod:`engine_core_cuda.kernels.torch_attention`) must first copy every
decode row's blocks out of the cache into a tensor padded to the longest sequence, then run
``scaled_dot_product_attention`` over it with a mask: on the CPU the copy and the padded, masked
attention cost more than the arithmetic. Here each sequence walks its block table and reads its keys
and values where they lie, each token's row whole: one pass of dot products (every query head
against its KV head), the softmax, one pass accumulating the values. float32 only, full attention
only (no window, chunk, soft cap or sinks), one query per sequence: other layers and prefill chunks
keep the torch path.

The kernel is single-threaded; ``ctypes`` releases the GIL for the call, so with more than one
torch thread the sequences are split among that many Python threads. It is built and cached by
:mod:`~engine_core_cuda.kernels.cpu_native`; without a C compiler (or with
``ENGINE_CORE_CPU_ATTENTION=torch``, read at the first call in the process)
:func:`decode_attention_native` is unavailable and the torch path runs.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
from typing import Any

import torch

from engine_core_cuda.kernels import cpu_native

__all__ = ["DISABLE_ENV", "decode_attention_native", "native_available"]

DISABLE_ENV = "ENGINE_CORE_CPU_ATTENTION"
"""Set to ``torch`` to keep the torch path for decode rows on the CPU."""

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+:acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}
/* exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp),
   written so that the loop calling it vectorizes. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (float)(int32_t)(x * 1.44269504088896341f - 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23; float scale; memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}
/* One query per sequence s (items lo..hi-1): q row toks[s] (stride q_stride, heads of d
   floats), keys and values of its first lens[s] positions in the blocks of table row rows[s];
   caches [blocks, block_size, kv_heads, d], each token's row read whole, once per pass. */
int paged_decode_f32(const float *q, int64_t q_stride, const float *kc, const float *vc,
                     const int32_t *table, int64_t table_stride, const int64_t *rows,
                     const int64_t *lens, const int64_t *toks, float *out, int64_t out_stride,
                     int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size,
                     float scale, int64_t lo, int64_t hi) {
    const int64_t group = heads / kv_heads, hd = heads * d, token_stride = kv_heads * d;
    /* Heads are walked per KV head (h = kv_head * group + g): no division in the loops. */
    int64_t longest = 1;
    for (int64_t s = lo; s < hi; s++) if (lens[s] > longest) longest = lens[s];
    float *scores = malloc(sizeof(float) * (size_t)(heads * longest + hd));
    if (scores == NULL) return 1;
    float *acc = scores + heads * longest;
    for (int64_t s = lo; s < hi; s++) {
        const int64_t n = lens[s];
        const int32_t *blocks = table + rows[s] * table_stride;
        const float *qs = q + toks[s] * q_stride;
        float *os = out + toks[s] * out_stride;
        if (n <= 0) { for (int64_t i = 0; i < hd; i++) os[i] = 0.0f; continue; }
        for (int64_t first = 0, b = 0; first < n; first += block_size, b++) {
            const float *k = kc + ((int64_t)blocks[b] * block_size) * token_stride;
            const int64_t m = n - first < block_size ? n - first : block_size;
            for (int64_t j = 0; j < m; j++) {
                const float *kj = k + j * token_stride;
                for (int64_t kh = 0, h = 0; kh < kv_heads; kh++)
                    for (int64_t g = 0; g < group; g++, h++)
                        scores[h * n + first + j] = dot(qs + h * d, kj + kh * d, d) * scale;
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            float *sh = scores + h * n, top = sh[0], total = 0.0f;
            for (int64_t t = 1; t < n; t++) top = sh[t] > top ? sh[t] : top;
#pragma omp simd reduction(+:total)
            for (int64_t t = 0; t < n; t++) { sh[t] = exp_nonpositive(sh[t] - top); total += sh[t]; }
            const float inv = 1.0f / total;
#pragma omp simd
            for (int64_t t = 0; t < n; t++) sh[t] *= inv;
        }
        for (int64_t i = 0; i < hd; i++) acc[i] = 0.0f;
        for (int64_t first = 0, b = 0; first < n; first += block_size, b++) {
            const float *v = vc + ((int64_t)blocks[b] * block_size) * token_stride;
            const int64_t m = n - first < block_size ? n - first : block_size;
            for (int64_t j = 0; j < m; j++) {
                const float *vj = v + j * token_stride;
                for (int64_t kh = 0, h = 0; kh < kv_heads; kh++) {
                    const float *restrict vh = vj + kh * d;
                    for (int64_t g = 0; g < group; g++, h++) {
                        const float p = scores[h * n + first + j];
                        float *restrict a = acc + h * d;
#pragma omp simd
                        for (int64_t i = 0; i < d; i++) a[i] += p * vh[i];
                    }
                }
            }
        }
        memcpy(os, acc, sizeof(float) * (size_t)hd);
    }
    free(scores);
    return 0;
}
"""

_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "paged_decode_f32": (
        [_P, _I, _P, _P, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _I, _I],
        ctypes.c_int,
    ),
}

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_loaded: ctypes.CDLL | None = None
_resolved = False


def _library() -> ctypes.CDLL | None:
    """The kernel's library, or None; resolved once per process (``ENGINE_CORE_CPU_ATTENTION``
    is read then: a decode step asks once per layer)."""
    global _loaded, _resolved
    if not _resolved:
        if os.environ.get(DISABLE_ENV, "").lower() != "torch":
            _loaded = cpu_native.load("paged_decode", _SOURCE, _SIGNATURES)
        _resolved = True
    return _loaded


def native_available() -> bool:
    """Whether the native decode kernel can run here (built, or loaded from the cache, once
    per process)."""
    return _library() is not None


def _workers(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool._max_workers < threads:  # noqa: SLF001
        _pool = concurrent.futures.ThreadPoolExecutor(threads, "engine-core-cpu-attention")
    return _pool


def decode_attention_native(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    tokens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> bool:
    """Attention of the decode query ``q[tokens[i]]`` (``q``: ``[T, heads, D]``) over the
    first ``lens[i]`` keys of block-table row ``rows[i]``, written to ``out[tokens[i]]``.
    Returns False (nothing written) when the inputs are not what the kernel takes (float32,
    inner dimensions contiguous, an int32 table) or it is unavailable."""
    library = _library()
    if library is None:
        return False
    heads, head_size = q.shape[1], q.shape[2]
    kv_heads = key_cache.shape[2]
    if not (
        q.dtype == key_cache.dtype == value_cache.dtype == out.dtype == torch.float32
        and q.device.type == "cpu"
        and block_table.dtype == torch.int32
        and q.stride(2) == 1
        and q.stride(1) == head_size
        and out.stride(2) == 1
        and out.stride(1) == head_size
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and block_table.stride(1) == 1
        and heads % kv_heads == 0
    ):
        return False
    rows = rows.to(torch.int64).contiguous()
    lens = lens.to(torch.int64).contiguous()
    tokens = tokens.to(torch.int64).contiguous()
    items = rows.shape[0]
    function = library.paged_decode_f32
    fixed = (
        q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
        block_table.data_ptr(), block_table.stride(0), rows.data_ptr(), lens.data_ptr(),
        tokens.data_ptr(), out.data_ptr(), out.stride(0), heads, kv_heads, head_size,
        key_cache.shape[1], scale,
    )  # fmt: skip
    threads = min(torch.get_num_threads(), items)
    if threads <= 1:
        failed = function(*fixed, 0, items)
    else:
        bounds = [items * i // threads for i in range(threads + 1)]
        futures = [
            _workers(threads).submit(function, *fixed, lo, hi)
            for lo, hi in zip(bounds, bounds[1:], strict=False)
        ]
        failed = sum(f.result() for f in futures)
    if failed:
        raise MemoryError("CPU decode attention: out of memory for its scores")
    return True
