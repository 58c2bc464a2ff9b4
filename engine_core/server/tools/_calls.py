"""Tool calls read out of a model's text, whole or still being written.

A parser turns the text generated so far into :class:`Parsed`: the content before (and between)
the calls and the calls whose markup is complete and valid. The markup of a call still being
written is neither: it is held back until it completes (a call) or breaks the format. From the
point where the text breaks the format, all of it is content, and the calls read before that
point stand. So reading a prefix of a text gives a prefix of what the whole text gives: content
only grows, calls are only added, and a stream never sends a call whose arguments do not parse.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Parsed",
    "ReadCall",
    "held_back",
    "is_object",
    "read_call",
    "read_objects",
    "skip_space",
    "value_end",
]

_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_SPACE = re.compile(r"\s*")
_CALL_KEYS = ("name", "arguments", "parameters")


@dataclass(frozen=True, slots=True)
class ReadCall:
    """One tool call whose markup is complete: its name and its arguments (the JSON text of an
    object), where its markup starts in the text and how much content came before it."""

    name: str
    arguments: str
    start: int = 0
    content_before: int = 0


@dataclass(slots=True)
class Parsed:
    """What a parser read from a text: content, complete calls, and whether the calls' markup
    has ended (the rest of the text, whatever comes, is content)."""

    content: str = ""
    """The content read so far (with the calls' markup left out)."""
    calls: list[ReadCall] = field(default_factory=list)
    ended: bool = False
    """No call can follow: the text broke the format (or closed the list of calls), and from
    there on all of it is content."""

    def add(self, name: str, arguments: str, start: int) -> None:
        """Add a complete call whose markup starts at ``start``."""
        self.calls.append(ReadCall(name, arguments, start, len(self.content)))

    def rest_is_content(self, text: str, pos: int) -> Parsed:
        """The text from ``pos`` on is content (the format broke, or the calls ended there)."""
        self.content += text[pos:]
        self.ended = True
        return self

    def declared(self, text: str, names: Collection[str] | None) -> Parsed:
        """The reading with the first call to a function not in ``names`` (None: any name)
        and all that follows it as content: the request did not offer that tool."""
        if names is None:
            return self
        for index, call in enumerate(self.calls):
            if call.name not in names:
                content = self.content[: call.content_before] + text[call.start :]
                return Parsed(content, self.calls[:index], ended=True)
        return self


def skip_space(text: str, pos: int) -> int:
    """The first position at or after ``pos`` that is not white space."""
    match = _SPACE.match(text, pos)
    assert match is not None
    return match.end()


_JSON_PIECE = re.compile(r'[^"\[\]{}]+|"[^"\\]*(?:\\.[^"\\]*)*"?|.', re.DOTALL)
"""What :func:`value_end` steps over at once: a run without quotes or brackets, a string
(closed, or open to the end of the text), or one character."""


def value_end(text: str, start: int) -> int | None:
    """The end of the JSON object or array starting at ``start`` (None: not closed yet). Only
    brackets and strings are followed; :func:`read_call` checks the JSON itself. Strings and
    runs between brackets are skipped by a regex, so a long value costs little to rescan."""
    depth = 0
    pos = start
    length = len(text)
    while pos < length:
        match = _JSON_PIECE.match(text, pos)
        assert match is not None  # "." matches any character
        piece = match.group()
        pos = match.end()
        if piece in ("{", "["):
            depth += 1
        elif piece in ("}", "]"):
            depth -= 1
            if depth == 0:
                return pos
    return None


def is_object(text: str) -> bool:
    """Whether ``text`` is the JSON text of an object."""
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def read_call(text: str) -> tuple[str, str] | None:
    """(name, arguments) of the JSON text of a call object, ``{"name": ..., "arguments" |
    "parameters": {...}}``; None when it is no such call: not JSON, no string name, arguments
    that are not an object (or a JSON string holding one), or a name or arguments key given
    twice (which the model meant would be a guess)."""
    objects: list[list[tuple[str, Any]]] = []

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        objects.append(pairs)  # the outermost object comes last
        return dict(pairs)

    try:
        value: Any = json.loads(text, object_pairs_hook=pairs_hook)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    keys = [key for key, _ in objects[-1] if key in _CALL_KEYS]
    if len(keys) != len(set(keys)):
        return None
    name = value["name"]
    key = "arguments" if "arguments" in value else "parameters"
    arguments = value.get(key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        return (name, arguments) if is_object(arguments) else None
    if not isinstance(arguments, dict):
        return None
    raw = json.dumps(arguments, ensure_ascii=False)
    found = _ARGUMENTS.search(text)
    if key in value and found is not None:
        end = value_end(text, found.end())
        own = text[found.end() : end] if end is not None else ""
        try:
            if json.loads(own) == arguments:  # else the key matched inside another value
                raw = own  # the model's own writing of them
        except (ValueError, RecursionError):
            pass
    return name, raw


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``: held back from
    streamed content until the next text says whether the marker follows."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def read_objects(
    text: str,
    pos: int,
    final: bool,
    parsed: Parsed,
    *,
    separator: str,
    closing: str | None,
    markup_start: int,
) -> Parsed:
    """Read calls from ``pos`` on: JSON objects separated by ``separator`` (and white space),
    ending with ``closing`` (``"]"`` for an array whose ``[`` is behind ``pos``) or at the end of
    the text. The markup starts at ``markup_start``: when no call is read, all of it is
    content; past a call, what breaks the format (or follows the closing bracket) is."""
    element = pos
    while True:
        pos = skip_space(text, pos)
        broken_at = element if parsed.calls else markup_start
        if pos == len(text):
            if final and not parsed.calls:
                return parsed.rest_is_content(text, broken_at)
            return parsed  # more may come; or, at the end, the calls before a cut stand
        if text[pos] != "{":
            return parsed.rest_is_content(text, broken_at)
        end = value_end(text, pos)
        if end is None:
            return parsed.rest_is_content(text, broken_at) if final else parsed
        call = read_call(text[pos:end])
        if call is None:
            return parsed.rest_is_content(text, broken_at)
        parsed.add(*call, start=broken_at)
        element = pos = skip_space(text, end)
        if text.startswith(separator, pos):
            element = pos = pos + len(separator)
        elif closing is not None and text.startswith(closing, pos):
            return parsed.rest_is_content(text, pos + len(closing))
        elif pos < len(text):
            return parsed.rest_is_content(text, pos)
