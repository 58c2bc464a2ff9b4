"""Reasoning output (``--reasoning-parser``): the thinking inside ``<think>…</think>`` goes to
``reasoning_content``, the rest to ``content``; constraints apply after the thinking ends.

- ``qwen3``: an output that starts with ``<think>`` thinks until ``</think>`` (all of it, when
  the block never closes); any other output is content.
- ``deepseek_r1``: the template opens the block in the prompt, so the output thinks from its
  start (a leading ``<think>`` is dropped) until ``</think>``, all of it when that never comes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine_core._core.tokenizer import Tokenizer
from engine_core._structured.grammar import COMPACT_JSON, close_objects
from engine_core.sampling_params import StructuredOutputsParams
from engine_core.server.tools._calls import held_back

__all__ = [
    "DEFAULT_FORCED_REASONING_CHARS",
    "MAX_FORCED_REASONING_CHARS",
    "REASONING_PARSERS",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
]

START = "<think>"
END = "</think>"
DEFAULT_FORCED_REASONING_CHARS = 1000
"""The thinking a forced tool call may do by default: about 250 tokens of English."""
MAX_FORCED_REASONING_CHARS = 2000
"""The most characters a grammar bounds thinking to (llguidance's lexer limits refuse much
larger bounds)."""


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    implicit_start: bool
    """The output thinks from its start, without a ``<think>`` of its own."""

    def split(self, text: str, final: bool) -> tuple[str, str, bool]:
        """(reasoning, content, whether the thinking ended) of the text so far; while it is
        not ``final``, text that could begin a marker is held back from both."""
        stripped = text.lstrip()
        if stripped.startswith(START):
            body = stripped[len(START) :]
        elif self.implicit_start:
            body = text
        elif not final and START.startswith(stripped):
            return "", "", False  # the output may yet open a block
        else:
            return "", text, True
        end = body.find(END)
        if end < 0:
            keep = 0 if final else held_back(body, END)
            return body[: len(body) - keep], "", False
        return body[:end], body[end + len(END) :].lstrip(), True

    def reasoning_tokens(self, tokenizer: Tokenizer, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` (a whole output) are thinking: up to and with the one
        that ends the block (all when it never ends; none when the output does not think)."""
        text = tokenizer.decode(token_ids, skip_special_tokens=False)
        reasoning, _, ended = self.split(text, final=True)
        if not reasoning and not ended:
            return 0
        if not ended:
            return len(token_ids)
        if END not in text:  # no thinking at all
            return 0
        low, high = 1, len(token_ids)
        while low < high:  # the shortest prefix whose text holds the end marker
            middle = (low + high) // 2
            if END in tokenizer.decode(token_ids[:middle], skip_special_tokens=False):
                high = middle
            else:
                low = middle + 1
        return low

    def constrain(
        self,
        params: StructuredOutputsParams,
        *,
        compact: bool = False,
        max_thought_chars: int | None = None,
    ) -> StructuredOutputsParams:
        """``params`` applied after the thinking: a Lark grammar that lets the output think
        first (``compact``: JSON without whitespace, as ``disable_any_whitespace`` asks), at
        most ``max_thought_chars`` characters before the grammar closes the block (None: no
        limit; 0: no thought at all). Regexes and grammars given as such are kept as they are
        (they constrain the whole output)."""
        compact = compact or params.disable_any_whitespace
        if params.json is not None or params.json_object:
            schema: Any = {"type": "object"}
            if isinstance(params.json, str):
                try:
                    schema = json.loads(params.json)
                except (ValueError, RecursionError):
                    return params  # its compilation says what is wrong
            elif params.json is not None:
                schema = params.json
            schema = close_objects(schema)
            if compact and isinstance(schema, dict):
                schema = {**schema, "x-guidance": COMPACT_JSON}
            body = "%json " + json.dumps(schema)
        elif params.choice is not None:
            body = " | ".join(json.dumps(choice) for choice in params.choice)
        else:
            return params
        # An output that thinks from its start must end the thinking (all of it is thinking
        # until the marker); any other may write its answer at once, or open the block first.
        start = f"(?:{START})?" if self.implicit_start else START
        if max_thought_chars is None:  # ends where the model writes the marker
            thought = f'thought[suffix="{END}"]: /(?s:{start}.*)/'
        else:
            # One lexeme: at most that many characters without the marker, then the marker,
            # which the grammar forces once the characters are spent. (A <think> of its own
            # that an output thinking from its start writes counts among them: llguidance's
            # lexer gives up on such a bound after an optional <think>.)
            start = "" if self.implicit_start else START
            end = END.replace("/", "\\/")
            thought = f"thought: THOUGHT\nTHOUGHT: /(?s:{start}.{{0,{max_thought_chars}}}){end}/"
            thought += f" & ~/(?s:.*{end}.+)/"
        space = "/[ \\t\\r\\n]*/"
        block = f"thought {space}" if self.implicit_start else f"(thought {space})?"
        grammar = f"start: {block} body\n{thought}\nbody: {body}\n"
        return StructuredOutputsParams(grammar=grammar)


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", implicit_start=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser ``name``; ``ValueError`` listing the known ones otherwise."""
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}"
        )
    return REASONING_PARSERS[name]


class ReasoningStream:
    """Splits a streamed output as :meth:`ReasoningParser.split` splits it whole, looking at
    each piece once (a long thinking costs each piece the same): each :meth:`feed` gives the
    new reasoning and content, and counts the tokens as thinking up to the one that ends the
    block."""

    def __init__(self, parser: ReasoningParser, tokenizer: Tokenizer) -> None:
        self.parser = parser
        self.tokenizer = tokenizer
        self.reasoning_tokens = 0
        self._phase = "start"
        """``start`` (whether the output thinks is not known yet), ``thinking``, ``content``."""
        self._pending = ""
        """Text held back: the start of the output, or a tail that could begin ``</think>``."""
        self._content_started = False
        """Leading white space of the content after the block is dropped until this is set."""

    def feed(self, piece: str, token_ids: Sequence[int], final: bool) -> tuple[str, str]:
        """The new (reasoning, content) once ``piece`` (of ``token_ids``) is added."""
        phase = self._phase
        if phase == "content":
            return "", self._content(piece)
        text = self._pending + piece
        self._pending = ""
        if phase == "start":
            stripped = text.lstrip()
            if stripped.startswith(START):
                text = stripped[len(START) :]
            elif not final and START.startswith(stripped):
                self._pending = text  # the output may yet open a block
                self.reasoning_tokens += len(token_ids)
                return "", ""
            elif not self.parser.implicit_start:
                self._phase = "content"
                self._content_started = True
                self.reasoning_tokens = 0  # it does not think
                return "", text
            self._phase = "thinking"
        end = text.find(END)
        if end < 0:
            kept = 0 if final else held_back(text, END)
            self._pending = text[len(text) - kept :]
            self.reasoning_tokens += len(token_ids)
            return text[: len(text) - kept], ""
        self._phase = "content"
        after = text[end + len(END) :]  # all of it from this piece
        self.reasoning_tokens += self._tokens_to_end(len(piece) - len(after), token_ids)
        return text[:end], self._content(after)

    def _content(self, text: str) -> str:
        if not self._content_started:
            text = text.lstrip()
            self._content_started = bool(text)
        return text

    def _tokens_to_end(self, needed: int, token_ids: Sequence[int]) -> int:
        """How many of a piece's tokens write its first ``needed`` characters (up to the end
        of the marker)."""
        for count in range(1, len(token_ids)):
            if len(self.tokenizer.decode(token_ids[:count], skip_special_tokens=False)) >= needed:
                return count
        return len(token_ids)
