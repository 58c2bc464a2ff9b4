"""Checks shared by the parameter structs and the front end: what the wire can carry.

Requests travel as msgpack, which holds integers of 64 bits (``-2**63`` to ``2**64 - 1``) and
UTF-8 text only, and msgspec decodes nested containers only so deep. A value outside those
bounds must be refused where the caller passes it (``ValueError``/``TypeError`` naming the
parameter), never found out while encoding or in the engine. Messages show hostile values
shortened (a huge int as its bit length, a long string cut), so an error stays small.
"""

from __future__ import annotations

import functools
import re
import reprlib
from typing import Any

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "MAX_JSON_DEPTH",
    "UINT64_MAX",
    "check_int64",
    "check_json_text",
    "check_json_value",
    "check_text",
    "json_nests_within",
    "show",
]

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
UINT64_MAX = (1 << 64) - 1
MAX_JSON_DEPTH = 100
"""Deepest nesting of arrays and objects accepted in a JSON schema. llguidance refuses
schemas nested about 120 levels deep, and Python's ``json`` and msgspec raise
``RecursionError`` on deeper ones; real schemas stay far below this."""


class _ShortRepr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        # repr() of an int over 4300 digits raises ValueError; its size is what matters.
        if x.bit_length() > 64:
            return f"<int of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_REPR = _ShortRepr()
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 8


def show(value: Any) -> str:
    """``repr(value)``, shortened: big ints as their size, long strings and lists cut."""
    try:
        return _REPR.repr(value)
    except Exception:  # a hostile __repr__
        return f"<{type(value).__name__}>"


def check_int64(name: str, value: int) -> None:
    """``ValueError`` unless ``value`` (an int) fits a signed 64-bit integer."""
    if not (INT64_MIN <= value <= INT64_MAX):
        raise ValueError(f"{name} must be between -2**63 and 2**63 - 1, got {show(value)}")


def check_text(name: str, value: str) -> None:
    """``ValueError`` when ``value`` cannot be encoded as UTF-8 (it holds lone surrogates)."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"{name} must be valid Unicode text (no lone surrogates), got {show(value)}"
            ) from None


@functools.cache
def _nesting(depth: int) -> re.Pattern[bytes]:
    """Matches JSON text (with no escaped quotes or backslashes left in its strings) whose
    arrays and objects nest at most ``depth`` levels. Every quantifier is possessive, so the
    match never backtracks: it runs in time linear in the text, at C speed, and a text nested
    too deep fails where it first goes too deep."""
    atom = rb'[^\[\]{}"]++|"[^"]*+"'
    pattern = rb"(?:" + atom + rb")*+"
    for _ in range(depth):
        pattern = rb"(?:" + atom + rb"|[\[{]" + pattern + rb"[\]}])*+"
    return re.compile(pattern)


def json_nests_within(text: bytes, depth: int) -> bool:
    """Whether the arrays and objects of the JSON ``text`` nest at most ``depth`` levels deep
    (brackets inside strings do not count). Invalid JSON may answer False (or True): whoever
    decodes it says what is wrong with it."""
    if text.count(b"[") + text.count(b"{") <= depth:
        return True  # nearly every text: it cannot nest deeper than it has openings
    if b"\\" in text:
        # Escaped backslashes first, then escaped quotes: what is left of a string is a quote,
        # characters that are not quotes, and a quote. Outside strings JSON has no backslash.
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    return _nesting(depth).fullmatch(text) is not None


def check_json_text(name: str, text: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """``ValueError`` when the arrays and objects of the JSON ``text`` nest deeper than
    ``max_depth`` (brackets inside strings do not count). Whether ``text`` is valid JSON is
    left to whoever parses it."""
    if not json_nests_within(text.encode("utf-8", "surrogatepass"), max_depth):
        raise ValueError(f"{name} is nested deeper than {max_depth} levels")


def check_json_value(name: str, value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Check that ``value`` is made of JSON values only (dicts with str keys, lists, tuples,
    str, int, float, bool, None), nested at most ``max_depth`` deep, with ints msgpack holds:
    ``TypeError`` or ``ValueError`` naming ``name`` otherwise. Iterative: any depth is safe."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            if depth >= max_depth:
                raise ValueError(f"{name} is nested deeper than {max_depth} levels")
            if isinstance(item, dict):
                for key, child in item.items():
                    if not isinstance(key, str):
                        raise TypeError(f"{name} must have str keys only, got {show(key)}")
                    check_text(name, key)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, str):
            check_text(name, item)
        elif isinstance(item, int) and not isinstance(item, bool):
            if not (INT64_MIN <= item <= UINT64_MAX):
                raise ValueError(f"{name} holds an integer out of 64-bit range: {show(item)}")
        elif item is not None and not isinstance(item, (bool, float)):
            raise TypeError(
                f"{name} must hold JSON values only (dict, list, str, int, float, bool, None), "
                f"got {type(item).__name__}"
            )
