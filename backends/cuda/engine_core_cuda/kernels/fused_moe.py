"""Triton kernels: the fused mixture-of-experts MLP over stacked expert weights.

1. :func:`align_by_expert` sorts the (token, expert) pairs of a step by expert and pads each
   expert's segment to a multiple of the kernel's ``BLOCK_M`` (torch ops on the device, no host
   synchronization, so a decode step stays capturable in a CUDA graph): every ``BLOCK_M`` rows
   of the sorted list belong to one expert.
2. One grouped GEMM per row block multiplies the tokens of the block by their expert's gate and
   up rows at once (adding their biases, gpt-oss) and applies the activation (``act(gate) *
   up``: SwiGLU, GeGLU, or gpt-oss's clamped ``swigluoai``), writing one intermediate row per
   pair.
3. A second grouped GEMM multiplies the intermediate rows by the expert's down matrix and by the
   pair's routing weight.
4. Each token's ``top_k`` rows are summed (a fixed order: deterministic).

Weights may be FP8 (``float8_e4m3fn``) with per-output-channel scales: tiles are converted to the
activations' dtype in the kernel and the scales applied to the accumulators, so the weights
stream at one byte per element.

Kernel configurations (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, warps, stages) are chosen per
shape: from a JSON table written by ``bench/tune_moe.py`` for this device and expert geometry
when one is in :data:`CONFIG_DIR`, else from :func:`default_config`.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton reads the parameters of jit functions: they stay unannotated.)

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from engine_core_cuda.kernels.moe_torch import SWIGLU_ALPHA, SWIGLU_LIMIT

__all__ = [
    "CONFIG_DIR",
    "align_by_expert",
    "config_file_name",
    "default_config",
    "fused_moe",
    "kernel_config",
]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CONFIG_DIR = Path(__file__).with_name("moe_configs")
"""Where tuned kernel configurations live (``bench/tune_moe.py`` writes them)."""
CONFIG_DIR_ENV = "ENGINE_CORE_MOE_CONFIG_DIR"
"""Environment variable naming another folder of tuned configurations (searched first)."""


_ACT_CODES = {"silu": 0, "gelu_pytorch_tanh": 1, "swigluoai": 2}


@triton.jit
def _row_block(expert_ptr, sorted_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's row block: its expert (-1: a block past the last segment, skipped), its
    pairs (sorted by expert) and which of them are real (the rest pad the expert's segment)."""
    pid_m = tl.program_id(0)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return expert, pair, pair < num_pairs


