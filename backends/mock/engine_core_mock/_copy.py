"""``backend_options["copy_prompt"]``: outputs that copy spans of their prompt.

Summaries, code edits and retrieval answers repeat their input, which is what prompt-lookup
(n-gram) speculation guesses from. With ``{"fraction": f, "period": P}`` the mock's outputs
come in periods of ``P`` tokens: the first ``P - round(f * P)`` of each follow the usual rule,
the rest copy a span of the prompt whose start a stable hash of (period, prompt length)
chooses. Like a scripted reply, a copied token replaces the rule's token, greedy or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from xxhash import xxh3_64_intdigest

__all__ = ["CopyRule", "parse_copy"]


@dataclass(frozen=True, slots=True)
class CopyRule:
    """Which outputs copy the prompt, and from where."""

    fraction: float
    period: int

    @property
    def num_copied(self) -> int:
        """Tokens copied per period."""
        return round(self.fraction * self.period)

    def token(self, tokens: Sequence[int], num_prompt_tokens: int, index: int) -> int | None:
        """The prompt token that output ``index`` copies (``tokens`` starts with the prompt),
        or None when that output follows the rule."""
        period, offset = divmod(index, self.period)
        num_copied = self.num_copied
        skip = self.period - num_copied
        if offset < skip:
            return None
        room = max(1, num_prompt_tokens - num_copied)
        start = xxh3_64_intdigest(period.to_bytes(8, "little"), seed=num_prompt_tokens) % room
        return tokens[(start + offset - skip) % num_prompt_tokens]


def parse_copy(value: Any) -> CopyRule | None:
    """Validate ``backend_options["copy_prompt"]`` (None: outputs never copy)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"fraction", "period"}:
        raise ValueError(
            "backend_options['copy_prompt'] must be a dict with the keys 'fraction' and "
            f"'period', got {value!r}"
        )
    fraction, period = value["fraction"], value["period"]
    if (
        not isinstance(fraction, (int, float))
        or isinstance(fraction, bool)
        or not 0 <= fraction <= 1
    ):
        raise ValueError(
            "backend_options['copy_prompt']['fraction'] must be a number in [0, 1], "
            f"got {fraction!r}"
        )
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise ValueError(
            f"backend_options['copy_prompt']['period'] must be an int >= 1, got {period!r}"
        )
    return CopyRule(float(fraction), period)
