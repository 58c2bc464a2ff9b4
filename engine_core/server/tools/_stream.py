"""Tool calls out of a text, whole (:func:`extract_tool_calls`) or as it streams
(:class:`ToolCallStream`: content pieces and OpenAI's ``tool_calls`` deltas). Both read the
text the same way, so a stream's content and calls add up to those of the whole text."""

from __future__ import annotations

import secrets
from collections.abc import Collection
from dataclasses import dataclass

from engine_core.server.tools._calls import Parsed
from engine_core.server.tools._parser import ToolParser

__all__ = ["ExtractedCall", "ToolCallDelta", "ToolCallStream", "extract_tool_calls", "new_call_id"]


def new_call_id() -> str:
    """A fresh tool-call id."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True, slots=True)
class ExtractedCall:
    """A finished call: its name and arguments (a JSON object as text)."""

    name: str
    arguments: str


def _read(parser: ToolParser, text: str, final: bool, names: Collection[str] | None) -> Parsed:
    return parser.parse(text, final).declared(text, names)


def extract_tool_calls(
    parser: ToolParser, text: str, names: Collection[str] | None = None
) -> tuple[str, list[ExtractedCall]]:
    """(content, calls) of a whole output: the calls whose markup is complete and valid and
    that name one of ``names`` (None: any function), up to where the text breaks the format;
    the rest is content."""
    parsed = _read(parser, text, True, names)
    return parsed.content, [ExtractedCall(c.name, c.arguments) for c in parsed.calls]


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One entry of a chunk's ``delta.tool_calls``: a call as a whole, its id, name and
    arguments (a call goes out once its markup is complete, so its arguments always parse)."""

    index: int
    id: str
    name: str
    arguments: str


class ToolCallStream:
    """Feeds a parser the text as it streams; each :meth:`feed` says what is new. Content that
    could begin a call's markup, and the markup of a call still being written, are held back
    until the text says what they are: a call sent whole, or content."""

    def __init__(self, parser: ToolParser, names: Collection[str] | None = None) -> None:
        self.parser = parser
        self.names = names
        self._text = ""
        """The text kept: where markup could start, or (once it did) from its start on."""
        self._in_markup = False
        """The markup started (at the start of ``_text``): the text from there on is parsed."""
        self._content_sent = 0
        """The characters of ``_text`` (or of its reading's content, once the markup started)
        that went out as content."""
        self._calls_sent = 0
        self._ended = False
        """The markup ended, or can no longer start: every later piece is content as it comes."""

    @property
    def has_calls(self) -> bool:
        """Whether a call went out."""
        return self._calls_sent > 0

    def feed(self, piece: str, final: bool) -> list[str | ToolCallDelta]:
        """What is new once ``piece`` is added (``final``: the last), in the text's order:
        content (strings) and calls."""
        if self._ended:
            return [piece] if piece else []
        self._text += piece
        parts: list[str | ToolCallDelta] = []
        if not self._in_markup:
            found = self.parser.markup_start(self._text, 0)
            if found is None:  # all content so far
                # A format whose markup has no marker can only start the output.
                self._ended = not self.parser.markers
                return _content(parts, self._send_content(len(self._text)))
            _content(parts, self._send_content(found))  # parsing starts at the markup
            self._in_markup = True
        text = self._text
        parsed = _read(self.parser, text, final, self.names)
        sent = self._content_sent
        for index, call in enumerate(parsed.calls[self._calls_sent :], self._calls_sent):
            _content(parts, parsed.content[sent : call.content_before])
            sent = max(sent, call.content_before)
            parts.append(ToolCallDelta(index, new_call_id(), call.name, call.arguments))
        _content(parts, parsed.content[sent:])
        self._content_sent = len(parsed.content)
        self._calls_sent = len(parsed.calls)
        if parsed.ended:
            self._ended = True
            self._text = ""
        elif (
            not parsed.calls
            and parsed.content
            and not self.parser.rewrites_content
            and text.startswith(parsed.content)
        ):
            # No markup after all where it seemed to start (a tail that could have begun a
            # marker did not): look for it afresh past that content.
            self._text = text[len(parsed.content) :]
            self._content_sent = 0
            self._in_markup = False
        return parts

    def _send_content(self, end: int) -> str:
        """The unsent content of the text up to ``end``; the text from there on is kept. (No
        marker can straddle ``end``: :meth:`ToolParser.markup_start` would have found its
        first characters at the end of the text.)"""
        content = self._text[self._content_sent : end]
        self._text = self._text[end:]
        self._content_sent = 0
        return content


def _content(parts: list[str | ToolCallDelta], text: str) -> list[str | ToolCallDelta]:
    """``parts`` with the content ``text`` added (when there is any)."""
    if text:
        parts.append(text)
    return parts
