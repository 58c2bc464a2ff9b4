"""Counter-based random numbers for sampling: a pure function of (seed, position, token id).

A request's draw at a position depends on nothing else (not on the batch it runs in, nor on the
other requests' seeds), which is what makes seeded sampling reproducible across batch
compositions. The hash is a 32-bit integer mixer evaluated with int64 tensor arithmetic that
never overflows (products are split into 16-bit halves), so it gives the same bits on every
device. The fused sampling kernel (:mod:`engine_core_cuda.kernels.sampling`) computes the same
hash per token, in registers.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["exponential_noise", "request_seed", "uniform"]

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
_U64 = (1 << 64) - 1


def request_seed(req_id: str, seed: int | None, engine_seed: int) -> int:
    """The seed of a request: its own, else one derived from the engine's seed and its id
    (stable across processes: no salted ``hash()``). Returned as a signed 64-bit int."""
    if seed is None:
        digest = hashlib.blake2b(
            req_id.encode(), digest_size=8, key=(engine_seed & _U64).to_bytes(8, "little")
        ).digest()
        value = int.from_bytes(digest, "little")
    else:
        value = seed & _U64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``x`` in [0, 2**32), without int64 overflow."""
    low = x * (c & _MASK16)
    high = ((x * (c >> 16)) & _MASK16) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mixer ("lowbias32")."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` float32 numbers in (0, 1], one stream per (seed, position) row."""
    seeds = seeds.to(torch.int64)
    key = _mix32((positions.to(torch.int64) & _MASK32) ^ 0x9E3779B9)
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32(key ^ (seeds & _MASK32))
    tokens = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(_mix32(key[:, None] ^ _mix32(tokens)[None, :]) ^ key[:, None])
    # 24 random bits -> (0, 1], exactly representable in float32.
    return ((bits >> 8) + 1).to(torch.float32) * (1.0 / (1 << 24))


def exponential_noise(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Exp(1) draws: ``argmax(probs / noise)`` samples from ``probs`` (the exponential race)."""
    return (-torch.log(uniform(seeds, positions, vocab_size))).clamp_min_(1e-10)