@triton.jit
def _block_cols(N, BLOCK_N: tl.constexpr):
    """The output columns of this program's column block and which of them are in range."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_n, offs_n < N


@triton.jit
def _load_rows(ptr, rows, stride, offs_k, valid, k_valid):
    """A ``[rows, k]`` tile of the activations (zeros past the real rows and past ``K``)."""
    return tl.load(ptr + rows[:, None] * stride + offs_k[None, :],
                   mask=valid[:, None] & k_valid[None, :], other=0.0)  # fmt: skip


@triton.jit
def _mma(acc, a, b, IEEE: tl.constexpr):
    """``acc + a @ b`` (in IEEE precision with ``IEEE``, else the device's fast one)."""
    if IEEE:
        acc += tl.dot(a, b, input_precision="ieee")
    else:
        acc += tl.dot(a, b)
    return acc


@triton.jit
def _store_rows(out_ptr, pair, stride_om, offs_n, value, valid, n_valid):
    """Write ``value`` as the rows of ``pair`` (real rows, columns in range only)."""
    tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :], value,
             mask=valid[:, None] & n_valid[None, :])  # fmt: skip


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, sorted_ptr, expert_ptr,
                    num_pairs, N, K, stride_xm, stride_we, stride_wn, stride_wk, stride_se,
                    stride_be, stride_om, alpha, limit, TOP_K: tl.constexpr,
                    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):  # fmt: skip
    expert, pair, valid = _row_block(expert_ptr, sorted_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    token = tl.where(valid, pair // TOP_K, 0)
    offs_n, n_valid = _block_cols(N, BLOCK_N)
    w_base = w_ptr + expert * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = _load_rows(x_ptr, token, stride_xm, offs_k, valid, k_valid)
        b_mask = k_valid[:, None] & n_valid[None, :]
        b_offsets = offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
        gate = tl.load(w_base + b_offsets, mask=b_mask, other=0.0).to(a.dtype)
        up = tl.load(w_base + N * stride_wn + b_offsets, mask=b_mask, other=0.0).to(a.dtype)
        acc_gate = _mma(acc_gate, a, gate, IEEE)
        acc_up = _mma(acc_up, a, up, IEEE)
    if HAS_SCALE:
        s_base = scale_ptr + expert * stride_se
        acc_gate *= tl.load(s_base + offs_n, mask=n_valid, other=0.0)[None, :]
        acc_up *= tl.load(s_base + N + offs_n, mask=n_valid, other=0.0)[None, :]
    if HAS_BIAS:
        b_base = bias_ptr + expert * stride_be
        acc_gate += tl.load(b_base + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_base + N + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    # Rounded as the unfused computation rounds: each projection, then the activation.
    g = acc_gate.to(dtype).to(tl.float32)
    if ACT == 1:  # gelu-tanh
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = tl.exp(-2.0 * tl.abs(inner))
        tanh = (1.0 - t) / (1.0 + t)
        activated = 0.5 * g * (1.0 + tl.where(inner < 0, -tanh, tanh))
        h = activated.to(dtype) * acc_up.to(dtype)
    elif ACT == 2:  # gpt-oss: clamped, (up + 1) * g * sigmoid(alpha * g)
        g = tl.minimum(g, limit)
        u = tl.clamp(acc_up.to(dtype).to(tl.float32), -limit, limit)
        h = ((u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))).to(dtype)
    else:  # silu
        activated = g / (1.0 + tl.exp(-g))
        h = activated.to(dtype) * acc_up.to(dtype)
    _store_rows(out_ptr, pair, stride_om, offs_n, h.to(dtype), valid, n_valid)


@triton.jit
def _down_kernel(h_ptr, w_ptr, scale_ptr, bias_ptr, weight_ptr, out_ptr, sorted_ptr, expert_ptr,
                 num_pairs, N, K, stride_hm, stride_we, stride_wn, stride_wk, stride_se,
                 stride_be, stride_om, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    expert, pair, valid = _row_block(expert_ptr, sorted_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    row = tl.where(valid, pair, 0)
    offs_n, n_valid = _block_cols(N, BLOCK_N)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = _load_rows(h_ptr, row, stride_hm, offs_k, valid, k_valid)
        b = tl.load(w_base + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=k_valid[:, None] & n_valid[None, :], other=0.0).to(a.dtype)  # fmt: skip
        acc = _mma(acc, a, b, IEEE)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + expert * stride_se + offs_n, mask=n_valid, other=0.0)[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_valid, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    routing = tl.load(weight_ptr + row, mask=valid, other=0.0).to(dtype)
    out = acc.to(dtype) * routing[:, None]
    _store_rows(out_ptr, pair, stride_om, offs_n, out.to(dtype), valid, n_valid)


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted pair ids, expert of each block)`` for ``topk_ids`` ``[tokens, top_k]``.

    Pair ``p`` is token ``p // top_k``'s ``p % top_k``-th choice. The sorted list holds each
    expert's pairs in a segment padded with ``tokens * top_k`` (no pair) to a multiple of
    ``block_m``; its length is a bound fixed by the shape (``pairs + min(experts, pairs) *
    (block_m - 1)``, rounded up to ``block_m``), so nothing is read back to the host. Blocks past
    the last segment have expert ``-1`` (skipped by the kernels)."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    bound = pairs + min(num_experts, pairs) * (block_m - 1)
    length = -(-bound // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(pairs, device=device) - first_of_expert[expert_of_sorted]
    dest = (ends - padded)[expert_of_sorted] + rank
    sorted_ids = torch.full((length,), pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, length, block_m, device=device)
    experts = torch.searchsorted(ends, block_starts, right=True)
    experts = torch.where(experts < num_experts, experts, -1).to(torch.int32)
    return sorted_ids, experts


def default_config(tokens: int, num_experts: int, top_k: int, n: int, k: int) -> dict[str, int]:
    """A configuration for ``tokens`` tokens when no tuned table covers the shape: small row
    blocks while each expert sees few tokens (decode), larger ones for prefill."""
    if INTERPRETED:  # the interpreter's cost is per program and per element: small tiles
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    per_expert = tokens * top_k / max(1, num_experts)
    if per_expert <= 16:  # decode: weight streaming; narrow column blocks, more programs
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    if per_expert <= 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def config_file_name(num_experts: int, n: int, k: int, dtype: torch.dtype, device: str) -> str:
    """The tuned table's file name for experts of ``n`` intermediate rows over ``k`` hidden
    columns in ``dtype`` on the device called ``device``."""
    dtype_name = str(dtype).removeprefix("torch.")
    return f"E={num_experts},N={n},K={k},dtype={dtype_name},device={device.replace(' ', '_')}.json"


@functools.cache
def _table(name: str) -> dict[int, dict[str, int]] | None:
    for folder in (os.environ.get(CONFIG_DIR_ENV), str(CONFIG_DIR)):
        if folder and (path := Path(folder, name)).is_file():
            data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
            return {int(tokens): dict(config) for tokens, config in data.items()}
    return None


def kernel_config(
    tokens: int, num_experts: int, top_k: int, n: int, k: int, dtype: torch.dtype, device: str
) -> dict[str, int]:
    """The tuned configuration of the nearest batch size in this shape's table, else
    :func:`default_config`."""
    table = None if INTERPRETED else _table(config_file_name(num_experts, n, k, dtype, device))
    if not table:
        return default_config(tokens, num_experts, top_k, n, k)
    nearest = min(table, key=lambda t: (abs(t - tokens), t))
    return table[nearest]


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
) -> torch.Tensor:
    """The contract of :func:`~engine_core_cuda.kernels.moe_torch.fused_moe_torch`, in two
    grouped GEMMs; ``config`` overrides the chosen kernel configuration."""
    if activation not in _ACT_CODES:
        raise ValueError(f"activation must be one of {', '.join(_ACT_CODES)}, got {activation!r}")
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    out = torch.zeros_like(x)
    if tokens == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if config is None:
        device = _device_name(x.device.index or 0) if x.device.type == "cuda" else "cpu"
        config = kernel_config(tokens, num_experts, top_k, inter, hidden, w13.dtype, device)
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    launch = {"num_warps": config.get("num_warps", 4), "num_stages": config.get("num_stages", 2)}
    sorted_ids, block_experts = align_by_expert(topk_ids, num_experts, bm)
    pairs = tokens * top_k
    ieee = x.dtype == torch.float32
    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    grid = (block_experts.numel(), triton.cdiv(inter, bn))
    s13 = w13_scale if w13_scale is not None else w13  # any pointer when unused
    bias13 = b13 if b13 is not None else w13
    _gate_up_kernel[grid](
        x, w13, s13, bias13, h, sorted_ids, block_experts, pairs, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
        s13.stride(0), bias13.stride(0), h.stride(0), swiglu_alpha, swiglu_limit,
        TOP_K=top_k, HAS_SCALE=w13_scale is not None, HAS_BIAS=b13 is not None,
        ACT=_ACT_CODES[activation], IEEE=ieee,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **launch,
    )  # fmt: skip
    y = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    s2 = w2_scale if w2_scale is not None else w2
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    grid = (block_experts.numel(), triton.cdiv(hidden, bn))
    bias2 = b2 if b2 is not None else w2
    _down_kernel[grid](
        h, w2, s2, bias2, weights, y, sorted_ids, block_experts, pairs, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), s2.stride(0), bias2.stride(0),
        y.stride(0), HAS_SCALE=w2_scale is not None, HAS_BIAS=b2 is not None, IEEE=ieee,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **launch,
    )  # fmt: skip
    return torch.sum(y.view(tokens, top_k, hidden), dim=1, out=out)
