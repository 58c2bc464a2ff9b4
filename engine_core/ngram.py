"""Speculative decoding utilities any layer may use: the n-gram (prompt-lookup) proposer.

The engine core proposes ``"ngram"`` drafts with it; a backend that proposes drafts on its own
(under async scheduling, say) may run the same proposer and get the same drafts. Pure Python
and the standard library: no numpy, no torch.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

__all__ = ["NgramIndex", "NgramProposer"]

_ITEM = 4  # bytes per packed token id


class NgramIndex:
    """One sequence's token ids packed as uint32 for searching, extended as the sequence grows.

    The sequence may only grow between calls (a request's tokens do); a shorter one than the
    index saw is packed again from scratch.
    """

    __slots__ = ("packed", "num_tokens")

    def __init__(self) -> None:
        self.packed = bytearray()
        self.num_tokens = 0

    def sync(self, token_ids: Sequence[int]) -> bytearray:
        """Pack the tokens of ``token_ids`` not packed yet; returns the packed sequence."""
        num = len(token_ids)
        if num < self.num_tokens:
            self.packed = bytearray()
            self.num_tokens = 0
        if num > self.num_tokens:
            self.packed += array("I", token_ids[self.num_tokens :]).tobytes()
            self.num_tokens = num
        return self.packed


class NgramProposer:
    """Prompt lookup: find the sequence's last ``n`` tokens earlier in it and propose the tokens
    that followed them there.

    The longest ``n`` in ``[min_n, max_n]`` with a match wins; among matches of that length the
    earliest occurrence wins (as vLLM's n-gram proposer). Up to ``k`` tokens are proposed (fewer
    when the match is near the end of the sequence; none without a match).

    The search runs over the packed sequence with ``bytearray.find`` (C speed): a few
    microseconds at 2k tokens. Pass a per-sequence :class:`NgramIndex` to pack only the tokens
    added since the last call.
    """

    __slots__ = ("min_n", "max_n")

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(
        self, token_ids: Sequence[int], k: int, index: NgramIndex | None = None
    ) -> list[int]:
        """Up to ``k`` drafts continuing ``token_ids``."""
        num = len(token_ids)
        if k <= 0 or num <= self.min_n:
            return []
        packed = (index if index is not None else NgramIndex()).sync(token_ids)
        # A match must be followed by at least one token: it ends before the last token.
        end = (num - 1) * _ITEM
        # No match of min_n tokens means none longer: the common miss costs one search.
        shortest = _earliest(packed, self.min_n, end)
        if shortest < 0:
            return []
        for n in range(min(self.max_n, num - 1), self.min_n, -1):
            found = _earliest(packed, n, end)
            if found >= 0:
                return list(token_ids[found + n : found + n + k])
        return list(token_ids[shortest + self.min_n : shortest + self.min_n + k])


def _earliest(packed: bytearray, n: int, end: int) -> int:
    """The first token position where the last ``n`` packed tokens occur, ending at or before
    byte ``end``; -1 if none."""
    needle = packed[-n * _ITEM :]
    start = 0
    while True:
        found = packed.find(needle, start, end)
        if found < 0 or found % _ITEM == 0:
            return found // _ITEM if found >= 0 else -1
        start = found + 1  # straddles two tokens: look further on
