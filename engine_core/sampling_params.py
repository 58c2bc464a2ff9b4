"""Sampling parameters: how one request's tokens are chosen and when it stops.

Names, defaults and validation follow vLLM's ``SamplingParams`` so code written against it ports
unchanged. At construction (and when decoded from the wire) a value of the wrong type raises
``TypeError`` and an invalid one ``ValueError``, naming the parameter: bools are not ints and ints
are not bools, integers must fit 64 bits, strings must be valid Unicode. So whatever constructs
can be sent to the engine and decoded there.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

import msgspec

from engine_core._core.checks import (
    INT64_MAX,
    INT64_MIN,
    MAX_JSON_DEPTH,
    check_int64,
    check_json_text,
    check_json_value,
    check_text,
    show,
)

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
    """Constrain generation to a grammar: exactly one of the fields must be set.

    ``json`` is a JSON schema, as a dict or as JSON text, nested at most ``MAX_JSON_DEPTH``
    (100) levels; ``choice`` any sequence of strings (kept as a list). Wrong types raise
    ``TypeError`` and invalid values ``ValueError``, naming the field.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    """With ``json`` or ``json_object``: compact JSON, with no whitespace between tokens (as
    vLLM's field of that name); by default the grammar allows any."""

    def __post_init__(self) -> None:
        if type(self.disable_any_whitespace) is not bool:
            raise TypeError(
                "structured_outputs.disable_any_whitespace must be a bool, "
                f"got {show(self.disable_any_whitespace)}"
            )
        chosen = [name for name in _STRUCTURED_FIELDS if getattr(self, name) is not None]
        if len(chosen) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar "
                f"must be set, got {chosen or 'none'}"
            )
        name = chosen[0]
        where = f"structured_outputs.{name}"
        if name == "json":
            _check_schema(where, self.json)
        elif name == "json_object":
            if type(self.json_object) is not bool:
                raise TypeError(f"{where} must be a bool, got {show(self.json_object)}")
            if not self.json_object:
                raise ValueError(f"{where} must be True when given")
        elif name == "choice":
            self.choice = _str_list(where, self.choice)
            if not self.choice:
                raise ValueError(f"{where} must not be empty")
        else:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"{where} must be a str, got {show(value)}")
            if not value:
                raise ValueError(f"{where} must not be empty")
            check_text(where, value)


_STRUCTURED_FIELDS = ("json", "json_object", "regex", "choice", "grammar")


def _check_schema(where: str, schema: object) -> None:
    if isinstance(schema, str):
        if not schema:
            raise ValueError(f"{where} must not be empty")
        check_text(where, schema)
        check_json_text(where, schema, MAX_JSON_DEPTH)
    elif isinstance(schema, dict):
        check_json_value(where, schema, MAX_JSON_DEPTH)
    else:
        raise TypeError(f"{where} must be a JSON schema (a dict or JSON text), got {show(schema)}")


def _str_list(name: str, value: object) -> list[str]:
    """``value`` (a sequence of str, not a str itself) as a list; ``TypeError`` otherwise."""
    if type(value) is not list:
        if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
            raise TypeError(f"{name} must be a list of str, got {show(value)}")
        value = list(value)
    for item in value:
        if not isinstance(item, str):
            raise TypeError(f"{name} must be a list of str, got an item {show(item)}")
        check_text(name, item)
    return value


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {show(value)}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got {show(value)}") from None


def _coerce_numbers(params: SamplingParams) -> None:
    """Type-check the numeric fields: floats stay floats (ints become floats), ints must be
    ints (not bools) of 64 bits at most. A bool ``logprobs`` asks for the sampled token's
    logprob (True) or for none (False)."""
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if type(value) is not float:
            setattr(params, name, _as_float(name, value))
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if isinstance(value, bool):
            setattr(params, name, 1 if value else None)
    for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
        value = getattr(params, name)
        if type(value) is not int:
            if value is None and name in _OPTIONAL_INT_FIELDS:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {show(value)}")
            value = int(value)
            setattr(params, name, value)
        if not (INT64_MIN <= value <= INT64_MAX):
            check_int64(name, value)


def _coerce_others(params: SamplingParams) -> None:
    """Type-check and normalize the flags, ``output_kind``, the stop conditions,
    ``logit_bias`` and ``structured_outputs``."""
    for name in _BOOL_FIELDS:
        value = getattr(params, name)
        if type(value) is not bool:
            raise TypeError(f"{name} must be a bool, got {show(value)}")
    kind = params.output_kind
    if type(kind) is not RequestOutputKind:
        params.output_kind = _as_output_kind(kind)
    stop = params.stop
    if stop is None:
        params.stop = []
    else:
        params.stop = _str_list("stop", [stop] if isinstance(stop, str) else stop)
    params.stop_token_ids = _int_list("stop_token_ids", params.stop_token_ids)
    if params.logit_bias is not None:
        params.logit_bias = _logit_bias(params.logit_bias)
    structured = params.structured_outputs
    if structured is not None and not isinstance(structured, StructuredOutputsParams):
        raise TypeError(
            f"structured_outputs must be a StructuredOutputsParams, got {show(structured)}"
        )


MAX_LOGIT_BIAS = 100.0
"""The largest ``logit_bias`` value either way (OpenAI's bound)."""


