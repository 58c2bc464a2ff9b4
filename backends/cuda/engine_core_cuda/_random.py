"""Counter-based random numbers for sampling: a pure function of (seed, position, token id).

A request's draw at a position depends on nothing else (not on the batch it runs in, nor on the
other requests' seeds), which is what makes seeded sampling reproducible across batch
compositions. The hash is a 32-bit integer mixer evaluated with int64 tensor arithmetic that
never overflows (products are split into 16-bit halves), so it gives the same bits on every
device. The fused sampling kernel (:mod:`engine_core_cuda.kernels.sampling`) computes the same
hash per token, in registers.

:func:`uniform` and :func:`exponential_noise` are the reference: ~130 elementwise int64
operations over ``[rows, vocab]`` tensors, each a pass over memory (at 64 rows of a 128k
vocabulary, over a second per step on a CPU). :func:`exponential_race` draws the same tokens
without them: the per-token half of the hash once per vocabulary size, the rest in 32-bit words
(unsigned multiplies wrap, as the hash wants) and in place, over column chunks that stay in the
CPU's cache, keeping each chunk's best score.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["exponential_noise", "exponential_race", "request_seed", "uniform"]

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


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[rows]`` int64 in [0, 2**32): the hash of each row's (seed, position)."""
    seeds = seeds.to(torch.int64)
    key = _mix32((positions.to(torch.int64) & _MASK32) ^ 0x9E3779B9)
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    return _mix32(key ^ (seeds & _MASK32))


def uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` float32 numbers in (0, 1], one stream per (seed, position) row."""
    key = _row_keys(seeds, positions)
    tokens = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(_mix32(key[:, None] ^ _mix32(tokens)[None, :]) ^ key[:, None])
    # 24 random bits -> (0, 1], exactly representable in float32.
    return ((bits >> 8) + 1).to(torch.float32) * (1.0 / (1 << 24))


def exponential_noise(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Exp(1) draws: ``argmax(probs / noise)`` samples from ``probs`` (the exponential race)."""
    return (-torch.log(uniform(seeds, positions, vocab_size))).clamp_min_(1e-10)


_CHUNK_ELEMENTS = 1 << 16
"""Elements of a column chunk of :func:`exponential_race` per torch thread (256 KiB per int32
buffer)."""
_token_hashes: dict[tuple[int, torch.device], torch.Tensor] = {}


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as the int32 words of the same bits."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _token_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    """``_mix32(token id)`` of every token as int32 words (computed once per vocabulary size)."""
    key = (vocab_size, device)
    cached = _token_hashes.get(key)
    if cached is None:
        tokens = torch.arange(vocab_size, device=device, dtype=torch.int64)
        cached = _token_hashes[key] = _as_int32(_mix32(tokens))
    return cached


_MIX_STEPS = ((16, 0x7FEB352D), (15, 0x846CA68B - (1 << 32)), (16, None))
"""The mixer's (shift, multiplier) steps, the multipliers as int32 values."""


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """:func:`_mix32` in place on int32 words (``tmp``: a buffer of ``x``'s shape): logical
    shifts are arithmetic ones masked; the multiplies keep the low 32 bits of the product,
    which are the same for signed and unsigned words (ATen's int32 multiply is the machine's
    wrapping one, vectorized; its uint32 multiply is not vectorized, ~20x slower; the
    equality test against :func:`uniform` holds this)."""
    for shift, factor in _MIX_STEPS:
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp.bitwise_and_((1 << (32 - shift)) - 1)
        x.bitwise_xor_(tmp)
        if factor is not None:
            x.mul_(factor)


def exponential_race(
    probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """``argmax(probs / exponential_noise(seeds, positions, vocab))`` per row (``[rows]``
    int64), the same tokens, computed chunk by chunk in 32-bit words without the
    ``[rows, vocab]`` noise (see the module's docs). ``probs``: float32 ``[rows, vocab]``."""
    rows, vocab_size = probs.shape
    device = probs.device
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    keys = _as_int32(_row_keys(seeds, positions))[:, None]
    token_hash = _token_hash(vocab_size, device)
    # A chunk per thread fits its cache: with more threads, fewer and wider operations (each
    # one waits for every thread).
    chunk = _CHUNK_ELEMENTS * max(1, torch.get_num_threads())
    width = max(16, min(vocab_size, chunk // rows // 16 * 16))
    bits = torch.empty(rows, width, dtype=torch.int32, device=device)
    tmp = torch.empty_like(bits)
    score = torch.empty(rows, width, dtype=torch.float32, device=device)
    best = torch.full((rows,), -1.0, dtype=torch.float32, device=device)
    best_index = torch.zeros(rows, dtype=torch.int64, device=device)
    for start in range(0, vocab_size, width):
        n = min(width, vocab_size - start)
        x, t, u = bits[:, :n], tmp[:, :n], score[:, :n]
        torch.bitwise_xor(keys, token_hash[start : start + n], out=x)
        _mix32_(x, t)
        x.bitwise_xor_(keys)
        _mix32_(x, t)
        # 24 random bits -> (0, 1], then the noise -log(u) and the score p / noise.
        x.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF).add_(1)
        u.copy_(x).mul_(1.0 / (1 << 24)).log_().neg_().clamp_min_(1e-10)
        torch.div(probs[:, start : start + n], u, out=u)
        value, index = u.max(dim=1)  # the first index of the maximum, as argmax
        better = value > best  # ties keep the earlier chunk: argmax's first index
        best = torch.where(better, value, best)
        best_index = torch.where(better, index + start, best_index)
    return best_index
