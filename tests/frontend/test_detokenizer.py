from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers.tiny_tokenizer import save_tiny_bpe

from engine_core._core.hf_tokenizer import HFTokenizer
from engine_core._core.tokenizer import ByteTokenizer, IncrementalDecoder
from engine_core._frontend.detokenizer import Detokenizer
from engine_core.sampling_params import SamplingParams

BYTES = ByteTokenizer()


def build_bpe_dir(path: Path) -> Path:
    """A tiny byte-level BPE tokenizer (specials <s>=0, </s>=1) saved as an HF directory."""
    corpus = ["hello world", "the quick brown fox jumps over the lazy dog"]
    save_tiny_bpe(path, corpus, ["<s>", "</s>"])
    return path


class PieceTokenizer:
    """Each token id decodes to a fixed piece of text (multi-character tokens)."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = list(pieces)

    vocab_size = 100
    eos_token_ids = (99,)
    bos_token_id = None
    all_special_ids = frozenset({99})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.pieces.index(text)]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[t] for t in token_ids if t != 99)

    def decode_stream(
        self, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> IncrementalDecoder:
        return self

    def step(self, token_id: int) -> str:
        return "" if token_id == 99 else self.pieces[token_id]

    def flush(self) -> str:
        return ""


def stream(detok: Detokenizer, steps: Sequence[Sequence[int]]) -> list[str]:
    """Feed one update per step and take the text after each (not finished)."""
    out = []
    for step in steps:
        assert detok.update(list(step)) is None
        out.append(detok.take(finished=False))
    return out


def chars(text: str) -> list[list[int]]:
    return [[b] for b in text.encode()]


def test_utf8_split_over_byte_tokens_never_yields_replacement() -> None:
    text = "a\u00e9\U0001f600b"
    detok = Detokenizer(BYTES, [97], SamplingParams())
    pieces = stream(detok, chars(text))
    assert pieces == ["a", "", "\u00e9", "", "", "", "\U0001f600", "b"]
    assert detok.take(finished=True) == ""
    assert detok.num_tokens == len(text.encode())


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_hf_incremental_matches_full_decode(tmp_path: Path, use_decode_stream: bool) -> None:
    tok = HFTokenizer(build_bpe_dir(tmp_path / "tok"), use_decode_stream=use_decode_stream)
    prompt = tok.encode("hello")
    text = " world, caf\u00e9 \U0001f600 the lazy dog"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # merges happened
    detok = Detokenizer(tok, prompt, SamplingParams())
    pieces = stream(detok, [[t] for t in ids])
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert pieces[0] == " world"


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_hf_skip_special_tokens(tmp_path: Path, use_decode_stream: bool) -> None:
    tok = HFTokenizer(build_bpe_dir(tmp_path / "tok"), use_decode_stream=use_decode_stream)
    ids = [*tok.encode("hello"), 1]
    skipped = Detokenizer(tok, [0], SamplingParams())
    kept = Detokenizer(tok, [0], SamplingParams(skip_special_tokens=False))
    assert "".join(stream(skipped, [[t] for t in ids])) == "hello"
    assert "".join(stream(kept, [[t] for t in ids])) == "hello</s>"


def test_stop_string_excluded_and_held_back() -> None:
    detok = Detokenizer(BYTES, [97], SamplingParams(stop="cd"))
    assert stream(detok, chars("abc")) == ["", "a", "b"]
    assert detok.update([ord("d")]) == "cd"
    assert detok.stop_string == "cd"
    assert detok.take(finished=True) == ""
    assert detok.num_tokens == 4


def test_stop_string_included_drops_later_tokens() -> None:
    detok = Detokenizer(BYTES, [97], SamplingParams(stop="cd", include_stop_str_in_output=True))
    assert detok.update(list(b"abcdef")) == "cd"
    assert detok.num_tokens == 4
    assert detok.take(finished=True) == "abcd"


def test_stop_string_excluded_in_one_step() -> None:
    detok = Detokenizer(BYTES, [97], SamplingParams(stop=["cd"]))
    assert detok.update(list(b"abcdef")) == "cd"
    assert detok.num_tokens == 4
    assert detok.take(finished=True) == "ab"


def test_earliest_completed_stop_wins_across_tokens() -> None:
    detok = Detokenizer(BYTES, [97], SamplingParams(stop=["cde", "bc"]))
    assert detok.update(list(b"abcdef")) == "bc"
    assert detok.num_tokens == 3
    assert detok.take(finished=True) == "a"


@pytest.mark.parametrize(
    ("stops", "expected_stop", "expected_text"),
    [
        (["cd", "ab"], "ab", "x"),  # "ab" completes first inside one token's text
        (["abc", "bc"], "abc", "x"),  # both complete at the same character: list order
        (["bc", "abc"], "bc", "xa"),
    ],
)
def test_earliest_completed_stop_wins_within_a_token(
    stops: list[str], expected_stop: str, expected_text: str
) -> None:
    tok = PieceTokenizer(["x", "abcd"])
    detok = Detokenizer(tok, [0], SamplingParams(stop=stops))
    assert detok.update([0]) is None
    assert detok.update([1]) == expected_stop
    assert detok.take(finished=True) == expected_text


def test_stop_string_across_token_boundary() -> None:
    tok = PieceTokenizer(["xa", "bc", "zz"])
    detok = Detokenizer(tok, [0], SamplingParams(stop="ab"))
    assert detok.update([0]) is None
    assert detok.take(finished=False) == "x"  # "a" is held back: it may start "ab"
    assert detok.update([1, 2]) == "ab"
    assert detok.num_tokens == 2
    assert detok.take(finished=True) == ""


def test_hold_back_releases_partial_stop_at_finish() -> None:
    detok = Detokenizer(BYTES, [97], SamplingParams(stop=["STOP", "x"]))
    assert stream(detok, chars("abcST")) == ["", "", "", "a", "b"]
    assert detok.take(finished=True) == "cST"


def test_include_stop_str_holds_nothing_back() -> None:
    params = SamplingParams(stop="STOP", include_stop_str_in_output=True)
    detok = Detokenizer(BYTES, [97], params)
    assert stream(detok, chars("abST")) == ["a", "b", "S", "T"]
    assert detok.update(list(b"OPq")) == "STOP"
    assert detok.take(finished=True) == "OP"


def test_min_tokens_makes_early_text_ineligible() -> None:
    detok = Detokenizer(BYTES, [97], SamplingParams(stop="a", min_tokens=2))
    assert detok.update(list(b"aab")) is None
    assert detok.update(list(b"ca")) == "a"
    assert detok.num_tokens == 5
    assert detok.take(finished=True) == "aabc"


@pytest.mark.parametrize(
    ("stop", "min_tokens", "early", "streamed", "then"),
    [
        # The first "ab" starts in the first (min_tokens) token; the next one is eligible.
        ("ab", 1, "ab", ["", "a"], "ab"),
        # Single-character stops within min_tokens are text; one step at a time.
        ("a", 2, "aa", ["a", "a"], "ba"),
    ],
    ids=["two-character-stop", "one-character-stop"],
)
def test_min_tokens_stop_must_start_after_min_tokens(
    stop: str, min_tokens: int, early: str, streamed: list[str], then: str
) -> None:
    """``early`` streams as ``streamed`` without stopping; of the two tokens of ``then``, the
    first does not stop either and the second completes the stop string."""
    detok = Detokenizer(BYTES, [97], SamplingParams(stop=stop, min_tokens=min_tokens))
    assert stream(detok, chars(early)) == streamed
    before, last = then
    assert detok.update([ord(before)]) is None
    assert detok.update([ord(last)]) == stop
    assert detok.take(finished=True) == "b"


@pytest.mark.parametrize(
    ("include", "skip_special", "expected"),
    [(False, False, "d"), (True, False, "d</s>"), (True, True, "d")],
)
def test_stop_by_eos_token(include: bool, skip_special: bool, expected: str) -> None:
    params = SamplingParams(include_stop_str_in_output=include, skip_special_tokens=skip_special)
    detok = Detokenizer(BYTES, [97], params)
    assert detok.update([100, 257], stop_terminated=True) is None
    assert detok.num_tokens == 2
    assert detok.take(finished=True) == expected


@pytest.mark.parametrize(("include", "expected"), [(False, "d"), (True, "de")])
def test_stop_by_stop_token_id(include: bool, expected: str) -> None:
    params = SamplingParams(stop_token_ids=[101], include_stop_str_in_output=include)
    detok = Detokenizer(BYTES, [97], params)
    assert detok.update([100]) is None
    assert detok.update([101], stop_terminated=True) is None
    assert detok.take(finished=True) == expected
    assert detok.num_tokens == 2


def test_stop_terminated_with_stop_strings_keeps_counting() -> None:
    detok = Detokenizer(BYTES, [97], SamplingParams(stop="zz"))
    assert detok.update([100, 257], stop_terminated=True) is None
    assert detok.num_tokens == 2
    assert detok.take(finished=True) == "d"


def test_detokenize_false_produces_no_text() -> None:
    detok = Detokenizer(BYTES, [97], SamplingParams(detokenize=False))
    assert not detok.decodes
    assert detok.update([100, 101]) is None
    assert detok.take(finished=True) == ""
    assert detok.num_tokens == 2


def test_no_tokenizer_produces_no_text() -> None:
    detok = Detokenizer(None, [97], SamplingParams())
    assert detok.update([100]) is None
    assert detok.take(finished=True) == ""


def finished_text(detok: Detokenizer, steps: Sequence[Sequence[int]]) -> str:
    """Everything the detokenizer hands out for ``steps`` once the completion ends."""
    text = "".join(stream(detok, steps))
    detok.finish()
    return text + detok.take(finished=True)


@pytest.mark.parametrize(
    "token_ids",
    [
        [97, 0xE2, 0x82],  # an unfinished three-byte character at the end
        [0xE2, 0xE2, 0x82],  # a broken character, then an unfinished one
        [0xF0, 0x9F, 0x98],  # three of a four-byte character
        [97, 0xC3],
        [0xC3, 0xA9, 0xFF, 98],  # an invalid byte in the middle
    ],
)
def test_final_text_is_the_tokenizers_decode_byte(token_ids: list[int]) -> None:
    detok = Detokenizer(BYTES, [97], SamplingParams())
    assert finished_text(detok, [[t] for t in token_ids]) == BYTES.decode(token_ids)


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_final_text_is_the_tokenizers_decode_hf(tmp_path: Path, use_decode_stream: bool) -> None:
    import random

    tok = HFTokenizer(build_bpe_dir(tmp_path / "tok"), use_decode_stream=use_decode_stream)
    rng = random.Random(7)
    # Single-byte tokens of bytes >= 0x80 split characters; end on one in half the cases.
    high = [tok._tokenizer.token_to_id(c) for c in ("\u00c3", "\u00a9", "\u00e2", "\u0142")]
    mismatches = []
    for case in range(40):
        ids = [rng.randrange(2, tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        ids += [rng.choice(high) for _ in range(case % 3)]
        detok = Detokenizer(tok, [5, 6], SamplingParams())
        text = finished_text(detok, [[t] for t in ids])
        if text != tok.decode(ids):
            mismatches.append((ids, text, tok.decode(ids)))
    assert mismatches == []


def test_stop_string_found_after_flush_is_not_applied() -> None:
    # The flushed tail only completes the text: the completion already ended for another reason.
    detok = Detokenizer(BYTES, [97], SamplingParams(stop=["\ufffd"]))
    assert detok.update([98, 0xE2]) is None
    detok.finish()
    assert detok.take(finished=True) == "b\ufffd"
    assert detok.stop_string is None