def _logit_bias(value: object) -> dict[int, float] | None:
    """``value`` (a dict of token ids to numbers) as a dict of int to float; None when empty."""
    if not isinstance(value, dict):
        raise TypeError(f"logit_bias must be a dict of token id to number, got {show(value)}")
    bias: dict[int, float] = {}
    for token, number in value.items():
        if isinstance(token, bool) or not isinstance(token, int):
            raise TypeError(f"logit_bias keys must be token ids (ints), got {show(token)}")
        if not 0 <= token <= INT64_MAX:
            raise ValueError(
                f"logit_bias keys must be token ids in [0, 2**63 - 1], got {show(token)}"
            )
        number = _as_float(f"logit_bias[{token}]", number)
        if not -MAX_LOGIT_BIAS <= number <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias values must be in [-100, 100], got {show(number)} for token {token}"
            )
        bias[token] = number
    return bias or None


def _as_output_kind(kind: object) -> RequestOutputKind:
    if isinstance(kind, bool) or not isinstance(kind, int):
        raise TypeError(f"output_kind must be a RequestOutputKind, got {show(kind)}")
    try:
        return RequestOutputKind(kind)
    except ValueError:
        valid = ", ".join(f"{int(k)} ({k.name})" for k in RequestOutputKind)
        raise ValueError(f"output_kind must be one of {valid}, got {show(kind)}") from None


def _int_list(name: str, value: object) -> list[int]:
    """``value`` (None or a sequence of ints) as a list without duplicates."""
    if value is None:
        return []
    if type(value) is not list and (
        isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence)
    ):
        raise TypeError(f"{name} must be a list of ints, got {show(value)}")
    for item in value:
        if type(item) is not int and (isinstance(item, bool) or not isinstance(item, int)):
            raise TypeError(f"{name} must be a list of ints, got an item {show(item)}")
    return list(dict.fromkeys(value))


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not (lo <= value <= hi):
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value!r}")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Parameters for sampling one request; validated at construction.

    ``temperature`` below 1e-5 means greedy decoding (``top_p``, ``top_k`` and ``min_p`` are then
    reset to their neutral values); ``n > 1`` with greedy decoding gives ``n`` identical
    completions, as OpenAI's API does. ``stop`` strings are matched by the front end on the decoded
    text of the output (never the prompt's); ``stop_token_ids`` by the engine on token ids.

    ``min_tokens``: before that many tokens, EOS and ``stop_token_ids`` are not sampled, and a
    stop string counts only if it *ends* in the text of a later token (it may begin earlier):
    vLLM's rule, so that both engines stop a request at the same token.

    ``spaces_between_special_tokens``: special tokens left in the text
    (``skip_special_tokens=False``) are set apart from the text next to them, and from each
    other, by a space ("a </s>" rather than "a</s>"), as Hugging Face's Python tokenizers join
    them.
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
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    """Token id -> a value in [-100, 100] added to that token's logit before sampling, as in
    OpenAI's API (-100 in effect bans a token, 100 in effect forces it); ids past the
    vocabulary end the request with an error. Logprobs stay those of the model's own
    distribution."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check and normalize every field (construction and decoding do): ``TypeError`` for a
        value of the wrong type, ``ValueError`` for an invalid one, each naming the field.
        Call it again after assigning to fields (``structured_outputs`` is then only checked
        to be a :class:`StructuredOutputsParams`, which validated itself when built)."""
        _coerce_numbers(self)
        _coerce_others(self)
        if self.seed == -1:
            self.seed = None
        if _GREEDY_EPS <= self.temperature < _MIN_TEMPERATURE:
            self.temperature = _MIN_TEMPERATURE
        self._validate()
        if self.is_greedy:
            # After validation, so an invalid top_p/top_k/min_p is reported even when greedy.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature!r}")
        _check_range("temperature", self.temperature, 0.0, 2.0)
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
        if self.seed is not None and self.seed > INT64_MAX - (self.n - 1):
            # Completion i of a request with n > 1 samples with seed + i.
            raise ValueError(f"seed must be at most 2**63 - n ({self.n}), got {self.seed}")
        self._validate_lengths()
        self._validate_stops()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    def _validate_stops(self) -> None:
        stop = self.stop_strings
        if stop and not all(stop):
            raise ValueError(f"stop must not contain empty strings, got {show(stop)}")
        if stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        if any(t < 0 or t > INT64_MAX for t in self.stop_token_ids or ()):
            raise ValueError(
                "stop_token_ids must be non-negative ints below 2**63, "
                f"got {show(self.stop_token_ids)}"
            )

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


def _fields_annotated(annotation: str) -> tuple[str, ...]:
    """The fields of :class:`SamplingParams` declared with ``annotation`` (as written)."""
    return tuple(
        name for name, declared in SamplingParams.__annotations__.items() if declared == annotation
    )


# The type checks read the field groups off the declarations, so a new field is checked as its
# annotation says.
_FLOAT_FIELDS = _fields_annotated("float")
_INT_FIELDS = _fields_annotated("int")
_OPTIONAL_INT_FIELDS = _fields_annotated("int | None")
_BOOL_FIELDS = _fields_annotated("bool")
