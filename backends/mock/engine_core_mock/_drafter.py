"""The mock's drafter: guesses of its own next tokens, right with a chosen probability.

Draft ``i`` (1-based) of a request is the token the mock itself would produce after the history
plus drafts ``1..i-1``, with probability ``r_i``; otherwise it is a different token. A stable
hash of (request, position, i) decides, so drafts are deterministic and do not depend on the
batch. Verification accepts the longest prefix of drafts equal to what the mock samples, so the
number of drafts accepted in a step of ``k`` is the number of leading right guesses: with one
rate ``p`` the mean acceptance length (accepted drafts + the bonus token) is
``(1 - p**(k + 1)) / (1 - p)``.

The draft latency model: a step that asks for ``n`` drafts from ``B`` requests lasts
``(1 if parallel_drafting else n) * (step_s + per_token_s * B)`` longer.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from xxhash import xxh3_64_intdigest

__all__ = [
    "DraftLatency",
    "Drafter",
    "SpecOptions",
    "draft_is_right",
    "expected_acceptance_length",
    "parse_spec",
    "request_key",
]

_SPEC_KEYS = frozenset(
    {
        "num_tokens",
        "acceptance_rate",
        "acceptance_rates",
        "wrong_positions",
        "draft_latency",
        "parallel_drafting",
    }
)
_DRAFT_LATENCY_KEYS = ("step_s", "per_token_s")
_TWO_64 = float(1 << 64)
_PACK = struct.Struct("<QQ").pack
_ALWAYS = 1 << 64
"""The threshold of rate 1: above every 64-bit draw."""


@dataclass(frozen=True, slots=True)
class DraftLatency:
    """The modelled cost of one drafting pass over ``B`` requests: ``step_s + per_token_s * B``."""

    step_s: float = 0.0
    per_token_s: float = 0.0

    def duration(self, num_drafts: int, num_requests: int, parallel: bool) -> float:
        """Seconds that drafting ``num_drafts`` tokens for each of ``num_requests`` adds to a
        step: one pass per draft, or a single pass when drafting is parallel."""
        if num_drafts <= 0 or num_requests <= 0:
            return 0.0
        passes = 1 if parallel else num_drafts
        return passes * (self.step_s + self.per_token_s * num_requests)


@dataclass(frozen=True, slots=True)
class SpecOptions:
    """The parsed ``backend_options["spec"]``."""

    num_tokens: int | None = None
    """Drafts the mock proposes per request and step at most (None: as many as asked)."""
    acceptance_rates: tuple[float, ...] = (1.0,)
    """Conditional rate of draft ``i`` (``acceptance_rates[i - 1]``; the last one repeats)."""
    wrong_positions: frozenset[int] = frozenset()
    """Draft indices (1-based) that are always wrong, whatever the rates."""
    draft_latency: DraftLatency = DraftLatency()
    parallel_drafting: bool = False

    def rate(self, index: int) -> float:
        """The conditional probability that draft ``index`` (1-based) is right."""
        if index in self.wrong_positions:
            return 0.0
        rates = self.acceptance_rates
        return rates[min(index, len(rates)) - 1]


def expected_acceptance_length(rates: Sequence[float], k: int) -> float:
    """Mean tokens a step with ``k`` drafts yields: ``1 + sum_i prod_{j <= i} r_j`` (the last
    rate repeats); ``(1 - p**(k + 1)) / (1 - p)`` for one rate ``p``."""
    total = 1.0
    product = 1.0
    for i in range(k):
        product *= rates[min(i, len(rates) - 1)]
        total += product
    return total


def request_key(req_id: str) -> int:
    """The seed that the draws of request ``req_id`` hash with (stable across processes)."""
    return xxh3_64_intdigest(req_id.encode())


def _draw(key: int, position: int, index: int) -> int:
    return xxh3_64_intdigest(_PACK(position, index), seed=key)


def _threshold(rate: float) -> int:
    """Draws (uniform 64-bit hashes) below this are right with probability ``rate``."""
    return min(int(rate * _TWO_64), _ALWAYS)


def draft_is_right(key: int, position: int, index: int, rate: float) -> bool:
    """Whether draft ``index`` of the request with ``key``, at sequence ``position``, is the
    mock's own token: a uniform draw in [0, 1) from the stable hash, below ``rate``."""
    threshold = _threshold(rate)
    return threshold == _ALWAYS or _draw(key, position, index) < threshold


