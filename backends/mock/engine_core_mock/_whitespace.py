"""Which token ids of the tokenizer are whitespace only, for the mock's choice under a grammar.

The mock has no tokenizer of its own: it reads the ids of ``"byte"`` (bytes) or the vocabulary
of ``tokenizer.json`` in the tokenizer's directory, with byte-level BPE's and SentencePiece's
spellings of whitespace (``Ġ`` for a space, ``Ċ`` for a newline, ``▁``, ``<0x0A>``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["whitespace_token_ids"]

_WHITESPACE = " \t\n\r\x0b\x0c"
# Byte-level BPE writes the bytes 0-32 as the characters 256 + byte.
_SPELLINGS = str.maketrans({chr(256 + ord(c)): c for c in _WHITESPACE} | {"\u2581": " "})
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _is_whitespace(piece: str) -> bool:
    text = _BYTE_PIECE.sub(lambda m: chr(int(m.group(1), 16)), piece).translate(_SPELLINGS)
    return bool(text) and all(c in _WHITESPACE for c in text)


def _pieces(data: dict[str, Any]) -> list[tuple[str, int]]:
    """(piece, id) of the model's vocabulary (BPE/WordPiece: a dict; Unigram: a list of
    [piece, score]) and of the added tokens."""
    model = data.get("model") or {}
    vocab = model.get("vocab") if isinstance(model, dict) else None
    pieces: list[tuple[str, int]] = []
    if isinstance(vocab, dict):
        pieces = [(p, i) for p, i in vocab.items() if isinstance(p, str) and isinstance(i, int)]
    elif isinstance(vocab, list):
        pieces = [(e[0], i) for i, e in enumerate(vocab) if isinstance(e, list) and e]
    for added in data.get("added_tokens") or ():
        if (
            isinstance(added, dict)
            and isinstance(added.get("content"), str)
            and isinstance(added.get("id"), int)
            and not added.get("special")
        ):
            pieces.append((added["content"], added["id"]))
    return pieces


def whitespace_token_ids(tokenizer_name: str) -> frozenset[int]:
    """The ids of ``tokenizer_name`` (``"byte"`` or a directory) whose text is whitespace only;
    empty when its vocabulary cannot be read."""
    if tokenizer_name == "byte":
        return frozenset(_WHITESPACE.encode())
    try:
        data = json.loads((Path(tokenizer_name) / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return frozenset()
    if not isinstance(data, dict):
        return frozenset()
    return frozenset(
        i for piece, i in _pieces(data) if isinstance(piece, str) and _is_whitespace(piece)
    )
