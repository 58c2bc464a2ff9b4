"""``mistral``: ``[TOOL_CALLS]`` then the calls, either as a JSON list
``[{"name": ..., "arguments": {...}}, ...]`` or (newer tokenizers) as ``name[ARGS]{...}`` per
call, each after its own ``[TOOL_CALLS]``. Text before the first marker is content."""

from __future__ import annotations

import json
import re

from engine_core.server.tools._calls import (
    Parsed,
    PartialCall,
    held_back,
    malformed,
    read_objects,
    skip_space,
    value_end,
)
from engine_core.server.tools._parser import ToolParser, register_tool_parser

__all__ = ["MistralToolParser"]

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    keeps_special_tokens = True
    markers = (MARKER,)

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(MARKER)
        if start < 0:
            keep = 0 if final else held_back(text, MARKER)
            return Parsed(text[: len(text) - keep])
        parsed = Parsed(text[:start])
        pos = skip_space(text, start + len(MARKER))
        if pos == len(text):
            return malformed(text) if final else parsed
        if text[pos] == "[":
            return read_objects(text, pos + 1, final, parsed, separator=",", closing="]")
        return self._named_calls(text, pos, final, parsed)

    @staticmethod
    def _named_calls(text: str, pos: int, final: bool, parsed: Parsed) -> Parsed:
        """``name[ARGS]{...}`` calls, each but the first after its own marker."""
        while True:
            name = _NAME.match(text, pos)
            assert name is not None
            after = name.end()
            if not text.startswith(ARGS, after):
                if final or not ARGS.startswith(text[after:]) or not name.group():
                    return malformed(text) if final or text[after:] else parsed
                return parsed
            if not name.group():
                return malformed(text)
            pos = skip_space(text, after + len(ARGS))
            call = PartialCall(name.group())
            parsed.calls.append(call)
            if pos == len(text):
                return malformed(text) if final else parsed
            if text[pos] != "{":
                return malformed(text)
            end = value_end(text, pos)
            call.arguments = text[pos : end or len(text)]
            if end is None:
                return malformed(text) if final else parsed
            if not _is_object(call.arguments):
                return malformed(text)
            call.complete = True
            pos = skip_space(text, end)
            if text.startswith(MARKER, pos):
                pos = skip_space(text, pos + len(MARKER))
            elif pos < len(text) and not (not final and MARKER.startswith(text[pos:])):
                return malformed(text)
            elif pos == len(text) or not final:
                return parsed


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
