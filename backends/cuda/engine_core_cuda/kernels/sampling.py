"""Triton kernel: one step's random sampling, fused (temperature, min-p, top-k, top-p, the
counter-based noise and the exponential race), one program per row.

The torch formulation (:mod:`engine_core_cuda._sampler`, the reference) sorts the whole
vocabulary for top-k/top-p and computes the noise in ~130 elementwise operations over
``[rows, vocab]`` int64 tensors. Here each row is read a few times and nothing of its size is
written:

1. the maximum logit and its first index (the greedy token, and the softmax's offset);
2. top-k: the k-th largest logit, found by a 16-way search over the logits' orderable bit
   patterns (each round counts the logits at or above 16 pivots in one pass; ~8 rounds), so no
   sort; min-p needs no pass (``p >= min_p * p_max`` is ``exp(z - z_max) >= min_p``);
3. the sum of ``exp(z - z_max)`` over the kept tokens; top-p: the smallest probability kept,
   found the same way over the probabilities' bit patterns (the mass at or above each pivot);
4. the race: ``argmax(p / noise)`` with the noise of :mod:`engine_core_cuda._random`
   (the same 32-bit hash of (seed, position, token id), computed in uint64 without overflow).

The kept set is the reference's (top-k keeps every logit equal to the k-th; top-p keeps the
smallest set of the most likely tokens whose mass reaches ``top_p``) up to float rounding at the
boundary, so the sampled tokens equal the reference's for the same seeds.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton reads the parameters of jit functions: they stay unannotated.)

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETED", "sample_rows"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether the kernels of this module run in Triton's interpreter (fixed at import)."""

_MAX_BLOCK = 1024
_PIVOTS = 16


@triton.jit
def _mix32(x):
    # "lowbias32" on uint64 values below 2**32: products stay below 2**64.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _orderable(x):
    # int32 keys ordered as the float32 values are (negative floats have their order reversed).
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _scaled(base, cols, vocab_size, temperature):
    x = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
    return x / temperature


@triton.jit
def _next_bounds(lo, hi, ok_count, pivots, NUM_PIVOTS: tl.constexpr):
    # ok is true for a prefix of the (non-decreasing) pivots: move lo to the last ok pivot and hi
    # to the first failing one.
    index = tl.arange(0, NUM_PIVOTS)
    new_lo = tl.max(tl.where(index < ok_count, pivots, lo), 0)
    new_hi = tl.min(tl.where(index >= ok_count, pivots, hi), 0)
    return new_lo, new_hi


