"""Tool calls read out of a model's text, whole or still being written.

A parser turns the text generated so far into :class:`Parsed`: the content before (and between)
the calls, each call as far as it is written (:class:`PartialCall`), and whether the text breaks
the format. The JSON helpers here read a call object while it is incomplete: its name once the
string is closed, its arguments as the raw text written so far, so streamed pieces concatenate
into exactly the arguments of the finished call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Parsed",
    "PartialCall",
    "held_back",
    "malformed",
    "read_call",
    "read_objects",
    "skip_space",
    "value_end",
]

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_SPACE = re.compile(r"\s*")


@dataclass(slots=True)
class PartialCall:
    """One tool call as far as the text has written it."""

    name: str | None = None
    """Known once its JSON string is closed."""
    arguments: str = ""
    """The raw JSON text of the arguments written so far (the whole object once complete)."""
    complete: bool = False


@dataclass(slots=True)
class Parsed:
    """What a parser read from a text: content, calls, and whether the format broke."""

    content: str = ""
    """The content read so far (with the calls' markup left out)."""
    calls: list[PartialCall] = field(default_factory=list)
    malformed: bool = False
    """The text breaks the format: the whole of it is content."""


def skip_space(text: str, pos: int) -> int:
    """The first position at or after ``pos`` that is not white space."""
    match = _SPACE.match(text, pos)
    assert match is not None
    return match.end()


def value_end(text: str, start: int) -> int | None:
    """The end of the JSON object or array starting at ``start`` (None: not closed yet). Only
    brackets and strings are followed; :func:`read_call` checks the JSON itself."""
    depth = 0
    in_string = escaped = False
    for pos in range(start, len(text)):
        char = text[pos]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return pos + 1
    return None


def read_call(text: str, complete: bool) -> PartialCall | None:
    """The call of a JSON object ``{"name": ..., "arguments" | "parameters": {...}}`` (its
    text; ``complete`` when it is closed). None when a complete object is no such call."""
    if complete:
        return _whole_call(text)
    call = PartialCall()
    name = _NAME.search(text)
    if name is not None:
        try:
            call.name = json.loads(f'"{name.group(1)}"')
        except ValueError:
            call.name = name.group(1)
    arguments = _ARGUMENTS.search(text)
    if arguments is not None:
        start = arguments.end()
        end = value_end(text, start) if text[start : start + 1] == "{" else None
        call.arguments = text[start:end] if end is not None else text[start:]
        if not call.arguments.startswith("{"):
            call.arguments = ""  # not an object (yet): nothing to stream
    return call


def _whole_call(text: str) -> PartialCall | None:
    try:
        value: Any = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = "arguments" if "arguments" in value else "parameters"
    arguments = value.get(key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            decoded = json.loads(arguments)
        except ValueError:
            return None
        return PartialCall(value["name"], arguments, True) if isinstance(decoded, dict) else None
    if not isinstance(arguments, dict):
        return None
    raw = "{}"
    found = _ARGUMENTS.search(text)
    if key in value and found is not None:
        end = value_end(text, found.end())
        if end is not None:
            raw = text[found.end() : end]
            try:
                if json.loads(raw) != arguments:  # the key matched inside another value
                    raw = json.dumps(arguments, ensure_ascii=False)
            except ValueError:
                raw = json.dumps(arguments, ensure_ascii=False)
    return PartialCall(value["name"], raw, True)


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``: held back from
    streamed content until the next text says whether the marker follows."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def read_objects(
    text: str, pos: int, final: bool, parsed: Parsed, *, separator: str, closing: str | None
) -> Parsed:
    """Read calls from ``pos`` on: JSON objects separated by ``separator`` (and white space),
    ending with ``closing`` (``"]"`` for an array whose ``[`` is behind ``pos``) or at the end of
    the text. What follows a closing bracket is content."""
    while True:
        pos = skip_space(text, pos)
        if pos == len(text):
            return malformed(text) if final and (closing or not parsed.calls) else parsed
        if closing is not None and text[pos] == closing and not parsed.calls:
            return malformed(text)  # an empty list of calls
        if text[pos] != "{":
            return malformed(text)
        end = value_end(text, pos)
        if end is None:
            if final:
                return malformed(text)
            call = read_call(text[pos:], complete=False)
            assert call is not None
            parsed.calls.append(call)
            return parsed
        whole = read_call(text[pos:end], complete=True)
        if whole is None:
            return malformed(text)
        parsed.calls.append(whole)
        pos = skip_space(text, end)
        if text.startswith(separator, pos):
            pos += len(separator)
        elif closing is not None and text.startswith(closing, pos):
            parsed.content += text[pos + len(closing) :]
            return parsed
        elif pos < len(text) or final and closing is not None:
            return malformed(text)


def malformed(text: str) -> Parsed:
    """The whole of ``text`` as content: it breaks the format."""
    return Parsed(text, malformed=True)
