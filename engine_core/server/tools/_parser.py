"""The tool-call parser interface and its registry (``--tool-call-parser NAME``).

A format is one module: a :class:`ToolParser` subclass decorated with
:func:`register_tool_parser`, listed in :data:`_BUILTIN_MODULES` (imported on first lookup).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import ClassVar, TypeVar

from engine_core.server.tools._calls import Parsed, held_back

__all__ = ["ToolParser", "get_tool_parser", "register_tool_parser", "tool_parser_names"]

P = TypeVar("P", bound="type[ToolParser]")

_BUILTIN_MODULES = ("hermes", "llama3_json", "mistral", "openai")
_PARSERS: dict[str, type[ToolParser]] = {}


class ToolParser:
    """Reads tool calls out of a model's text. :meth:`parse` is called with the text written
    so far (``final``: the text is complete); it must read a prefix of the text as it reads the
    whole (the content and the calls only grow) and never raise on text that breaks its format
    (``Parsed(text, malformed=True)``).

    A stream calls :meth:`markup_start` first: text before the point it gives is content, and
    :meth:`parse` sees only the text from there, so that plain content costs each piece the
    same however long the output grows."""

    name: ClassVar[str]
    keeps_special_tokens: ClassVar[bool] = False
    """The format's markers are special tokens, which the text must keep."""
    spaces_around_special_tokens: ClassVar[bool] = True
    """Whether the format reads kept special tokens with spaces written around them (the
    detokenizer's default, ``spaces_between_special_tokens``)."""
    markers: ClassVar[tuple[str, ...]] = ()
    """Strings that open the calls' markup (none: it may start anywhere)."""

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    rewrites_content: ClassVar[bool] = False
    """The content is not the text as written (the format frames its messages): see
    :meth:`plain`."""

    def plain(self, text: str) -> str:
        """The content of ``text`` when it holds no call: the text as written, or (a format
        that :attr:`rewrites_content`) the text without its framing."""
        return text

    def markup_start(self, text: str, start: int) -> int | None:
        """Where markup could begin in ``text``, searching from ``start`` (before which none
        does): the first marker, or a tail that could begin one; None when nothing can, so
        the text so far is all content. :meth:`parse` must read ``text`` as ``text[:i]`` of
        content followed by what it reads of ``text[i:]``."""
        if not self.markers:
            return 0
        found: int | None = None
        for marker in self.markers:
            index = text.find(marker, start)
            if index < 0:
                kept = held_back(text, marker)
                index = len(text) - kept if kept else -1
            if index >= 0 and (found is None or index < found):
                found = index
        return found


def register_tool_parser(name: str) -> Callable[[P], P]:
    """Class decorator: the parser that ``--tool-call-parser name`` selects."""

    def register(cls: P) -> P:
        cls.name = name
        _PARSERS[name] = cls
        return cls

    return register


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(f"engine_core.server.tools.{module}")


def tool_parser_names() -> list[str]:
    """The names of the registered parsers."""
    _load_builtins()
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    """A parser of the format ``name``; ``ValueError`` listing the known ones otherwise."""
    _load_builtins()
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(_PARSERS))}")
    return _PARSERS[name]()
