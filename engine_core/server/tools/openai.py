"""``openai``: gpt-oss's tool calls in its harmony format, a message on the ``commentary``
channel addressed to the function, its arguments a JSON object:
``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``
then ``<|call|>`` (which ends the turn, so the text rarely holds it). The markers are special
tokens, which the text keeps, without spaces around them. Use it with the ``gpt_oss`` reasoning
parser, which reads the ``analysis`` channel as thinking and the ``final`` channel's header out of
the content.

A call is complete once its object closes (a ``<|call|>`` after it is part of its markup). Text
outside the calls is content; the header (``<|start|>assistant``) that opens a call's message is
part of its markup."""

from __future__ import annotations

from engine_core.server.tools._calls import Parsed, held_back, is_object, skip_space, value_end
from engine_core.server.tools._parser import ToolParser, register_tool_parser

__all__ = ["HarmonyToolParser"]

FRAME = "<|start|>assistant"
CALL = "<|channel|>commentary to=functions."
MESSAGE = "<|message|>"
CALL_END = "<|call|>"
_MAX_HEADER = 256
"""The most characters between a call's function name and its ``<|message|>``."""


@register_tool_parser("openai")
class HarmonyToolParser(ToolParser):
    keeps_special_tokens = True
    spaces_around_special_tokens = False
    markers = (FRAME + CALL, CALL)

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        pos = 0
        while True:
            at = text.find(CALL, pos)
            if at < 0:
                rest = text[pos:]
                keep = 0 if final else max(held_back(rest, FRAME + CALL), held_back(rest, CALL))
                parsed.content += rest[: len(rest) - keep]
                return parsed
            start = at - len(FRAME) if text.startswith(FRAME, max(pos, at - len(FRAME))) else at
            parsed.content += text[pos:start]
            name_start = at + len(CALL)
            message = text.find(MESSAGE, name_start, name_start + _MAX_HEADER)
            if message < 0:
                if final or len(text) - name_start >= _MAX_HEADER:
                    return parsed.rest_is_content(text, start)
                return parsed  # the header is still being written
            name = text[name_start:message].split("<|", 1)[0].strip()
            body = skip_space(text, message + len(MESSAGE))
            if not name or " " in name:
                return parsed.rest_is_content(text, start)
            if body == len(text):
                return parsed.rest_is_content(text, start) if final else parsed
            if text[body] != "{":
                return parsed.rest_is_content(text, start)
            end = value_end(text, body)
            if end is None:  # the object is still being written, or never closes
                return parsed.rest_is_content(text, start) if final else parsed
            arguments = text[body:end]
            if not is_object(arguments):
                return parsed.rest_is_content(text, start)
            parsed.add(name, arguments, start=start)
            pos = end
            if text.startswith(CALL_END, pos):
                pos += len(CALL_END)
            elif not final and pos < len(text) and CALL_END.startswith(text[pos:]):
                return parsed  # the end marker may be being written: not content yet
