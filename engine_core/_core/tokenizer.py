"""Tokenizers: the protocol, the built-in byte tokenizer, loading by name (HF ``tokenizer.json``
directories live in :mod:`engine_core._core.hf_tokenizer`), and prompt parsing.

A :class:`Tokenizer` turns text into token ids and back, and opens an :class:`IncrementalDecoder`
per completion so generated text can be streamed one token at a time without re-decoding what
came before and without splitting a multi-byte UTF-8 character.
"""

from __future__ import annotations

import array
import codecs
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from engine_core._core.checks import check_text, show

__all__ = [
    "ByteTokenizer",
    "IncrementalDecoder",
    "PromptInput",
    "Tokenizer",
    "load_served_tokenizer",
    "load_tokenizer",
    "output_decoder",
    "parse_prompt",
]

PromptInput = str | Mapping[str, Any]
"""A prompt: text, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}`` (optionally both)."""


class IncrementalDecoder(Protocol):
    """Decodes one completion token by token; holds bytes of an unfinished UTF-8 character."""

    def step(self, token_id: int) -> str:
        """The text that ``token_id`` completes ("" when it completes nothing yet)."""
        ...

    def flush(self) -> str:
        """The text of the tokens still held (an unfinished UTF-8 character decodes to U+FFFD
        as ``Tokenizer.decode`` has it); the stream ends here."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """What the front end needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation (tokenizer config and generation config merged)."""
        ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def all_special_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with the special tokens the tokenizer adds by itself (a BOS,
        say) unless ``add_special_tokens`` is False."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; unknown ids decode to nothing."""
        ...

    def decode_stream(
        self, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> IncrementalDecoder:
        """A decoder for the tokens generated after ``prompt_token_ids``."""
        ...

    def token_text(self, token_id: int) -> str:
        """The text one token adds after a word (a word-start piece keeps its leading space;
        special tokens show; part of a character is U+FFFD)."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of :meth:`token_text`, but a token holding part of a character has its
        own bytes."""
        ...


# -- byte tokenizer ----------------------------------------------------------------------------

_ASCII = tuple(chr(b) for b in range(128))
_BYTES = tuple(bytes((b,)) for b in range(256))


class _ByteDecoder:
    """Incremental UTF-8 decoding of byte tokens; ASCII bytes take a table lookup."""

    __slots__ = ("_utf8", "_pending", "_skip_special")

    def __init__(self, skip_special_tokens: bool) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = False  # the UTF-8 decoder holds bytes of an unfinished character
        self._skip_special = skip_special_tokens

    def step(self, token_id: int) -> str:
        if token_id < 128 and not self._pending:
            return _ASCII[token_id] if token_id >= 0 else ""
        if 0 <= token_id < 256:
            text = self._utf8.decode(_BYTES[token_id])
            self._pending = bool(self._utf8.getstate()[0])
            return text
        special = ByteTokenizer.SPECIAL_TEXT.get(token_id)
        if special is None or self._skip_special:
            return ""
        # A special token ends any unfinished character: those bytes are invalid UTF-8.
        return self.flush() + special

    def flush(self) -> str:
        if not self._pending:
            return ""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        self._pending = False
        return text


class ByteTokenizer:
    """Ids 0-255 are the bytes of the UTF-8 text, 256 is BOS and 257 EOS.

    ``encode`` adds no BOS: ``"abc"`` is ``[97, 98, 99]``.
    """

    BOS = 256
    EOS = 257
    SPECIAL_TEXT = {BOS: "<s>", EOS: "</s>"}

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS

    @property
    def all_special_ids(self) -> frozenset[int]:
        return frozenset((self.BOS, self.EOS))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # it adds no special tokens

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        decoder = _ByteDecoder(skip_special_tokens)
        text = "".join(decoder.step(t) for t in token_ids)
        return text + decoder.flush()

    def decode_stream(
        self, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> IncrementalDecoder:
        # Byte tokens never merge across the prompt boundary, so the prompt is not needed.
        return _ByteDecoder(skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < 256:
            return _BYTES[token_id]
        return self.token_text(token_id).encode()

    def __repr__(self) -> str:
        return "ByteTokenizer()"


# -- decoding outputs ---------------------------------------------------------------------------


def output_decoder(
    tokenizer: Tokenizer,
    prompt_token_ids: Sequence[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> IncrementalDecoder:
    """The decoder of a completion's text, as its sampling parameters of the same names ask."""
    decoder = tokenizer.decode_stream(prompt_token_ids, skip_special_tokens)
    if skip_special_tokens or not spaces_between_special_tokens:
        return decoder
    return _SpacedSpecialTokens(decoder, tokenizer)


class _SpacedSpecialTokens:
    """Puts a space between the text of a special token and the text before and after it."""

    __slots__ = ("_decoder", "_tokenizer", "_special_ids", "_began", "_after_special")

    def __init__(self, decoder: IncrementalDecoder, tokenizer: Tokenizer) -> None:
        self._decoder = decoder
        self._tokenizer = tokenizer
        self._special_ids = tokenizer.all_special_ids
        self._began = False
        """Some text came before."""
        self._after_special = False
        """The last text was a special token's."""

    def step(self, token_id: int) -> str:
        text = self._decoder.step(token_id)
        if token_id in self._special_ids:
            special = self._tokenizer.token_text(token_id)
            if special and text.endswith(special):
                # The decoder may hand out an unfinished character's U+FFFD before it.
                before = self._spaced(text[: -len(special)])
                text = before + (" " if self._began else "") + special
                self._began = self._after_special = True
                return text
        return self._spaced(text)

    def _spaced(self, text: str) -> str:
        if not text:
            return ""
        if self._after_special:
            text = " " + text
            self._after_special = False
        self._began = True
        return text

    def flush(self) -> str:
        return self._spaced(self._decoder.flush())


def load_tokenizer(name: str) -> Tokenizer:
    """``"byte"`` -> :class:`ByteTokenizer`; a directory -> :class:`HFTokenizer`.

    Raises ``FileNotFoundError`` when the directory has no ``tokenizer.json`` and
    ``ImportError`` (saying what to install) when the ``tokenizers`` library is missing.
    """
    if name == "byte":
        return ByteTokenizer()
    if not Path(name).is_dir():
        raise FileNotFoundError(
            f"tokenizer {name!r} is neither 'byte' nor a directory holding an HF tokenizer.json"
        )
    from engine_core._core.hf_tokenizer import HFTokenizer

    return HFTokenizer(name)


def load_served_tokenizer(model: str | None, tokenizer: str | None) -> Tokenizer:
    """The tokenizer an engine serves: ``tokenizer`` when given, else the model directory's.

    A ``model`` that is not a directory is reported as the model (``FileNotFoundError``), not
    as a tokenizer nobody named.
    """
    if model is not None and not Path(model).is_dir():
        raise FileNotFoundError(
            f"model {model!r} is not a directory: give the directory of an HF model "
            "(config.json, safetensors, tokenizer.json)"
        )
    if tokenizer is None and model is not None and not (Path(model) / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"the model directory {model!r} holds no tokenizer.json: name a tokenizer directory "
            "(or 'byte') as tokenizer"
        )
    return load_tokenizer(tokenizer or model or "byte")


def parse_prompt(prompt: PromptInput, tokenizer: Tokenizer | None) -> tuple[str | None, list[int]]:
    """The text (if any) and token ids of one prompt.

    Raises ``TypeError`` for anything but a string or a mapping with ``prompt`` (a str) and/or
    ``prompt_token_ids`` (a list of ints), and ``ValueError`` for token ids beyond 64 bits, text
    that is not valid Unicode, or text to tokenize without a tokenizer. (Whether the ids are in
    the vocabulary is the engine's to say.)
    """
    if isinstance(prompt, str):
        text: str | None = prompt
        token_ids = None
    elif isinstance(prompt, Mapping):
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if unknown:
            raise TypeError(f"unknown prompt key(s): {', '.join(map(str, unknown))}")
        text = prompt.get("prompt")
        token_ids = prompt.get("prompt_token_ids")
        if text is None and token_ids is None:
            raise TypeError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"'prompt' must be a str, got {type(text).__name__}")
    else:
        raise TypeError(
            "a prompt must be a str or a dict with 'prompt' or 'prompt_token_ids', "
            f"got {type(prompt).__name__}"
        )
    if text is not None:
        check_text("prompt", text)
    if token_ids is not None:
        return text, _token_id_list(token_ids)
    assert text is not None
    if tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer; pass 'prompt_token_ids' instead")
    return text, tokenizer.encode(text)


def _token_id_list(token_ids: object) -> list[int]:
    """``token_ids`` (a list or tuple of ints of 64 bits at most) as a list."""
    if not isinstance(token_ids, (list, tuple)):
        raise TypeError(f"'prompt_token_ids' must be a list of ints, got {show(token_ids)}")
    if set(map(type, token_ids)) - {int}:  # C speed: prompts are long
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"'prompt_token_ids' must be a list of ints, got an item {show(t)}")
    try:
        array.array("q", token_ids)  # the range check, at C speed
    except OverflowError:
        big = next(t for t in token_ids if not (-(1 << 63) <= t < 1 << 63))
        raise ValueError(
            f"'prompt_token_ids' must be ints of 64 bits at most, got {show(big)}"
        ) from None
    return list(token_ids)
