"""Incremental decoding of Hugging Face tokenizers: what a vocabulary's pieces stand for, the
context a completion's first token is decoded after, and two decoders, ``DecodeStream`` where
the ``tokenizers`` library has it, else a short window of trailing tokens re-decoded per token.

Both hand out text that never changes afterwards and that adds up to the tokenizer's decode of
the output ids alone, whatever the prompt:

- the context replayed before the first token is the prompt's last few tokens, cut before a
  character the prompt leaves unfinished (:func:`prime_tokens`);
- a byte-fallback decoder turns a whole run of ``<0xXX>`` pieces into U+FFFDs when one of them
  is invalid, which would take back characters the run already completed: bytes after text
  that ended on a byte piece start a run of their own;
- tokens still held at the end (an unfinished character) decode on their own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["Pieces", "StreamDecoder", "WindowDecoder", "prime_tokens"]

_REPLACEMENT = "\ufffd"
# Prompt tokens replayed into a fresh decoder so the first generated token decodes with the
# right context (its leading space, merges): a few are enough, more when they begin inside a
# run of bytes.
_PRIME_SIZES = (5, 10, 20)
# Trailing prompt tokens dropped at most from that context: the bytes of a character the prompt
# leaves unfinished, and special tokens after them.
_MAX_DROPPED = 8
# Tokens the window decoder keeps before dropping decoded history.
_WINDOW_TRIM = 64

ANCHOR_TEXT = "a"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """The characters byte-level BPE pieces are written in, to the bytes they stand for (GPT-2's
    table: printable bytes stand for themselves, the others are shifted past U+0100)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            alphabet[chr(0x100 + shifted)] = byte
            shifted += 1
    return alphabet


class Pieces:
    """What the vocabulary's pieces stand for, read off a ``tokenizers.Tokenizer`` once."""

    __slots__ = ("anchor", "byte_ids", "_byte_level", "_byte_fallback", "_added")

    def __init__(self, tokenizer: Any) -> None:
        anchor = tokenizer.token_to_id(ANCHOR_TEXT)
        if anchor is None or tokenizer.decode([anchor]) != ANCHOR_TEXT:
            ids = tokenizer.encode(ANCHOR_TEXT, add_special_tokens=False).ids
            anchor = ids[0] if len(ids) == 1 else None
        self.anchor: int | None = anchor
        """A token that decodes to "a" alone (text after which a token keeps its leading
        space), or None."""
        decoder = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder else {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        self._byte_level = _byte_level_alphabet() if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds
        byte_ids = (tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256))
        self.byte_ids: frozenset[int] = (
            frozenset(t for t in byte_ids if t is not None) if self._byte_fallback else frozenset()
        )
        """The ids of byte-fallback pieces (none without byte fallback)."""
        added = tokenizer.get_added_tokens_decoder()
        self._added = frozenset(t.content for t in added.values())

    @property
    def context(self) -> list[int]:
        """The context of text that follows a word: the anchor, when there is one."""
        return [] if self.anchor is None else [self.anchor]

    def raw_bytes(self, piece: str | None) -> bytes | None:
        """The bytes of a piece that stands for bytes (byte-level BPE, a byte-fallback piece);
        None for others."""
        if piece is None or piece in self._added:
            return None
        if self._byte_fallback and (match := _BYTE_PIECE.fullmatch(piece)):
            return bytes((int(match[1], 16),))
        alphabet = self._byte_level
        if alphabet is not None and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return None


def prime_tokens(tokenizer: Any, prompt_token_ids: Sequence[int], skip: bool) -> list[int]:
    """The prompt tokens a fresh decoder replays: the last few, widened at the start and cut at
    the end until their text does not end in U+FFFD (an unfinished character).

    NOTE: the bytes of a character the prompt leaves unfinished are prompt text, not context:
    the output never completes them. Its text is what its own tokens decode to (a leading
    continuation byte is U+FFFD), and no part of the prompt reaches it or a stop string.
    """
    num_tokens = len(prompt_token_ids)
    for end in range(num_tokens, max(num_tokens - _MAX_DROPPED, 0), -1):
        for size in _PRIME_SIZES:
            start = max(0, end - size)
            prime = list(prompt_token_ids[start:end])
            if not tokenizer.decode(prime, skip_special_tokens=skip).endswith(_REPLACEMENT):
                return prime
            if start == 0:
                break
    return []


def _decode_alone(tokenizer: Any, pieces: Pieces, token_ids: list[int], skip: bool) -> str:
    """The text of ``token_ids`` after a word."""
    context = pieces.context
    text: str = tokenizer.decode(context + token_ids, skip_special_tokens=skip)
    return text[len(ANCHOR_TEXT) :] if context else text


