"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per call (the
format of Hermes, Qwen2.5 and Qwen3). Text before and between the calls is content."""

from __future__ import annotations

from engine_core.server.tools._calls import (
    Parsed,
    held_back,
    malformed,
    read_call,
    skip_space,
    value_end,
)
from engine_core.server.tools._parser import ToolParser, register_tool_parser

__all__ = ["HermesToolParser"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    markers = (OPEN,)

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                rest = text[pos:]
                keep = 0 if final else held_back(rest, OPEN)
                parsed.content += rest[: len(rest) - keep]
                return parsed
            parsed.content += text[pos:start]
            pos = skip_space(text, start + len(OPEN))
            if pos == len(text):
                return malformed(text) if final else parsed
            if text[pos] != "{":
                return malformed(text)
            end = value_end(text, pos)
            call = read_call(text[pos : end or len(text)], complete=end is not None)
            if call is None or (end is None and final):
                return malformed(text)
            parsed.calls.append(call)
            if end is None:
                return parsed
            pos = skip_space(text, end)
            if text.startswith(CLOSE, pos):
                pos += len(CLOSE)
            elif not final and CLOSE.startswith(text[pos:]):
                return parsed  # the closing tag is being written
            elif pos < len(text):
                return malformed(text)
            # An output that ends right after the object (at EOS) lacks only the closing tag.
