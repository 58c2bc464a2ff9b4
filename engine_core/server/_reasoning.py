"""Reasoning output (``--reasoning-parser``): the thinking inside ``<think>…</think>`` goes to
``reasoning_content``, the rest to ``content``; constraints apply after the thinking ends.

- ``qwen3``: an output that starts with ``<think>`` thinks until ``</think>`` (all of it, when
  the block never closes); any other output is content.
- ``deepseek_r1``: the template opens the block in the prompt, so the output thinks from its
  start (a leading ``<think>`` is dropped) until ``</think>``, all of it when that never comes.
- ``gpt_oss``: gpt-oss's harmony format (its markers are special tokens, which the text then keeps,
  without spaces around them): a message on the ``analysis`` channel
  (``<|channel|>analysis<|message|>…<|end|>``) is the thinking; the ``final`` channel's header
  (``<|start|>assistant<|channel|>final<|message|>``) and the end marker (``<|return|>``) are left
  out of the content; tool calls on the ``commentary`` channel are the ``openai`` tool parser's.
  A grammar applies to the ``final`` message, after the header it writes.
"""

from __future__ import annotations

import json
import re
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
    start: str = START
    end: str = END
    content_headers: tuple[str, ...] = ()
    """Markers that may open the content (left out of it): the first that starts it."""
    content_end: str | None = None
    """A marker that may close the content (left out of it)."""
    keeps_special_tokens: bool = False
    """The markers are special tokens, which the text must keep (without spaces around
    them)."""

    def split(self, text: str, final: bool) -> tuple[str, str, bool]:
        """(reasoning, content, whether the thinking ended) of the text so far; while it is
        not ``final``, text that could begin a marker is held back from both."""
        start, end = self.start, self.end
        stripped = text.lstrip()
        if stripped.startswith(start):
            body = stripped[len(start) :]
        elif self.implicit_start:
            body = text
        elif not final and start.startswith(stripped):
            return "", "", False  # the output may yet open a block
        else:
            return "", self.content(text, final), True
        at = body.find(end)
        if at < 0:
            keep = 0 if final else held_back(body, end)
            return body[: len(body) - keep], "", False
        return body[:at], self.content(body[at + len(end) :].lstrip(), final), True

    def content(self, text: str, final: bool) -> str:
        """The content of ``text`` (all that follows the thinking): less a header that opens
        it and a marker that closes it; while not ``final``, less a head that could begin a
        header or a tail that could begin the closing marker."""
        for header in self.content_headers:
            if text.startswith(header):
                text = text[len(header) :]
                break
            if not final and header.startswith(text):
                return ""
        closing = self.content_end
        if closing is not None:
            if text.endswith(closing):
                return text[: -len(closing)]
            if not final:
                return text[: len(text) - held_back(text, closing)]
        return text

    def reasoning_tokens(self, tokenizer: Tokenizer, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` (a whole output) are thinking: up to and with the one
        that ends the block (all when it never ends; none when the output does not think)."""
        text = tokenizer.decode(token_ids, skip_special_tokens=False)
        reasoning, _, ended = self.split(text, final=True)
        if not reasoning and not ended:
            return 0
        if not ended:
            return len(token_ids)
        if self.end not in text:  # no thinking at all
            return 0
        low, high = 1, len(token_ids)
        while low < high:  # the shortest prefix whose text holds the end marker
            middle = (low + high) // 2
            if self.end in tokenizer.decode(token_ids[:middle], skip_special_tokens=False):
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
        special_tokens: bool = False,
    ) -> StructuredOutputsParams:
        """``params`` applied after the thinking: a Lark grammar that lets the output think
        first (``compact``: JSON without whitespace, as ``disable_any_whitespace`` asks), at
        most ``max_thought_chars`` characters before the grammar closes the block (None: no
        limit; 0: no thought at all). Regexes and grammars given as such are kept as they are
        (they constrain the whole output). ``special_tokens``: the tokenizer has the markers
        of a parser that :attr:`keeps_special_tokens` as special tokens (the grammar then
        names them as such; else it spells them out)."""
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
        if self.content_headers:
            return StructuredOutputsParams(
                grammar=self._channel_grammar(body, max_thought_chars, special_tokens)
            )
        # An output that thinks from its start must end the thinking (all of it is thinking
        # until the marker); any other may write its answer at once, or open the block first.
        # (With a bound, a <think> of its own that an output thinking from its start writes
        # counts among the characters: llguidance's lexer gives up on such a bound after an
        # optional <think>.)
        if max_thought_chars is None:
            start = f"(?:{START})?" if self.implicit_start else START
        else:
            start = "" if self.implicit_start else START
        thought = _thought_rule(start, END.replace("/", "\\/"), END, max_thought_chars)
        space = "/[ \\t\\r\\n]*/"
        block = f"thought {space}" if self.implicit_start else f"(thought {space})?"
        grammar = f"start: {block} body\n{thought}\nbody: {body}\n"
        return StructuredOutputsParams(grammar=grammar)

    def _channel_grammar(self, body: str, max_thought_chars: int | None, special: bool) -> str:
        """gpt-oss's: an optional thinking message, then the content's header (the one after
        a thinking message, or the one alone: :attr:`content_headers`) and ``body``."""
        after, alone = self.content_headers
        if special:  # the markers are tokens of their own: named as such
            start, end = _named(self.start), _named(self.end)
            header_after, header_alone = _named(after), _named(alone)
            bound = "*" if max_thought_chars is None else f"{{0,{max_thought_chars}}}"
            thought = f"thought: {start} THOUGHT {end}\nTHOUGHT: /(?s:.{bound})/"
        else:  # the markers are text: the thinking lexeme ends at the end marker
            header_after, header_alone = json.dumps(after), json.dumps(alone)
            thought = _thought_rule(
                re.escape(self.start), re.escape(self.end), self.end, max_thought_chars
            )
        if max_thought_chars == 0:
            return f"start: {header_alone} body\nbody: {body}\n"
        return (
            f"start: thought {header_after} body | {header_alone} body\n{thought}\nbody: {body}\n"
        )


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", implicit_start=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
    "gpt_oss": ReasoningParser(
        "gpt_oss",
        implicit_start=False,
        start="<|channel|>analysis<|message|>",
        end="<|end|>",
        content_headers=(
            "<|start|>assistant<|channel|>final<|message|>",
            "<|channel|>final<|message|>",
        ),
        content_end="<|return|>",
        keeps_special_tokens=True,
    ),
}


_SPECIAL = re.compile(r"<\|[a-z_]+\|>")


def _named(markers: str) -> str:
    """``markers`` in a Lark grammar: its special tokens named (``<|channel|>``), the text
    between them quoted."""
    parts = []
    pos = 0
    for found in _SPECIAL.finditer(markers):
        if found.start() > pos:
            parts.append(json.dumps(markers[pos : found.start()]))
        parts.append(found.group())
        pos = found.end()
    if pos < len(markers):
        parts.append(json.dumps(markers[pos:]))
    return " ".join(parts)


def _thought_rule(start: str, end: str, end_text: str, bound: int | None) -> str:
    """The Lark rule ``thought`` of a thinking block whose markers are text: ``start`` (a
    regex), then the thinking up to the marker ``end_text`` (``end``: it as a regex). With a
    ``bound``, one lexeme of at most that many characters without the marker, then the marker,
    which the grammar forces once the characters are spent; without, it ends where the model
    writes the marker."""
    if bound is None:
        return f"thought[suffix={json.dumps(end_text)}]: /(?s:{start}.*)/"
    return f"thought: THOUGHT\nTHOUGHT: /(?s:{start}.{{0,{bound}}}){end}/ & ~/(?s:.*{end}.+)/"


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
        """Text held back: the start of the output, or a tail that could begin the end marker."""
        self._content_started = False
        """Until set, the content's leading white space (after the block) is dropped and a
        header that opens it looked for."""
        self._strip_space = True
        self._head = ""
        """The content's first text, held while it could begin a header."""
        self._tail = ""
        """The content's last text, held while it could begin (or is) the closing marker."""

    def feed(self, piece: str, token_ids: Sequence[int], final: bool) -> tuple[str, str]:
        """The new (reasoning, content) once ``piece`` (of ``token_ids``) is added."""
        parser = self.parser
        start_marker, end_marker = parser.start, parser.end
        phase = self._phase
        if phase == "content":
            return "", self._content(piece, final)
        text = self._pending + piece
        self._pending = ""
        if phase == "start":
            stripped = text.lstrip()
            if stripped.startswith(start_marker):
                text = stripped[len(start_marker) :]
            elif not final and start_marker.startswith(stripped):
                self._pending = text  # the output may yet open a block
                self.reasoning_tokens += len(token_ids)
                return "", ""
            elif not parser.implicit_start:
                self._phase = "content"
                self._strip_space = False
                self.reasoning_tokens = 0  # it does not think
                return "", self._content(text, final)
            self._phase = "thinking"
        end = text.find(end_marker)
        if end < 0:
            kept = 0 if final else held_back(text, end_marker)
            self._pending = text[len(text) - kept :]
            self.reasoning_tokens += len(token_ids)
            return text[: len(text) - kept], ""
        self._phase = "content"
        after = text[end + len(end_marker) :]  # all of it from this piece
        self.reasoning_tokens += self._tokens_to_end(len(piece) - len(after), token_ids)
        return text[:end], self._content(after, final)

    def _content(self, text: str, final: bool) -> str:
        """As :meth:`ReasoningParser.content` reads the content whole, piece by piece."""
        if not self._content_started:
            text = self._head + text
            self._head = ""
            if self._strip_space:
                text = text.lstrip()
                if not text:
                    return ""
            for header in self.parser.content_headers:
                if text.startswith(header):
                    text = text[len(header) :]
                    break
                if not final and header.startswith(text):
                    self._head = text
                    return ""
            self._content_started = True
        closing = self.parser.content_end
        if closing is None:
            return text
        text = self._tail + text
        if text.endswith(closing):
            self._tail = "" if final else closing
            return text[: -len(closing)]
        keep = 0 if final else held_back(text, closing)
        self._tail = text[len(text) - keep :]
        return text[: len(text) - keep]

    def _tokens_to_end(self, needed: int, token_ids: Sequence[int]) -> int:
        """How many of a piece's tokens write its first ``needed`` characters (up to the end
        of the marker)."""
        for count in range(1, len(token_ids)):
            if len(self.tokenizer.decode(token_ids[:count], skip_special_tokens=False)) >= needed:
                return count
        return len(token_ids)
