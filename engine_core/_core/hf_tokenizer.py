"""Hugging Face ``tokenizer.json`` directories (the ``tokenizers`` library, imported when one is
loaded), with their special tokens; their incremental decoders are in
:mod:`engine_core._core.hf_decoding`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine_core._core.hf_decoding import (
    ANCHOR_TEXT,
    Pieces,
    StreamDecoder,
    WindowDecoder,
)
from engine_core._core.tokenizer import IncrementalDecoder

__all__ = ["HFTokenizer"]


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
        self._pieces = Pieces(self._tokenizer)

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
        cls = StreamDecoder if self._use_decode_stream else WindowDecoder
        return cls(self._tokenizer, self._pieces, prompt_token_ids, skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        if not 0 <= token_id < self._vocab_size:
            return ""
        # After a word, so that the decoder's strip of the text's leading space (SentencePiece)
        # leaves the token's own.
        anchor = self._pieces.anchor
        if anchor is None:
            return self.decode([token_id], skip_special_tokens=False)
        text = self.decode([anchor, token_id], skip_special_tokens=False)
        return text[len(ANCHOR_TEXT) :]

    def token_bytes(self, token_id: int) -> bytes:
        raw = self._pieces.raw_bytes(self._tokenizer.id_to_token(token_id))
        return self.token_text(token_id).encode() if raw is None else raw

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"
