"""Tool calls out of a text, whole (:func:`extract_tool_calls`) or as it streams
(:class:`ToolCallStream`: content pieces and OpenAI's ``tool_calls`` deltas)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

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


def extract_tool_calls(parser: ToolParser, text: str) -> tuple[str, list[ExtractedCall]]:
    """(content, calls) of a whole output; malformed call text is all content."""
    parsed = parser.parse(text, final=True)
    if parsed.malformed or not parsed.calls:
        return text, []
    calls = [ExtractedCall(c.name or "", c.arguments or "{}") for c in parsed.calls]
    return parsed.content, calls


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One entry of a chunk's ``delta.tool_calls``: the id and name the first time a call
    shows, then pieces of its arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str


class ToolCallStream:
    """Feeds a parser the text as it streams; each :meth:`feed` says what is new. Content that
    could begin a call's markup is held back until the text says whether it does; a text that
    breaks the format before any call went out comes back as content at the end."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._text = ""
        """The text from ``_base`` on: what is kept to look for markup and to parse."""
        self._base = 0
        self._content_sent = 0
        """Content sent so far; while no call went out, a prefix of the text."""
        self._args_sent: list[int] = []
        self._lookback = max((len(m) for m in parser.markers), default=1) - 1

    @property
    def has_calls(self) -> bool:
        """Whether a call went out."""
        return bool(self._args_sent)

    def feed(self, piece: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """The new content and call deltas once ``piece`` is added (``final``: the last)."""
        self._text += piece
        text, base = self._text, self._base
        if not self._args_sent:
            found = self.parser.markup_start(text, max(0, self._content_sent - base))
            if found is None:  # all content so far: keep only what a marker could start in
                content = text[self._content_sent - base :]
                self._content_sent = base + len(text)
                keep = min(self._lookback, len(text))
                self._text = text[len(text) - keep :]
                self._base += len(text) - keep
                return content, []
            if found > 0:  # what comes before the markup is content, sent now
                content_before = text[self._content_sent - base : found]
                self._content_sent = base + found
                self._text = text = text[found:]
                self._base = base = base + found
            else:
                content_before = ""
        else:
            content_before = ""
        parsed = self.parser.parse(text, final)
        if parsed.malformed:
            if final and not self._args_sent:
                content = content_before + text[self._content_sent - base :]
                self._content_sent = base + len(text)
                return content, []
            return content_before, []
        content = content_before + parsed.content[max(0, self._content_sent - base) :]
        self._content_sent = base + len(parsed.content)
        deltas = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if index == len(self._args_sent):
                deltas.append(ToolCallDelta(index, new_call_id(), call.name, call.arguments))
                self._args_sent.append(len(call.arguments))
                continue
            sent = self._args_sent[index]
            if len(call.arguments) > sent:
                deltas.append(ToolCallDelta(index, None, None, call.arguments[sent:]))
                self._args_sent[index] = len(call.arguments)
        return content, deltas