class Drafter:
    """Proposes the mock's drafts; ``next_token(extra)`` is the token the mock would produce
    after the request's history followed by ``extra``."""

    __slots__ = ("options", "vocab_size", "_thresholds")

    def __init__(self, options: SpecOptions, vocab_size: int) -> None:
        self.options = options
        self.vocab_size = vocab_size
        # Per draft index (from 1), past which the last one repeats.
        num = max(len(options.acceptance_rates), *options.wrong_positions, 0) + 1
        self._thresholds = [_threshold(options.rate(i)) for i in range(1, num + 1)]

    def propose(
        self, key: int, position: int, num: int, next_token: Callable[[list[int]], int]
    ) -> list[int]:
        """Up to ``num`` drafts for the positions from ``position`` (the index the first draft
        takes in the sequence) of the request with ``key``."""
        cap = self.options.num_tokens
        if cap is not None:
            num = min(num, cap)
        vocab_size = self.vocab_size
        thresholds = self._thresholds
        num_thresholds = len(thresholds)
        drafts: list[int] = []
        for index in range(1, num + 1):
            token = next_token(drafts)
            threshold = thresholds[min(index, num_thresholds) - 1]
            where = position + index - 1
            # NOTE: draft_is_right inlined (this runs per draft): always right at rate 1.
            if (
                threshold < _ALWAYS
                and xxh3_64_intdigest(_PACK(where, index), seed=key) >= threshold
            ):
                # Any other token: the offset is in 1..vocab_size-1, so never the token.
                offset = 1 + _draw(key ^ 0x5BD1E995, where, index) % (vocab_size - 1)
                token = (token + offset) % vocab_size
            drafts.append(token)
        return drafts


def _rate(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
        raise ValueError(
            f"backend_options['spec'][{name}] must be a number in [0, 1], got {value!r}"
        )
    return float(value)


def _seconds(name: str, value: Any) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not 0.0 <= value < float("inf")
    ):
        raise ValueError(
            f"backend_options['spec']['draft_latency'][{name!r}] must be a finite number >= 0, "
            f"got {value!r}"
        )
    return float(value)


def _parse_draft_latency(value: Any) -> DraftLatency:
    if value is None:
        return DraftLatency()
    if not isinstance(value, dict) or not set(value) <= set(_DRAFT_LATENCY_KEYS):
        raise ValueError(
            "backend_options['spec']['draft_latency'] must be a dict with the keys "
            f"{', '.join(_DRAFT_LATENCY_KEYS)}, got {value!r}"
        )
    return DraftLatency(**{k: _seconds(k, v) for k, v in value.items()})


def parse_spec(value: Any) -> SpecOptions | None:
    """Validate ``backend_options["spec"]`` (None: the mock does not draft)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"backend_options['spec'] must be a dict, got {value!r}")
    unknown = sorted(set(value) - _SPEC_KEYS)
    if unknown:
        raise ValueError(
            f"backend_options['spec'] has unknown key(s) {unknown}; known: "
            f"{', '.join(sorted(_SPEC_KEYS))}"
        )
    num_tokens = value.get("num_tokens")
    if num_tokens is not None and (
        not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1
    ):
        raise ValueError(
            f"backend_options['spec']['num_tokens'] must be an int >= 1, got {num_tokens!r}"
        )
    if "acceptance_rate" in value and "acceptance_rates" in value:
        raise ValueError(
            "backend_options['spec'] takes 'acceptance_rate' or 'acceptance_rates', not both"
        )
    rates: tuple[float, ...] = (1.0,)
    if "acceptance_rate" in value:
        rates = (_rate("'acceptance_rate'", value["acceptance_rate"]),)
    elif "acceptance_rates" in value:
        listed = value["acceptance_rates"]
        if not isinstance(listed, list) or not listed:
            raise ValueError(
                "backend_options['spec']['acceptance_rates'] must be a non-empty list of "
                f"conditional rates, one per draft position, got {listed!r}"
            )
        rates = tuple(_rate(f"'acceptance_rates'][{i}", r) for i, r in enumerate(listed))
    wrong = value.get("wrong_positions", [])
    if not isinstance(wrong, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in wrong
    ):
        raise ValueError(
            "backend_options['spec']['wrong_positions'] must be a list of draft indices >= 1, "
            f"got {wrong!r}"
        )
    parallel = value.get("parallel_drafting", False)
    if not isinstance(parallel, bool):
        raise ValueError(
            f"backend_options['spec']['parallel_drafting'] must be a bool, got {parallel!r}"
        )
    return SpecOptions(
        num_tokens,
        rates,
        frozenset(wrong),
        _parse_draft_latency(value.get("draft_latency")),
        parallel,
    )
