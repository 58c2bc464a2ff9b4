"""The mock's token rules: masks, grammar bitmask rows and the synthetic logprob distribution.

The synthetic distribution at a position is centred on the greedy token ``g`` (the previous token
plus one): token ``t`` has rank ``((t - g) % vocab_size) + 1`` and logprob ``-rank * ln 2``, so
probabilities halve from one rank to the next and sum to ``1 - 2**-vocab_size``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

from engine_core.abc import TokenLogprobs

__all__ = [
    "LN2",
    "LogitBias",
    "bitmask_rows",
    "is_allowed",
    "next_allowed",
    "nth_allowed",
    "synthetic_logprobs",
    "weighted_allowed",
]

LN2 = math.log(2.0)
MAX_BIAS = 100.0


def synthetic_logprobs(token: int, centre: int, num_top: int, vocab_size: int) -> TokenLogprobs:
    """``token`` first, then the ``num_top`` most likely tokens of the distribution centred on
    ``centre``."""
    rank = (token - centre) % vocab_size + 1
    token_ids = [token]
    logprobs = [-rank * LN2]
    ranks = [rank]
    for r in range(1, min(num_top, vocab_size) + 1):
        token_ids.append((centre + r - 1) % vocab_size)
        logprobs.append(-r * LN2)
        ranks.append(r)
    return TokenLogprobs(token_ids, logprobs, ranks)


def bitmask_rows(bitmask: Any, vocab_size: int, req_ids: Sequence[str]) -> list[list[int]]:
    """A grammar bitmask (a 2-D numpy int32 array, or a sequence of rows of ints) as lists of
    Python ints, one per request of ``req_ids``; bit ``j`` of word ``j // 32`` set means token
    ``j`` is allowed."""
    rows = (
        bitmask.tolist() if hasattr(bitmask, "tolist") else [[int(w) for w in r] for r in bitmask]
    )
    needed = -(-vocab_size // 32)
    for words, req_id in zip(rows, req_ids, strict=True):
        if len(words) < needed:
            raise RuntimeError(
                f"grammar bitmask row of request {req_id!r} has {len(words)} words; "
                f"{needed} are needed for a vocabulary of {vocab_size}"
            )
    return rows


def is_allowed(token: int, banned: Collection[int] | None, words: Sequence[int] | None) -> bool:
    """Whether ``token`` is neither ``banned`` nor disallowed by the bitmask ``words``."""
    if banned is not None and token in banned:
        return False
    return words is None or (words[token >> 5] >> (token & 31)) & 1 == 1


class LogitBias:
    """A request's ``logit_bias`` as the mock applies it, deterministically: a bias of -100 bans
    its token (:attr:`banned`, masked like stop tokens), one of +100 forces it (the first forced
    token at or after the rule's token that is allowed), and with greedy decoding the others
    move the choice to the token of highest synthetic logit plus bias."""

    __slots__ = ("bias", "banned", "forced", "weighted")

    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias
        self.banned = frozenset(t for t, b in bias.items() if b <= -MAX_BIAS)
        self.forced = sorted(t for t, b in bias.items() if b >= MAX_BIAS)
        self.weighted = any(-MAX_BIAS < b < MAX_BIAS for b in bias.values())

    def choose(
        self,
        token: int,
        centre: int,
        vocab_size: int,
        greedy: bool,
        banned: Collection[int] | None,
        words: Sequence[int] | None,
    ) -> int:
        """The token to take instead of the rule's ``token`` (itself when the bias changes
        nothing); ``banned`` and ``words`` are what is excluded now."""
        forced = [t for t in self.forced if t < vocab_size and is_allowed(t, banned, words)]
        if forced:
            return min(forced, key=lambda t: (t - token) % vocab_size)
        if not greedy or not self.weighted:
            return token
        # The synthetic logit of t is -rank(t) * ln 2 (rank 1 at the centre): the best token
        # is the best unbiased one or a biased one.
        bias = self.bias
        excluded = bias.keys() if banned is None else bias.keys() | banned
        best = next_allowed(centre, vocab_size, excluded, words)
        best_score = -math.inf
        if best is not None:
            best_score = -((best - centre) % vocab_size + 1) * LN2
        for t, b in bias.items():
            if t >= vocab_size or not is_allowed(t, banned, words):
                continue
            score = -((t - centre) % vocab_size + 1) * LN2 + b
            if score > best_score or (
                score == best_score
                and best is not None
                and (t - centre) % vocab_size < (best - centre) % vocab_size
            ):
                best, best_score = t, score
        return token if best is None else best


def next_allowed(
    start: int,
    vocab_size: int,
    banned: Collection[int] | None,
    words: Sequence[int] | None,
) -> int | None:
    """The first token at or after ``start`` (wrapping) that is not ``banned`` and is allowed by
    the bitmask ``words``; None when every token is excluded."""
    token = start
    remaining = vocab_size
    while remaining > 0:
        if words is not None:
            word = words[token >> 5]
            if word == 0:  # skip a whole word of disallowed tokens
                skip = min(32 - (token & 31), remaining, vocab_size - token)
                remaining -= skip
                token = (token + skip) % vocab_size
                continue
            # Python ints shift as infinite two's complement, so int32 words with bit 31 set work.
            allowed = (word >> (token & 31)) & 1
        else:
            allowed = 1
        if allowed and (banned is None or token not in banned):
            return token
        remaining -= 1
        token += 1
        if token == vocab_size:
            token = 0
    return None


def _allowed_masks(
    vocab_size: int, banned: Collection[int] | None, words: Sequence[int]
) -> list[int]:
    """The bitmask ``words`` as unsigned 32-bit words, with ``banned`` and the ids past the
    vocabulary cleared."""
    masks = [w & 0xFFFFFFFF for w in words[: (vocab_size + 31) >> 5]]
    if vocab_size & 31:
        masks[-1] &= (1 << (vocab_size & 31)) - 1
    for token in banned or ():
        if token < vocab_size:
            masks[token >> 5] &= ~(1 << (token & 31))
    return masks


def nth_allowed(
    draw: int, vocab_size: int, banned: Collection[int] | None, words: Sequence[int]
) -> int | None:
    """A token drawn uniformly by ``draw`` (a random integer) among those the bitmask ``words``
    allows and that are not ``banned``; None when there is none."""
    masks = _allowed_masks(vocab_size, banned, words)
    counts = [m.bit_count() for m in masks]
    total = sum(counts)
    if total == 0:
        return None
    rank = draw % total
    for index, count in enumerate(counts):
        if rank >= count:
            rank -= count
            continue
        mask = masks[index]
        for _ in range(rank):
            mask &= mask - 1  # clear the lowest set bit
        return (index << 5) + (mask & -mask).bit_length() - 1
    raise AssertionError("unreachable: rank < total")


HEAVY_WEIGHT = 4096
ORDINARY_WEIGHT = 64
"""The weights of :func:`weighted_allowed` (a light token weighs 1)."""


def weighted_allowed(
    draw: int,
    vocab_size: int,
    banned: Collection[int] | None,
    words: Sequence[int],
    heavy: Sequence[int],
    light: Collection[int],
) -> int | None:
    """A token drawn by ``draw`` among those the bitmask ``words`` allows and that are not
    ``banned``, each of ``heavy`` weighing :data:`HEAVY_WEIGHT`, each of ``light``
    1 and any other :data:`ORDINARY_WEIGHT`; None when there is none."""
    excluded = set(banned or ())
    heavy_ok = [t for t in heavy if t < vocab_size and is_allowed(t, excluded, words)]
    excluded.update(heavy_ok)
    light_ok = sorted(t for t in light if t < vocab_size and is_allowed(t, excluded, words))
    excluded.update(light_ok)
    num_ordinary = sum(m.bit_count() for m in _allowed_masks(vocab_size, excluded, words))
    total = HEAVY_WEIGHT * len(heavy_ok) + ORDINARY_WEIGHT * num_ordinary + len(light_ok)
    if total == 0:
        return None
    rank = draw % total
    if rank < HEAVY_WEIGHT * len(heavy_ok):
        return heavy_ok[rank // HEAVY_WEIGHT]
    rank -= HEAVY_WEIGHT * len(heavy_ok)
    if rank < ORDINARY_WEIGHT * num_ordinary:
        return nth_allowed(rank // ORDINARY_WEIGHT, vocab_size, excluded, words)
    return light_ok[rank - ORDINARY_WEIGHT * num_ordinary]
