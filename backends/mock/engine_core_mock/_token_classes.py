"""The token ids the mock's choice under a grammar treats apart: whitespace, and the JSON
structure's closing characters with the openers they match.

The mock has no tokenizer of its own: it reads the ids of ``"byte"`` (bytes) or the vocabulary
of ``tokenizer.json`` in the tokenizer's directory, with byte-level BPE's and SentencePiece's
spellings of whitespace (``Ġ`` for a space, ``Ċ`` for a newline, ``▁``, ``<0x0A>``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CLOSERS", "QUOTE", "TokenClasses", "token_classes", "whitespace_token_ids"]

_WHITESPACE = " \t\n\r\x0b\x0c"
# Byte-level BPE writes the bytes 0-32 as the characters 256 + byte.
_SPELLINGS = str.maketrans({chr(256 + ord(c)): c for c in _WHITESPACE} | {"\u2581": " "})
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

CLOSERS = {'"': '"', "]": "[", "}": "{"}
"""Each closing character (in the order the mock prefers them) and the opener it matches."""
_TEXT_ONLY = ("#", "@", "~")
QUOTE = 0
"""The index of ``"`` in :data:`CLOSERS` (and in :attr:`TokenClasses.closing`)."""


@dataclass(frozen=True, slots=True)
class TokenClasses:
    """The ids of a vocabulary that the mock's choice under a grammar treats apart."""

    whitespace: frozenset[int]
    """Tokens of whitespace only."""
    closing: tuple[tuple[frozenset[int], frozenset[int]], ...] = ()
    """Per closing character of :data:`CLOSERS`, in order: the tokens that are that character
    alone, and the tokens that end with its opener (after which it would close an empty
    string, array or object)."""
    text_only: frozenset[int] = frozenset()
    """Tokens of a character that JSON has only inside strings (``#``, ``@``, ``~``)."""


def _text(piece: str) -> str:
    return _BYTE_PIECE.sub(lambda m: chr(int(m.group(1), 16)), piece).translate(_SPELLINGS)


def _pieces(data: dict[str, Any]) -> list[tuple[str, int]]:
    """(piece, id) of the model's vocabulary (BPE/WordPiece: a dict; Unigram: a list of
    [piece, score]) and of the added tokens."""
    model = data.get("model") or {}
    vocab = model.get("vocab") if isinstance(model, dict) else None
    pieces: list[tuple[str, int]] = []
    if isinstance(vocab, dict):
        pieces = [(p, i) for p, i in vocab.items() if isinstance(p, str) and isinstance(i, int)]
    elif isinstance(vocab, list):
        pieces = [
            (e[0], i)
            for i, e in enumerate(vocab)
            if isinstance(e, list) and e and isinstance(e[0], str)
        ]
    for added in data.get("added_tokens") or ():
        if (
            isinstance(added, dict)
            and isinstance(added.get("content"), str)
            and isinstance(added.get("id"), int)
            and not added.get("special")
        ):
            pieces.append((added["content"], added["id"]))
    return pieces


def _classes(texts: list[tuple[str, int]]) -> TokenClasses:
    whitespace = frozenset(i for text, i in texts if text and all(c in _WHITESPACE for c in text))
    closing = tuple(
        (
            frozenset(i for text, i in texts if text == closer),
            frozenset(i for text, i in texts if text.endswith(opener)),
        )
        for closer, opener in CLOSERS.items()
    )
    text_only = frozenset(i for text, i in texts if text in _TEXT_ONLY)
    return TokenClasses(whitespace, closing, text_only)


def token_classes(tokenizer_name: str) -> TokenClasses:
    """The classes of ``tokenizer_name`` (``"byte"`` or a directory); empty when its
    vocabulary cannot be read."""
    if tokenizer_name == "byte":
        return _classes([(chr(b), b) for b in range(128)])
    try:
        data = json.loads((Path(tokenizer_name) / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return TokenClasses(frozenset())
    if not isinstance(data, dict):
        return TokenClasses(frozenset())
    return _classes([(_text(piece), i) for piece, i in _pieces(data)])


def whitespace_token_ids(tokenizer_name: str) -> frozenset[int]:
    """The ids of ``tokenizer_name`` whose text is whitespace only."""
    return token_classes(tokenizer_name).whitespace
