"""Hugging Face ``tokenizer.json`` directories (the ``tokenizers`` library, imported when one is
loaded), with their special tokens and two incremental decoders: ``DecodeStream`` where the
library has it, else a short window of trailing tokens re-decoded per token."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine_core._core.tokenizer import IncrementalDecoder

__all__ = ["HFTokenizer"]

# Prompt tokens replayed into a fresh decoder so the first generated token decodes with the
# right context (its leading space, merges): a few are enough, more when they begin inside a
# run of bytes.
_PRIME_SIZES = (5, 10, 20)
# Trailing prompt tokens dropped at most from that context: the bytes of a character the prompt
# leaves unfinished, and special tokens after them.
_MAX_DROPPED = 8
# Tokens the window decoder keeps before dropping decoded history.
_WINDOW_TRIM = 64

_REPLACEMENT = "\ufffd"


def _prime(tokenizer: Any, prompt_token_ids: Sequence[int], skip: bool) -> list[int]:
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


class _StreamDecoder:
    """``tokenizers.decoders.DecodeStream``: one native ``step`` per token."""

    __slots__ = ("_tokenizer", "_skip_special", "_stream", "_held")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip
        self._stream = self._new_stream(_prime(tokenizer, prompt_token_ids, skip))
        self._held: list[int] = []
        """Ids that produced no text yet (an unfinished character, a skipped special token)."""

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
        try:
            text = self._stream.step(self._tokenizer, token_id)
        except Exception:
            # The stream rejects a context that no longer decodes the same way ("Invalid
            # prefix": byte-fallback tokens that join the bytes before them into one invalid
            # run); the tokens not decoded yet start a fresh stream.
            return self._restart(token_id)
        if not text:
            self._held.append(token_id)
            return ""
        self._held.clear()
        return str(text)

    def _restart(self, token_id: int) -> str:
        pending, self._held = [*self._held, token_id], []
        self._stream = self._new_stream([])
        pieces = []
        for held_id in pending:
            try:
                text = self._stream.step(self._tokenizer, held_id)
            except Exception:
                text = None
            if text:
                pieces.append(str(text))
                self._held.clear()
            else:
                self._held.append(held_id)
        return "".join(pieces)

    def flush(self) -> str:
        # The held tokens come after text that ended on a whole character: they decode alone.
        if not self._held:
            return ""
        text: str = self._tokenizer.decode(self._held, skip_special_tokens=self._skip_special)
        self._held.clear()
        return text


class _WindowDecoder:
    """Re-decodes a short window of trailing tokens (prefix/read offsets) for each new token."""

    __slots__ = ("_tokenizer", "_skip_special", "_ids", "_prefix_offset", "_read_offset")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip
        self._ids = _prime(tokenizer, prompt_token_ids, skip)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _texts(self) -> tuple[str, str]:
        """The text of the context (prefix to read offset) and of the whole window. When the
        unread tokens change how the context decodes (byte-fallback tokens joining the bytes
        before them), the context is dropped: the unread tokens decode alone."""
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
        ids.append(token_id)
        prefix_text, new_text = self._texts()
        # A trailing U+FFFD means an unfinished UTF-8 character: wait for its next byte.
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
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
        text: str = self._tokenizer.decode(
            ids[self._read_offset :], skip_special_tokens=self._skip_special
        )
        self._prefix_offset = self._read_offset = len(ids)
        return text


_ANCHOR_TEXT = "a"
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


class _Pieces:
    """What the vocabulary's pieces say about their bytes, read off the tokenizer once."""

    __slots__ = ("anchor", "_byte_level", "_byte_fallback", "_added")

    def __init__(self, tokenizer: Any, added: dict[int, Any]) -> None:
        anchor = tokenizer.token_to_id(_ANCHOR_TEXT)
        if anchor is None or tokenizer.decode([anchor]) != _ANCHOR_TEXT:
            ids = tokenizer.encode(_ANCHOR_TEXT, add_special_tokens=False).ids
            anchor = ids[0] if len(ids) == 1 else None
        self.anchor: int | None = anchor
        """A token that decodes to "a" alone, or None."""
        decoder = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder else {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        self._byte_level = _byte_level_alphabet() if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds
        self._added = frozenset(t.content for t in added.values())

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


def _has_decode_stream() -> bool:
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401
    except ImportError:
        return False
    return True


def _token_content(value: Any) -> str | None:
    """A special token from ``tokenizer_config.json``: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (``tokenizers`` library) with its special tokens.

    EOS ids merge ``tokenizer_config.json`` (``eos_token``) and ``generation_config.json``
    (``eos_token_id``, an int or a list).
    """

    def __init__(self, directory: str | Path, *, use_decode_stream: bool | None = None) -> None:
        path = Path(directory)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {str(path)!r}: the tokenizer must be a directory holding "
                "an HF tokenizer.json, or 'byte' for the built-in byte tokenizer"
            )
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:
            raise ImportError(
                f"loading the tokenizer in {str(path)!r} needs the 'tokenizers' library: "
                "pip install 'engine-core[tokenizers]' (or pip install tokenizers)"
            ) from exc
        self.path = path
        self._tokenizer = _HFTokenizer.from_file(str(tokenizer_file))
        self._vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self._use_decode_stream = (
            _has_decode_stream() if use_decode_stream is None else use_decode_stream
        )
        added = self._tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        eos: list[int] = []
        eos_text = _token_content(config.get("eos_token"))
        if eos_text is not None and (eos_id := self._tokenizer.token_to_id(eos_text)) is not None:
            eos.append(eos_id)
        gen_eos = generation.get("eos_token_id")
        for token_id in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(token_id, int) and token_id not in eos:
                eos.append(token_id)
        self._eos_token_ids = tuple(eos)
        bos_text = _token_content(config.get("bos_token"))
        bos = self._tokenizer.token_to_id(bos_text) if bos_text is not None else None
        if bos is None and isinstance(generation.get("bos_token_id"), int):
            bos = generation["bos_token_id"]
        self._bos_token_id: int | None = bos
        self._pieces = _Pieces(self._tokenizer, added)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [t for t in token_ids if 0 <= t < self._vocab_size]
        text: str = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def decode_stream(
        self, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> IncrementalDecoder:
        cls = _StreamDecoder if self._use_decode_stream else _WindowDecoder
        return cls(self._tokenizer, prompt_token_ids, skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        if not 0 <= token_id < self._vocab_size:
            return ""
        # After a word, so that the decoder's strip of the text's leading space (SentencePiece)
        # leaves the token's own.
        anchor = self._pieces.anchor
        if anchor is None:
            return self.decode([token_id], skip_special_tokens=False)
        text = self.decode([anchor, token_id], skip_special_tokens=False)
        return text[len(_ANCHOR_TEXT) :]

    def token_bytes(self, token_id: int) -> bytes:
        raw = self._pieces.raw_bytes(self._tokenizer.id_to_token(token_id))
        return self.token_text(token_id).encode() if raw is None else raw

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"
