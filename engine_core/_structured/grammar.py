"""Grammars of structured outputs on llguidance: the spec that keys the cache, the tokenizer
llguidance needs, and compilation into a matcher.

llguidance (and numpy, for the token bitmask) come with the optional extra
``engine-core[structured]`` and are imported only when the first constrained request arrives.
Compilation runs in the engine core's grammar threads (llguidance releases the GIL while it
builds a matcher).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from engine_core.sampling_params import StructuredOutputsParams

__all__ = [
    "COMPACT_JSON",
    "INSTALL_HINT",
    "Grammar",
    "GrammarError",
    "GrammarSpec",
    "build_tokenizer",
    "canonical_schema",
    "close_objects",
    "compile_grammar",
    "import_structured",
]

INSTALL_HINT = "pip install 'engine-core[structured]'"

_BYTE_TOKENIZER = "byte"
_BYTE_BOS = 256
_BYTE_EOS = 257


class GrammarError(Exception):
    """A grammar could not be built; the message says why (it ends one request, never the
    engine)."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a constrained request asks for, in a canonical form: the key of the grammar cache.

    ``kind`` is the field of :class:`~engine_core.StructuredOutputsParams` that is set;
    ``text`` is its value as text (a JSON schema given as a dict or as valid JSON text is
    re-serialized without whitespace and with its keywords sorted, so schemas written
    differently share one entry). Properties keep their order: the grammar writes an object's
    properties in the order the schema lists them, so ``{name, age}`` and ``{age, name}`` are
    two grammars.
    """

    kind: str
    text: str
    compact: bool = False
    """JSON without whitespace between tokens (``disable_any_whitespace``)."""

    @classmethod
    def from_params(cls, params: StructuredOutputsParams) -> GrammarSpec:
        compact = params.disable_any_whitespace
        if params.json is not None:
            return cls("json", _canonical_json(params.json), compact)
        if params.json_object:
            return cls("json_object", "", compact)
        if params.regex is not None:
            return cls("regex", params.regex)
        if params.choice is not None:
            return cls("choice", json.dumps(params.choice))
        assert params.grammar is not None  # StructuredOutputsParams sets exactly one field
        return cls("grammar", params.grammar)


def _canonical_json(schema: str | dict[str, Any]) -> str:
    """``schema`` re-serialized compactly with its keywords sorted and its properties in their
    order (:func:`canonical_schema`). Text that does not parse is kept as it is (its
    compilation reports it); a dict that does not serialize raises :class:`GrammarError`."""
    try:
        value = json.loads(schema) if isinstance(schema, str) else schema
        return json.dumps(canonical_schema(value), separators=(",", ":"))
    except (ValueError, TypeError, RecursionError) as exc:
        if isinstance(schema, str):
            return schema
        raise GrammarError(f"invalid structured_outputs.json: {type(exc).__name__}: {exc}") from exc


def canonical_schema(schema: Any) -> Any:
    """``schema`` with the keys of its objects sorted, except the names in each
    ``properties``, which keep their order: the grammar writes an object's properties in the
    order its schema lists them (as OpenAI's strict mode and vLLM do), so that order is part of
    what the schema asks for, and the order of keywords is not."""
    if isinstance(schema, list):
        return [canonical_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    canonical = {}
    for key in sorted(schema):
        value = schema[key]
        if key == "properties" and isinstance(value, dict):
            # NOTE: never sorted: a model steered into another key order than the one its
            # prompt and schema show writes worse JSON, or is forced off its own reply.
            canonical[key] = {name: canonical_schema(sub) for name, sub in value.items()}
        else:
            canonical[key] = canonical_schema(value)
    return canonical


class Grammar:
    """One request's grammar state: an ``llguidance.LLMatcher`` and the EOS ids that end it
    (the :class:`~engine_core._core.request.GrammarMatcher` the scheduler advances)."""

    __slots__ = ("matcher", "eos_token_ids", "terminated")

    def __init__(self, matcher: Any, eos_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.terminated = False
        """Whether the grammar has accepted the EOS token that ends it."""

    def accept_token(self, token_id: int) -> bool:
        # A rejected token leaves the matcher in its error state; the request ends with it.
        if not self.matcher.consume_token(token_id):
            return False
        if token_id in self.eos_token_ids:
            self.terminated = True
        return True

    def is_stopped(self) -> bool:
        return bool(self.matcher.is_stopped())

    def validate_tokens(self, token_ids: list[int]) -> int:
        return int(self.matcher.validate_tokens(token_ids))


def import_structured() -> tuple[ModuleType, ModuleType]:
    """``(llguidance, numpy)``; raises :class:`GrammarError` saying what to install."""
    try:
        import llguidance
        import numpy
    except ImportError as exc:
        raise GrammarError(
            f"structured outputs need the llguidance and numpy packages ({exc}): {INSTALL_HINT}"
        ) from exc
    return llguidance, numpy


class _ByteTokens:
    """The built-in byte tokenizer as llguidance's ``TokenizerWrapper`` reads it."""

    eos_token_id = _BYTE_EOS
    bos_token_id = _BYTE_BOS
    tokens = [bytes((b,)) for b in range(256)] + [b"<s>", b"</s>"]
    special_token_ids = [_BYTE_BOS, _BYTE_EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


def build_tokenizer(tokenizer_name: str, vocab_size: int) -> Any:
    """The ``llguidance.LLTokenizer`` of the engine's tokenizer (``"byte"`` or an HF directory
    holding ``tokenizer.json``). ``vocab_size`` is the model's: an HF vocabulary is padded to it
    when the model has more ids than the tokenizer. Raises :class:`GrammarError`."""
    llguidance, _ = import_structured()
    try:
        if tokenizer_name == _BYTE_TOKENIZER:
            return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()))
        from engine_core._core.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_name)
        text = (Path(tokenizer_name) / "tokenizer.json").read_text(encoding="utf-8")
        return llguidance.LLTokenizer(
            text,
            n_vocab=vocab_size if vocab_size > tokenizer.vocab_size else None,
            eos_token=list(tokenizer.eos_token_ids) or None,
        )
    except (OSError, ImportError, ValueError) as exc:
        raise GrammarError(
            f"structured outputs cannot use the tokenizer {tokenizer_name!r}: {exc}"
        ) from exc


COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
"""llguidance's JSON options for compact JSON: no whitespace anywhere between tokens."""


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_VALUES = ("items", "additionalItems", "not", "if", "then", "else")


def close_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that lists
    ``properties`` and says nothing about other properties, as vLLM's default grammar backend
    (xgrammar's strict mode) and OpenAI's strict structured outputs read a schema.

    What is generated still validates against the schema as given; the model is only kept from
    inventing keys the schema does not name, which would otherwise be a way never to close the
    object. A schema that wants them says so (``"additionalProperties": true`` or a schema, or
    ``patternProperties``). Branches of ``allOf`` are left as they are: each names only part of
    the object's keys.
    """
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    if (
        isinstance(schema.get("properties"), dict)
        and "additionalProperties" not in schema
        and "patternProperties" not in schema
        and "unevaluatedProperties" not in schema
        and "allOf" not in schema
        and "$ref" not in schema
    ):
        closed["additionalProperties"] = False
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            closed[key] = [close_objects(item) for item in schema[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            closed[key] = {name: close_objects(item) for name, item in schema[key].items()}
    for key in _SUBSCHEMA_VALUES:
        if key in schema:
            closed[key] = close_objects(schema[key])
    if isinstance(schema.get("additionalProperties"), dict):
        closed["additionalProperties"] = close_objects(schema["additionalProperties"])
    return closed


def _grammar_text(llguidance: ModuleType, spec: GrammarSpec) -> str:
    matcher = llguidance.LLMatcher
    defaults = COMPACT_JSON if spec.compact else None
    if spec.kind == "json":
        try:
            schema = close_objects(json.loads(spec.text))
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"not valid JSON ({exc})") from exc
        return str(matcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults))
    if spec.kind == "json_object":
        return str(matcher.grammar_from_json_schema('{"type": "object"}', defaults=defaults))
    if spec.kind == "regex":
        return str(matcher.grammar_from_regex(spec.text))
    if spec.kind == "choice":
        choices = json.loads(spec.text)
        return str(matcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, choices))))
    # Lark, or GBNF (converted to Lark).
    return str(llguidance.grammar_from("grammar", spec.text))


def compile_grammar(tokenizer: Any, spec: GrammarSpec) -> Any:
    """A fresh ``llguidance.LLMatcher`` for ``spec`` (the template that requests copy). Raises
    :class:`GrammarError` naming the field and the problem."""
    llguidance, _ = import_structured()
    where = f"structured_outputs.{spec.kind}"
    try:
        grammar = _grammar_text(llguidance, spec)
    except ValueError as exc:
        raise GrammarError(f"invalid {where}: {exc}") from exc
    matcher = llguidance.LLMatcher(
        tokenizer, grammar, log_level=0, limits=llguidance.LLParserLimits(verbose_errors=False)
    )
    if matcher.is_error():
        raise GrammarError(f"invalid {where}: {_clean(matcher.get_error())}")
    if _allows_only_eos(matcher, tokenizer):
        # Nothing could be generated but EOS, which a request may not even be allowed to end
        # on yet (min_tokens): nothing could be sampled at all.
        raise GrammarError(f"invalid {where}: it matches only the empty string")
    return matcher


def _allows_only_eos(matcher: Any, tokenizer: Any) -> bool:
    allowed = int.from_bytes(matcher.compute_bitmask(), "little")
    for eos in tokenizer.eos_tokens:
        allowed &= ~(1 << eos)
    return allowed == 0


def _clean(message: str) -> str:
    return message.replace("<non-verbose/>", "").strip()
