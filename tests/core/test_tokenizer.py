from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.tiny_tokenizer import save_tiny_bpe

from engine_core._core.hf_tokenizer import HFTokenizer
from engine_core._core.tokenizer import (
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    parse_prompt,
)

CORPUS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "hello there, world",
    "caf\u00e9 au lait \U0001f600",
]


def build_bpe_dir(path: Path, *, generation_eos: object = None) -> Path:
    """A tiny byte-level BPE tokenizer trained offline, saved as an HF directory."""
    save_tiny_bpe(path, CORPUS, ["<s>", "</s>", "<|end|>"])
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


def test_byte_tokenizer_ids() -> None:
    tok = ByteTokenizer()
    assert tok.encode("abc") == [97, 98, 99]
    assert tok.encode("\u00e9") == [0xC3, 0xA9]
    assert tok.vocab_size == 258
    assert tok.eos_token_ids == (257,)
    assert tok.bos_token_id == 256
    assert tok.all_special_ids == frozenset({256, 257})
    assert isinstance(tok, Tokenizer)


def test_byte_tokenizer_decode_special_tokens() -> None:
    tok = ByteTokenizer()
    ids = [256, *tok.encode("h\u00e9"), 257]
    assert tok.decode(ids) == "h\u00e9"
    assert tok.decode(ids, skip_special_tokens=False) == "<s>h\u00e9</s>"
    # An unfinished character at the end decodes to one replacement character.
    assert tok.decode([104, 0xC3]) == "h\ufffd"
    assert tok.decode([104, 9999]) == "h"


def test_byte_decode_stream_holds_incomplete_characters() -> None:
    tok = ByteTokenizer()
    stream = tok.decode_stream([97], skip_special_tokens=True)
    emoji = list("\U0001f600".encode())
    steps = [stream.step(t) for t in [*emoji, 0xC3, 0xA9, 120, 257]]
    assert steps == ["", "", "", "\U0001f600", "", "\u00e9", "x", ""]


def test_byte_decode_stream_special_token_breaks_character() -> None:
    stream = ByteTokenizer().decode_stream([], skip_special_tokens=False)
    assert [stream.step(t) for t in [0xC3, 257, 0xC3, 0xA9]] == ["", "\ufffd</s>", "", "\u00e9"]


def test_load_byte() -> None:
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_hf_tokenizer_round_trip_and_special_ids(tmp_path: Path) -> None:
    tok = load_tokenizer(str(build_bpe_dir(tmp_path / "tok")))
    assert isinstance(tok, HFTokenizer)
    text = "hello world caf\u00e9 \U0001f600"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.vocab_size == 300
    assert tok.all_special_ids == frozenset({0, 1, 2})
    assert tok.bos_token_id == 0
    assert tok.eos_token_ids == (1,)
    assert tok.decode([0, *ids, 1]) == text
    assert tok.decode([0, *ids, 1], skip_special_tokens=False) == f"<s>{text}</s>"


def test_hf_encode_adds_the_post_processors_tokens_unless_told_not_to(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.processors import TemplateProcessing

    path = build_bpe_dir(tmp_path / "tok")
    raw = RawTokenizer.from_file(str(path / "tokenizer.json"))
    raw.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    raw.save(str(path / "tokenizer.json"))
    tok = load_tokenizer(str(path))
    plain = tok.encode("hello world", add_special_tokens=False)
    assert plain and 0 not in plain
    assert tok.encode("hello world") == [0, *plain]
    assert ByteTokenizer().encode("ab", add_special_tokens=True) == [97, 98]


@pytest.mark.parametrize(("generation_eos", "expected"), [(2, (1, 2)), ([1, 2], (1, 2)), (1, (1,))])
def test_hf_eos_merges_generation_config(
    tmp_path: Path, generation_eos: object, expected: tuple[int, ...]
) -> None:
    tok = load_tokenizer(str(build_bpe_dir(tmp_path / "tok", generation_eos=generation_eos)))
    assert tok.eos_token_ids == expected


def test_hf_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="neither 'byte' nor a directory"):
        load_tokenizer(str(tmp_path / "missing"))


def test_hf_missing_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = build_bpe_dir(tmp_path / "tok")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"needs the 'tokenizers' library: pip install"):
        load_tokenizer(str(directory))


def test_parse_prompt_forms() -> None:
    tok = ByteTokenizer()
    assert parse_prompt("ab", tok) == ("ab", [97, 98])
    assert parse_prompt({"prompt": "ab"}, tok) == ("ab", [97, 98])
    assert parse_prompt({"prompt_token_ids": [5, 6]}, tok) == (None, [5, 6])
    assert parse_prompt({"prompt": "x", "prompt_token_ids": [5]}, tok) == ("x", [5])
    assert parse_prompt({"prompt_token_ids": [5]}, None) == (None, [5])


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (3, "a prompt must be a str or a dict"),
        ({"text": "x"}, "unknown prompt key"),
        ({}, "needs 'prompt' or 'prompt_token_ids'"),
        ({"prompt_token_ids": ["a"]}, "must be a list of ints"),
        ({"prompt": 5}, "'prompt' must be a str"),
    ],
)
def test_parse_prompt_rejects(prompt: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        parse_prompt(prompt, ByteTokenizer())  # type: ignore[arg-type]


def test_parse_text_prompt_needs_tokenizer() -> None:
    with pytest.raises(ValueError, match="needs a tokenizer"):
        parse_prompt("ab", None)


def test_byte_tokenizer_token_text_and_bytes() -> None:
    tok = ByteTokenizer()
    assert [tok.token_text(t) for t in (97, 0xC3, 257)] == ["a", "\ufffd", "</s>"]
    assert [tok.token_bytes(t) for t in (97, 0xC3, 257)] == [b"a", b"\xc3", b"</s>"]


def test_hf_byte_level_token_text_and_bytes(tmp_path: Path) -> None:
    tok = HFTokenizer(build_bpe_dir(tmp_path))
    for text in [" world", "caf\u00e9", " \U0001f600", "hello"]:
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(t) for t in ids) == text.encode()
    (world,) = tok.encode(" world")
    assert (tok.token_text(world), tok.token_bytes(world)) == (" world", b" world")
    # A piece of a character: U+FFFD as text, its own bytes.
    partial = tok._tokenizer.token_to_id("\u00c3")  # the byte-level piece of byte 0xC3
    assert (tok.token_text(partial), tok.token_bytes(partial)) == ("\ufffd", b"\xc3")
    assert (tok.token_text(1), tok.token_bytes(1)) == ("</s>", b"</s>")


def test_hf_byte_fallback_token_text_and_bytes(tmp_path: Path) -> None:
    from helpers.tiny_tokenizer import save_tiny_byte_fallback

    tok = HFTokenizer(save_tiny_byte_fallback(tmp_path, CORPUS, ["<unk>", "<s>", "</s>"]))
    (hello,) = tok.encode("hello")
    assert tok._tokenizer.id_to_token(hello) == "\u2581hello"
    # The word-start marker is the token's leading space, which decoding it alone strips.
    assert tok.decode([hello]) == "hello"
    assert (tok.token_text(hello), tok.token_bytes(hello)) == (" hello", b" hello")
    kana = [tok._tokenizer.token_to_id(f"<0x{b:02X}>") for b in "\u30a2".encode()]
    assert [tok.token_text(t) for t in kana] == ["\ufffd"] * 3
    assert b"".join(tok.token_bytes(t) for t in kana) == "\u30a2".encode()
    assert (tok.token_text(2), tok.token_bytes(2)) == ("</s>", b"</s>")