@triton.jit
def _pivots(lo, hi, NUM_PIVOTS: tl.constexpr):
    step = tl.maximum((hi - lo) // (NUM_PIVOTS + 1), 1)
    index = tl.arange(0, NUM_PIVOTS).to(tl.int64)
    return tl.minimum(lo + step * (index + 1), hi - 1)


# Per-row parameters are columns and slices of the step's tensors, read one value per row.
@triton.jit(
    do_not_specialize_on_alignment=["seeds_ptr", "positions_ptr", "greedy_ptr",
                                    "temperature_ptr", "min_p_ptr", "top_k_ptr", "top_p_ptr"]
)  # fmt: skip
def _sample_kernel(
    logits_ptr,
    stride_logits,
    seeds_ptr,
    stride_seeds,
    positions_ptr,
    stride_positions,
    greedy_ptr,
    temperature_ptr,
    stride_temperature,
    min_p_ptr,
    stride_min_p,
    top_k_ptr,
    stride_top_k,
    top_p_ptr,
    stride_top_p,
    out_ptr,
    vocab_size,
    HAS_GREEDY: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_logits
    offs = tl.arange(0, BLOCK)

    # 1. The maximum logit and its first index.
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_index = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + offs
        x = _scaled(base, cols, vocab_size, 1.0)
        better = x > best
        best = tl.where(better, x, best)
        best_index = tl.where(better, cols, best_index)
    x_max = tl.max(best, 0)
    argmax = tl.min(tl.where(best == x_max, best_index, vocab_size), 0)
    is_greedy = False
    if HAS_GREEDY:
        is_greedy = tl.load(greedy_ptr + row) != 0
    if is_greedy:
        tl.store(out_ptr + row, argmax.to(tl.int64))
    else:
        temperature = 1.0
        if HAS_TEMPERATURE:
            temperature = tl.load(temperature_ptr + row * stride_temperature)
        z_max = x_max / temperature
        min_weight = 0.0
        if HAS_MIN_P:
            min_weight = tl.load(min_p_ptr + row * stride_min_p)

        # 2. Top-k: the largest key t with count(key >= t) >= k among the min-p survivors.
        k_key = tl.full([], -2147483648, tl.int64)  # every token
        if HAS_TOP_K:
            k = tl.maximum(tl.load(top_k_ptr + row * stride_top_k).to(tl.int64), 1)
            lo = tl.full([], -2147483648, tl.int64)
            hi = tl.where(k < vocab_size, 2147483647, -2147483647).to(tl.int64)  # off: no search
            while hi - lo > 1:
                pivots = _pivots(lo, hi, NUM_PIVOTS)
                counts = tl.zeros([NUM_PIVOTS], dtype=tl.int64)
                for start in range(0, vocab_size, BLOCK):
                    cols = start + offs
                    z = _scaled(base, cols, vocab_size, temperature)
                    alive = (cols < vocab_size) & (tl.exp(z - z_max) >= min_weight)
                    key = tl.where(alive, _orderable(z), -2147483648).to(tl.int64)
                    counts += tl.sum((key[:, None] >= pivots[None, :]).to(tl.int64), 0)
                lo, hi = _next_bounds(lo, hi, tl.sum((counts >= k).to(tl.int32), 0), pivots,
                                      NUM_PIVOTS)  # fmt: skip
            k_key = lo

        # 3. The kept mass, then top-p: the largest p-threshold keeping a mass >= top_p.
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + offs
            z = _scaled(base, cols, vocab_size, temperature)
            weight = tl.exp(z - z_max)
            alive = (cols < vocab_size) & (weight >= min_weight) & (_orderable(z) >= k_key)
            total += tl.where(alive, weight, 0.0)
        inv_total = 1.0 / tl.sum(total, 0)
        p_key = tl.full([], 0, tl.int64)  # every probability
        if HAS_TOP_P:
            top_p = tl.load(top_p_ptr + row * stride_top_p)
            if top_p < 1.0:
                lo = tl.full([], 0, tl.int64)
                hi = tl.full([], 0x3F800001, tl.int64)  # just above the bits of 1.0
                while hi - lo > 1:
                    pivots = _pivots(lo, hi, NUM_PIVOTS)
                    masses = tl.zeros([NUM_PIVOTS], dtype=tl.float32)
                    for start in range(0, vocab_size, BLOCK):
                        cols = start + offs
                        z = _scaled(base, cols, vocab_size, temperature)
                        weight = tl.exp(z - z_max)
                        alive = (
                            (cols < vocab_size) & (weight >= min_weight) & (_orderable(z) >= k_key)
                        )
                        p = tl.where(alive, weight * inv_total, 0.0)
                        key = p.to(tl.int32, bitcast=True).to(tl.int64)
                        above = key[:, None] >= pivots[None, :]
                        masses += tl.sum(tl.where(above, p[:, None], 0.0), 0)
                    lo, hi = _next_bounds(lo, hi, tl.sum((masses >= top_p).to(tl.int32), 0),
                                          pivots, NUM_PIVOTS)  # fmt: skip
                p_key = lo

        # 4. The race: argmax(p / noise) over the kept tokens.
        seed = tl.load(seeds_ptr + row * stride_seeds).to(tl.uint64, bitcast=True)
        position = tl.load(positions_ptr + row * stride_positions).to(tl.uint64, bitcast=True)
        key = _mix32((position & 0xFFFFFFFF) ^ 0x9E3779B9)
        key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF))
        key = _mix32(key ^ (seed & 0xFFFFFFFF))
        best = tl.full([BLOCK], -1.0, dtype=tl.float32)
        best_index = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + offs
            z = _scaled(base, cols, vocab_size, temperature)
            weight = tl.exp(z - z_max)
            p = weight * inv_total
            alive = (
                (cols < vocab_size)
                & (weight >= min_weight)
                & (_orderable(z) >= k_key)
                & (p.to(tl.int32, bitcast=True) >= p_key)
            )
            bits = _mix32(_mix32(key ^ _mix32(cols.to(tl.uint64))) ^ key)
            uniform = ((bits >> 8) + 1).to(tl.float32) * (1.0 / 16777216.0)
            noise = tl.maximum(-tl.log(uniform), 1e-10)
            score = tl.where(alive, p / noise, tl.where(cols < vocab_size, 0.0, -1.0))
            better = score > best
            best = tl.where(better, score, best)
            best_index = tl.where(better, cols, best_index)
        top = tl.max(best, 0)
        token = tl.min(tl.where(best == top, best_index, vocab_size), 0)
        tl.store(out_ptr + row, token.to(tl.int64))


def _strided(t: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int]:
    if t is None:
        return fallback, 0
    if t.dim() != 1:
        raise ValueError(f"per-row parameters must be 1-D, got shape {tuple(t.shape)}")
    return t, t.stride(0)


def sample_rows(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    greedy: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token ids ``[rows]`` (int64) sampled from ``logits`` (``[rows, vocab]``, last dimension
    contiguous): greedy rows (``greedy`` true) take the argmax; the others divide by
    ``temperature``, apply ``min_p``, ``top_k`` (``vocab`` or more: off) and ``top_p`` (1: off)
    and draw with the noise of (``seeds``, ``positions``). Per-row parameters are 1-D, any
    stride; None: off for every row."""
    rows, vocab_size = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous in their last dimension")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    flags = {
        "HAS_GREEDY": greedy is not None,
        "HAS_TEMPERATURE": temperature is not None,
        "HAS_MIN_P": min_p is not None,
        "HAS_TOP_K": top_k is not None,
        "HAS_TOP_P": top_p is not None,
    }
    seeds, stride_seeds = _strided(seeds, seeds)
    positions, stride_positions = _strided(positions, positions)
    temperature, stride_temperature = _strided(temperature, logits)
    min_p, stride_min_p = _strided(min_p, logits)
    top_k, stride_top_k = _strided(top_k, seeds)
    top_p, stride_top_p = _strided(top_p, logits)
    block = min(_MAX_BLOCK, triton.next_power_of_2(vocab_size))
    _sample_kernel[(rows,)](
        logits,
        logits.stride(0),
        seeds,
        stride_seeds,
        positions,
        stride_positions,
        greedy if greedy is not None else seeds,
        temperature,
        stride_temperature,
        min_p,
        stride_min_p,
        top_k,
        stride_top_k,
        top_p,
        stride_top_p,
        out,
        vocab_size,
        **flags,
        BLOCK=block,
        NUM_PIVOTS=_PIVOTS,
        num_warps=8 if block >= 1024 else 4,  # the [BLOCK, PIVOTS] tiles of the searches
    )
    return out
