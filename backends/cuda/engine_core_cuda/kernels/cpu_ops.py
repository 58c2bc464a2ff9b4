"""RMS norm (with the residual add fused) and rotary embedding on the CPU, float32: one small C
kernel each, built by :mod:`~engine_core_cuda.kernels.cpu_native`.

A decode step of a small model is made of many small tensor operations, each costing torch a
few microseconds to dispatch whatever its size: ``F.rms_norm`` takes ~16 us for one row of 64,
the rotary embedding (an index of each table, a concatenation, three products and a copy)
~40 us. Here each is one pass over the rows in one call (~5 us with the ``ctypes`` call).
Compiled without fused multiply-adds, the rotation is bit-equal to the torch path; the norm
rounds like it up to the order of its float32 sum of squares.

Each kernel is single-threaded: with more than one torch thread, inputs of more than
:data:`SINGLE_THREAD_ELEMENTS` elements (prefill chunks) keep the torch path, which spreads over
the threads. The functions return None / False (nothing done) for what they do not take: not
float32, not on the CPU, not laid out as the kernel reads it, or the kernels unavailable (no C
compiler, or ``ENGINE_CORE_CPU_OPS=torch`` when first called).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from engine_core_cuda.kernels import cpu_native

__all__ = ["DISABLE_ENV", "SINGLE_THREAD_ELEMENTS", "available", "rms_norm", "rotary"]

DISABLE_ENV = "ENGINE_CORE_CPU_OPS"
"""Set to ``torch`` to keep the torch path for RMS norm and rotary embedding on the CPU."""

SINGLE_THREAD_ELEMENTS = 1 << 16
"""With more than one torch thread, the largest input the single-threaded kernels take."""

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
/* Each of rows rows of n floats: x' = x (+ residual, written back to the residual), then
   out = x' / sqrt(mean(x'^2) + eps) * w. */
void rms_norm_f32(const float *x, int64_t x_stride, float *residual, int64_t residual_stride,
                  const float *w, float *out, int64_t out_stride, int64_t rows, int64_t n,
                  float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *src = x + r * x_stride;
        float *o = out + r * out_stride;
        if (residual != 0) {
            float *res = residual + r * residual_stride;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) res[i] += src[i];
            src = res;
        }
        float acc = 0.0f;
#pragma omp simd reduction(+:acc)
        for (int64_t i = 0; i < n; i++) acc += src[i] * src[i];
        const float inv = 1.0f / sqrtf(acc / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = src[i] * inv * w[i];
    }
}
static inline void rotate(float *x, const float *c, const float *s, int64_t half) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i + half] + x1 * s[i + half];
    }
}
/* Rotate token t's q heads and k heads in place by the rows positions[t] of the tables
   (rows of 2 * half floats: HF's rotate_half convention). Returns 1 for a position outside
   the tables (nothing of that token written). */
int rotary_f32(const int64_t *positions, int64_t tokens, float *q, int64_t q_token,
               int64_t q_head, int64_t q_heads, float *k, int64_t k_token, int64_t k_head,
               int64_t k_heads, const float *cos_t, const float *sin_t, int64_t table_stride,
               int64_t table_rows, int64_t half) {
    int failed = 0;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t p = positions[t];
        if (p < 0 || p >= table_rows) { failed = 1; continue; }
        const float *c = cos_t + p * table_stride, *s = sin_t + p * table_stride;
        for (int64_t h = 0; h < q_heads; h++) rotate(q + t * q_token + h * q_head, c, s, half);
        for (int64_t h = 0; h < k_heads; h++) rotate(k + t * k_token + h * k_head, c, s, half);
    }
    return failed;
}
"""

_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "rms_norm_f32": ([_P, _I, _P, _I, _P, _P, _I, _I, _I, ctypes.c_float], None),
    "rotary_f32": ([_P, _I, _P, _I, _I, _I, _P, _I, _I, _I, _P, _P, _I, _I, _I], ctypes.c_int),
}


