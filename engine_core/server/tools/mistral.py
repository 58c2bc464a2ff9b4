"""``mistral``: ``[TOOL_CALLS]`` then the calls, either as a JSON list
``[{"name": ..., "arguments": {...}}, ...]`` or (newer tokenizers) as ``name[ARGS]{...}`` per
call, each after its own ``[TOOL_CALLS]``. Text before the first marker is content."""

from __future__ import annotations

import re

from engine_core.server.tools._calls import (
    Parsed,
    held_back,
    is_object,
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
            return parsed.rest_is_content(text, start) if final else parsed
        if text[pos] == "[":
            return read_objects(
                text, pos + 1, final, parsed, separator=",", closing="]", markup_start=start
            )
        return _named_calls(text, start, final, parsed)


def _named_calls(text: str, marker: int, final: bool, parsed: Parsed) -> Parsed:
    """``name[ARGS]{...}`` calls, each after its own marker (the first at ``marker``)."""
    while True:
        pos = skip_space(text, marker + len(MARKER))
        name = _NAME.match(text, pos)
        assert name is not None
        after = name.end()
        if not text.startswith(ARGS, after):
            if not final and ARGS.startswith(text[after:]):
                return parsed  # the name or the [ARGS] marker is being written
            return parsed.rest_is_content(text, marker)
        body = skip_space(text, after + len(ARGS))
        if not name.group() or body < len(text) and text[body] != "{":
            return parsed.rest_is_content(text, marker)
        end = value_end(text, body) if body < len(text) else None
        if end is None:
            return parsed.rest_is_content(text, marker) if final else parsed
        if not is_object(text[body:end]):
            return parsed.rest_is_content(text, marker)
        parsed.add(name.group(), text[body:end], start=marker)
        pos = skip_space(text, end)
        if text.startswith(MARKER, pos):
            marker = pos
        elif pos == len(text) or not final and MARKER.startswith(text[pos:]):
            return parsed  # the end, or the next call's marker being written
        else:
            return parsed.rest_is_content(text, end)