class StreamDecoder:
    """``tokenizers.decoders.DecodeStream``: one native ``step`` per token."""

    __slots__ = (
        "_tokenizer",
        "_pieces",
        "_byte_ids",
        "_skip_special",
        "_stream",
        "_held",
        "_after_byte",
    )

    def __init__(
        self, tokenizer: Any, pieces: Pieces, prompt_token_ids: Sequence[int], skip: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._pieces = pieces
        self._byte_ids = pieces.byte_ids
        self._skip_special = skip
        prime = prime_tokens(tokenizer, prompt_token_ids, skip)
        self._stream = self._new_stream(prime)
        self._held: list[int] = []
        """Ids that produced no text yet (an unfinished character, a skipped special token)."""
        self._after_byte = bool(prime) and prime[-1] in pieces.byte_ids
        """The text so far ended on a byte-fallback piece."""

    def _new_stream(self, prime: list[int]) -> Any:
        from tokenizers.decoders import DecodeStream

        try:
            return DecodeStream(ids=prime, skip_special_tokens=self._skip_special)
        except TypeError:  # tokenizers < 0.22: no priming argument
            stream = DecodeStream(skip_special_tokens=self._skip_special)
            for token_id in prime:
                stream.step(self._tokenizer, token_id)
            return stream

    def step(self, token_id: int) -> str:
        if self._after_byte and not self._held and token_id in self._byte_ids:
            self._stream = self._new_stream(self._pieces.context)  # a run of its own
        try:
            text = self._stream.step(self._tokenizer, token_id)
        except Exception:
            # The stream rejects a context that no longer decodes the same way ("Invalid
            # prefix"); the tokens not decoded yet start a fresh stream.
            return self._restart(token_id)
        return self._took(token_id, text)

    def _took(self, token_id: int, text: str | None) -> str:
        if not text:
            self._held.append(token_id)
            return ""
        if self._held:
            self._held.clear()
        self._after_byte = token_id in self._byte_ids
        return str(text)

    def _restart(self, token_id: int) -> str:
        pending, self._held = [*self._held, token_id], []
        self._stream = self._new_stream(self._pieces.context)
        texts = []
        for held_id in pending:
            try:
                text = self._stream.step(self._tokenizer, held_id)
            except Exception:
                text = None
            texts.append(self._took(held_id, text))
        return "".join(texts)

    def flush(self) -> str:
        # The held tokens come after text that ended on a whole character: they decode alone.
        if not self._held:
            return ""
        text = _decode_alone(self._tokenizer, self._pieces, self._held, self._skip_special)
        self._held.clear()
        return text


class WindowDecoder:
    """Re-decodes a short window of trailing tokens (prefix/read offsets) for each new token."""

    __slots__ = (
        "_tokenizer",
        "_pieces",
        "_skip_special",
        "_ids",
        "_prefix_offset",
        "_read_offset",
        "_after_byte",
    )

    def __init__(
        self, tokenizer: Any, pieces: Pieces, prompt_token_ids: Sequence[int], skip: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._pieces = pieces
        self._skip_special = skip
        self._ids = prime_tokens(tokenizer, prompt_token_ids, skip)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._after_byte = bool(self._ids) and self._ids[-1] in pieces.byte_ids
        """The text so far ended on a byte-fallback piece."""

    def _texts(self) -> tuple[str, str]:
        """The text of the context (prefix to read offset) and of the whole window. When the
        unread tokens change how the context decodes, the context is dropped: the unread tokens
        decode alone."""
        ids, decode, skip = self._ids, self._tokenizer.decode, self._skip_special
        prefix_text: str = decode(
            ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip
        )
        new_text: str = decode(ids[self._prefix_offset :], skip_special_tokens=skip)
        if not new_text.startswith(prefix_text):
            self._prefix_offset = self._read_offset
            prefix_text, new_text = "", decode(ids[self._read_offset :], skip_special_tokens=skip)
        return prefix_text, new_text

    def step(self, token_id: int) -> str:
        ids = self._ids
        if self._after_byte and self._read_offset == len(ids) and token_id in self._pieces.byte_ids:
            ids = self._ids = self._pieces.context  # a run of its own
            self._prefix_offset, self._read_offset = 0, len(ids)
        ids.append(token_id)
        prefix_text, new_text = self._texts()
        # A trailing U+FFFD means an unfinished UTF-8 character: wait for its next byte.
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._after_byte = token_id in self._pieces.byte_ids
        if self._prefix_offset > _WINDOW_TRIM:
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        # The unread tokens come after text that ended on a whole character: they decode alone.
        ids = self._ids
        if self._read_offset >= len(ids):
            return ""
        unread = ids[self._read_offset :]
        self._prefix_offset = self._read_offset = len(ids)
        return _decode_alone(self._tokenizer, self._pieces, unread, self._skip_special)