_functions: tuple[Any, Any] | None = None
_resolved = False


def _kernels() -> tuple[Any, Any] | None:
    """``(rms_norm_f32, rotary_f32)``, or None; resolved once per process (``ENGINE_CORE_CPU_OPS``
    is read then)."""
    global _functions, _resolved
    if not _resolved:
        library = None
        if os.environ.get(DISABLE_ENV, "").lower() != "torch":
            # No fused multiply-adds: the rotation's products round as torch's do, bit for bit.
            library = cpu_native.load("cpu_ops", _SOURCE, _SIGNATURES, ("-ffp-contract=off",))
        _functions = None if library is None else (library.rms_norm_f32, library.rotary_f32)
        _resolved = True
    return _functions


def available() -> bool:
    """Whether the kernels run here (resolved at the first call in the process)."""
    return _kernels() is not None


def _small(t: torch.Tensor) -> bool:
    """float32 on the CPU, and small enough for one thread."""
    return (
        t.dtype == torch.float32
        and t.is_cpu
        and (t.numel() <= SINGLE_THREAD_ELEMENTS or torch.get_num_threads() == 1)
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``rms_norm(x)`` (with ``residual``: ``residual += x`` in place, then ``rms_norm`` of
    it) over the last dimension, as a new tensor; None where the kernel does not take it: ``x``
    (and ``residual``, of ``x``'s shape) must be contiguous."""
    kernels = _functions if _resolved else _kernels()
    if kernels is None or not _small(x) or not x.is_contiguous():
        return None
    n = x.shape[-1]
    if not (
        weight.dtype == torch.float32 and weight.is_cpu and weight.is_contiguous()
        and weight.numel() == n and n > 0
    ):  # fmt: skip
        return None
    res = 0
    if residual is not None:
        if not (
            residual.dtype == torch.float32 and residual.is_cpu and residual.is_contiguous()
            and residual.shape == x.shape
        ):  # fmt: skip
            return None
        res = residual.data_ptr()
    rows = x.numel() // n
    out = torch.empty_like(x)
    kernels[0](x.data_ptr(), n, res, n, weight.data_ptr(), out.data_ptr(), n, rows, n, eps)
    return out


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> bool:
    """Rotate ``q`` (``[tokens, heads, head_size]``) and ``k`` (``[tokens, kv_heads,
    head_size]``) in place by the ``[max_positions, head_size]`` tables' rows ``positions``
    (the contract of :func:`engine_core_cuda.kernels.rotary.rotary_embedding`). Returns False
    (nothing written) where the kernel does not take them; raises IndexError for a position
    outside the tables."""
    kernels = _functions if _resolved else _kernels()
    if kernels is None or not _small(q):
        return False
    tokens, q_heads, head_size = q.shape
    q_strides, k_strides, table_strides = q.stride(), k.stride(), cos.stride()
    if not (
        k.dtype == cos.dtype == sin.dtype == torch.float32
        and k.is_cpu and cos.is_cpu and sin.is_cpu and positions.is_cpu
        and k.dim() == 3 and k.shape[0] == tokens and k.shape[2] == head_size
        and head_size % 2 == 0 and q_strides[2] == k_strides[2] == 1
        and cos.shape == sin.shape and cos.shape[-1] == head_size
        and table_strides[1] == 1 and sin.stride() == table_strides
        and positions.shape[0] == tokens
    ):  # fmt: skip
        return False
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    failed = kernels[1](
        positions.data_ptr(), tokens,
        q.data_ptr(), q_strides[0], q_strides[1], q_heads,
        k.data_ptr(), k_strides[0], k_strides[1], k.shape[1],
        cos.data_ptr(), sin.data_ptr(), table_strides[0], cos.shape[0], head_size // 2,
    )  # fmt: skip
    if failed:
        raise IndexError(f"rotary embedding: a position outside the tables' {cos.shape[0]} rows")
    return True
