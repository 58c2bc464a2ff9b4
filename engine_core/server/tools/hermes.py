"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per call (the
format of Hermes, Qwen2.5 and Qwen3). Text before and between the calls is content; a call is
complete at its closing tag (or at the end of the output, right after its object)."""

from __future__ import annotations

from engine_core.server.tools._calls import Parsed, held_back, read_call, skip_space, value_end
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
            body = skip_space(text, start + len(OPEN))
            if body == len(text):
                return parsed.rest_is_content(text, start) if final else parsed
            if text[body] != "{":
                return parsed.rest_is_content(text, start)
            end = value_end(text, body)
            if end is None:  # the object is still being written, or never closes
                return parsed.rest_is_content(text, start) if final else parsed
            call = read_call(text[body:end])
            if call is None:
                return parsed.rest_is_content(text, start)
            after = skip_space(text, end)
            if text.startswith(CLOSE, after):
                pos = after + len(CLOSE)
            elif after < len(text) and not (not final and CLOSE.startswith(text[after:])):
                return parsed.rest_is_content(text, start)  # other text instead of the tag
            elif not final:
                return parsed  # the closing tag may be being written
            else:
                pos = after  # the output ended right after the object: only the tag is missing
            parsed.add(*call, start=start)
