"""``openai``: gpt-oss's tool calls in its harmony format, a message on the ``commentary``
channel addressed to the function, its arguments a JSON object:
``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``
then ``<|call|>`` (which ends the turn, so the text rarely holds it). The markers are special
tokens, which the text keeps, without spaces around them. Use it with the ``gpt_oss`` reasoning
parser, which reads the ``analysis`` channel as thinking and the ``final`` channel's header out of
the content.

A call is complete once its object closes (a ``<|call|>`` after it is part of its markup). Text
outside the calls is content; the header (``<|start|>assistant``) that opens a call's message is
part of its markup, and the framing of the messages around the calls (a ``commentary``
preamble's or the ``final`` message's header, ``<|end|>``, ``<|return|>``) is left out of the
content. Where a call's markup breaks, its marker is content and the reading goes on after it."""

from __future__ import annotations

from engine_core.server.tools._calls import Parsed, held_back, is_object, skip_space, value_end
from engine_core.server.tools._parser import ToolParser, register_tool_parser

__all__ = ["HarmonyToolParser"]

FRAME = "<|start|>assistant"
CALL = "<|channel|>commentary to=functions."
MESSAGE = "<|message|>"
CALL_END = "<|call|>"
FRAMING = (
    *(
        f"{head}<|channel|>{channel}<|message|>"
        for head in (FRAME, "")
        for channel in ("commentary", "final")
    ),
    "<|end|>",
    "<|return|>",
)
"""The markers of the messages around the calls, left out of the content."""
_MAX_HEADER = 256
"""The most characters between a call's function name and its ``<|message|>``."""


@register_tool_parser("openai")
class HarmonyToolParser(ToolParser):
    keeps_special_tokens = True
    spaces_around_special_tokens = False
    rewrites_content = True
    markers = (FRAME + CALL, CALL, *FRAMING)

    def plain(self, text: str) -> str:
        return _unframed(text)

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        pos = 0
        while True:
            at = text.find(CALL, pos)
            if at < 0:
                rest = text[pos:]
                keep = 0 if final else max(held_back(rest, m) for m in self.markers)
                parsed.content += _unframed(rest[: len(rest) - keep])
                return parsed
            framed = at - len(FRAME) >= pos and text.startswith(FRAME, at - len(FRAME))
            start = at - len(FRAME) if framed else at
            parsed.content += _unframed(text[pos:start])
            read = _read_call(text, at + len(CALL), final)
            if read is None:
                return parsed  # the call is still being written
            if read is _BROKEN:  # its marker is content; calls may still follow
                pos = at + len(CALL)
                parsed.content += text[start:pos]
                continue
            name, arguments, pos = read
            parsed.add(name, arguments, start=start)
            if text.startswith(CALL_END, pos):
                pos += len(CALL_END)
            elif not final and pos < len(text) and CALL_END.startswith(text[pos:]):
                return parsed  # the end marker may be being written: not content yet


_BROKEN = ("", "", -1)


def _read_call(text: str, name_start: int, final: bool) -> tuple[str, str, int] | None:
    """(name, arguments, end) of the call whose function name starts at ``name_start``; None
    while it is still being written; :data:`_BROKEN` where its markup breaks."""
    message = text.find(MESSAGE, name_start, name_start + _MAX_HEADER)
    if message < 0:
        return None if not final and len(text) - name_start < _MAX_HEADER else _BROKEN
    name = text[name_start:message].split("<|", 1)[0].strip()
    if not name or " " in name:
        return _BROKEN
    body = skip_space(text, message + len(MESSAGE))
    if body == len(text):
        return _BROKEN if final else None
    if text[body] != "{":
        return _BROKEN
    end = value_end(text, body)
    if end is None:  # the object is still being written, or never closes
        return _BROKEN if final else None
    return (name, text[body:end], end) if is_object(text[body:end]) else _BROKEN


def _unframed(text: str) -> str:
    """``text`` without the messages' framing (:data:`FRAMING`)."""
    if "<|" not in text:
        return text
    for marker in FRAMING:
        text = text.replace(marker, "")
    return text
