"""``llama3_json``: Llama 3.x's JSON tool calls, ``{"name": ..., "parameters": {...}}`` as the
whole output (optionally after ``<|python_tag|>``), several separated by ``;``. An output that
does not start with a call is content."""

from __future__ import annotations

from engine_core.server.tools._calls import Parsed, read_objects, skip_space
from engine_core.server.tools._parser import ToolParser, register_tool_parser

__all__ = ["Llama3JsonToolParser"]

PYTHON_TAG = "<|python_tag|>"


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        pos = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos += len(PYTHON_TAG)
        elif not final and PYTHON_TAG.startswith(text[pos:]):
            return Parsed()  # nothing yet says whether a call comes
        elif pos == len(text) or text[pos] != "{":
            return Parsed().rest_is_content(text, 0)
        return read_objects(text, pos, final, Parsed(), separator=";", closing=None, markup_start=0)

    def markup_start(self, text: str, start: int) -> int | None:
        # Calls are the whole output or nothing: what its first characters say.
        pos = skip_space(text, 0)
        head = text[pos : pos + len(PYTHON_TAG)]
        if pos == len(text) or head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head):
            return 0
        return None
