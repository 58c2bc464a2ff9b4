"""Sampling parameters: how one request's tokens are chosen and when it stops.

Names, defaults and validation follow vLLM's ``SamplingParams`` so code written against it ports
unchanged. Every invalid value raises ``ValueError`` at construction, naming the parameter.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import msgspec

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

_GREEDY_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2
MAX_LOGPROBS = 20


class RequestOutputKind(enum.IntEnum):
    """What each streamed :class:`~engine_core.RequestOutput` carries."""

    CUMULATIVE = 0
    """Everything generated so far (the default)."""
    DELTA = 1
    """Only what is new since the previous output."""
    FINAL_ONLY = 2
    """Nothing until the request finishes, then everything."""


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Constrain generation to a grammar: exactly one of the fields must be set."""

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        chosen = [
            name
            for name in ("json", "json_object", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ]
        if len(chosen) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar "
                f"must be set, got {chosen or 'none'}"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must not be empty")
        if self.json_object is False:
            raise ValueError("structured_outputs.json_object must be True when given")
        for name in ("regex", "grammar"):
            if getattr(self, name) == "":
                raise ValueError(f"structured_outputs.{name} must not be empty")
        if self.json == "":
            raise ValueError("structured_outputs.json must not be empty")


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_INT_FIELDS = ("n", "top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs")


def _check_types(params: SamplingParams) -> None:
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {value!r}")
    for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
        value = getattr(params, name)
        if value is None and name in _OPTIONAL_INT_FIELDS:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not (lo <= value <= hi):
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value!r}")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Parameters for sampling one request; validated at construction.

    ``temperature`` below 1e-5 means greedy decoding (``top_p``, ``top_k`` and ``min_p`` are then
    reset to their neutral values). ``stop`` strings are matched by the front end on the decoded
    text; ``stop_token_ids`` by the engine on token ids.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._normalize()
        self._validate()
        if self.is_greedy:
            # After validation, so an invalid top_p/top_k/min_p is reported even when greedy.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or ()))
        if self.seed == -1:
            self.seed = None
        # A bool asks for the sampled token's logprob (True) or for none (False).
        if isinstance(self.logprobs, bool):
            self.logprobs = 1 if self.logprobs else None
        if isinstance(self.prompt_logprobs, bool):
            self.prompt_logprobs = 1 if self.prompt_logprobs else None
        if isinstance(self.temperature, (int, float)) and (
            _GREEDY_EPS <= self.temperature < _MIN_TEMPERATURE
        ):
            self.temperature = _MIN_TEMPERATURE

    def _validate(self) -> None:
        _check_types(self)
        if self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature!r}")
        _check_range("temperature", self.temperature, 0.0, 2.0)
        if self.n > 1 and self.is_greedy:
            raise ValueError(f"n must be 1 with greedy sampling (temperature=0), got n={self.n}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k!r}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(
                f"repetition_penalty must be finite and > 0, got {self.repetition_penalty!r}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        assert isinstance(self.stop, list)
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop must not contain empty strings, got {self.stop!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or ()):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` normalized to a list (it always is after construction)."""
        return self.stop if isinstance(self.stop, list) else []

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with ``changes`` applied."""
        return msgspec.structs.replace(self, **changes)
