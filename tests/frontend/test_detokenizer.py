from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers.tiny_tokenizer import save_tiny_bpe

from engine_core._core.hf_tokenizer import HFTokenizer
from engine_core._core.tokenizer import ByteTokenizer, IncrementalDecoder
from engine_core._frontend.detokenizer import Detokenizer, LogprobsDecoder
from engine_core.abc import TokenLogprobs
from engine_core.outputs import Logprob
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

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        return self.token_text(token_id).encode()

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
    unspaced = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(stream(skipped, [[t] for t in ids])) == "hello"
    assert "".join(stream(kept, [[t] for t in ids])) == "hello </s>"
    assert "".join(stream(Detokenizer(tok, [0], unspaced), [[t] for t in ids])) == "hello</s>"


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


def test_min_tokens_stop_counts_when_it_ends_after_min_tokens() -> None:
    # As in vLLM: prompt "a", greedy "bcdef", stop "bc", min_tokens=1: "bc" begins in the first
    # token and ends in the second, so it stops the completion there.
    detok = Detokenizer(BYTES, [97], SamplingParams(stop="bc", min_tokens=1))
    assert stream(detok, chars("b")) == [""]
    assert detok.update([ord("c")]) == "bc"
    assert detok.num_tokens == 2
    assert detok.take(finished=True) == ""


def test_min_tokens_stop_within_min_tokens_is_text() -> None:
    # Single-character stops within min_tokens are text; one step at a time.
    detok = Detokenizer(BYTES, [97], SamplingParams(stop="a", min_tokens=2))
    assert stream(detok, chars("aa")) == ["a", "a"]
    assert detok.update([ord("b")]) is None
    assert detok.update([ord("a")]) == "a"
    assert detok.take(finished=True) == "b"


@pytest.mark.parametrize(
    ("include", "skip_special", "expected"),
    [(False, False, "d"), (True, False, "d </s>"), (True, True, "d")],
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


# -- streaming with stop strings, several characters per token ------------------------------------


@pytest.mark.parametrize("stop", ["Z", "ZZ", "ZZZ", "ZZZZZZ"])
@pytest.mark.parametrize("include", [False, True])
def test_multi_character_tokens_stream_each_character_once(stop: str, include: bool) -> None:
    """Each step's take is the text that became final, never text already handed out."""
    pieces = ["abcd", "ef", "g", "hijklmn", "o", "pq"]
    tok = PieceTokenizer(pieces)
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    detok = Detokenizer(tok, [0], params)
    held = 0 if include else len(stop) - 1

    def final(text: str) -> str:
        return text[: max(0, len(text) - held)]

    text = ""
    for token, piece in enumerate(pieces):
        taken = stream(detok, [[token]])[0]
        text_before, text = text, text + piece
        # Everything but the held-back characters, and only the characters new to this take.
        assert final(text_before) + taken == final(text)
    assert final(text) + detok.take(finished=True) == text


def test_multi_character_tokens_in_several_steps_then_a_stop() -> None:
    tok = PieceTokenizer(["abcd", "bcde", "fdef", "xSTO", "Pyz"])
    detok = Detokenizer(tok, [0], SamplingParams(stop="STOP"))
    assert stream(detok, [[0], [1], [2]]) == ["a", "bcdb", "cdef"]
    assert detok.update([3, 4]) == "STOP"
    assert detok.take(finished=True) == "defx"


def test_a_token_without_text_does_not_end_the_step() -> None:
    tok = PieceTokenizer(["ab", "cd", "ef"])
    detok = Detokenizer(tok, [0], SamplingParams(stop="zz"))
    # 99 decodes to nothing (a special token skipped), mid-step.
    assert detok.update([0, 99, 1, 99, 2]) is None
    assert detok.num_tokens == 5
    assert detok.take(finished=True) == "abcdef"
    stopping = Detokenizer(tok, [0], SamplingParams(stop="de"))
    assert stopping.update([0, 99, 1, 2]) == "de"
    assert stopping.num_tokens == 4
    assert stopping.take(finished=True) == "abc"


def test_a_token_without_text_within_min_tokens_does_not_end_the_step() -> None:
    tok = PieceTokenizer(["ab", "cd", "ef"])
    detok = Detokenizer(tok, [0], SamplingParams(stop="e", min_tokens=3))
    assert detok.update([0, 99, 1, 2]) == "e"
    assert detok.num_tokens == 4
    assert detok.take(finished=True) == "abcd"


@pytest.mark.parametrize(
    ("step", "num_tokens", "text"),
    [
        ([0], 1, "a"),  # twice in one token's text
        ([1, 2, 1, 2], 2, "a"),  # twice in one step, over several tokens
        ([3, 1, 2, 3, 0], 3, "ca"),
    ],
)
def test_a_stop_string_twice_in_a_step_cuts_at_the_first(
    step: list[int], num_tokens: int, text: str
) -> None:
    tok = PieceTokenizer(["aSTOPbSTOPc", "aST", "OPb", "c"])
    detok = Detokenizer(tok, [0], SamplingParams(stop="STOP"))
    assert detok.update(step) == "STOP"
    assert detok.num_tokens == num_tokens
    assert detok.take(finished=True) == text


def test_finish_adds_the_decoders_tail_with_stop_strings() -> None:
    detok = Detokenizer(BYTES, [97], SamplingParams(stop="zz"))
    assert stream(detok, [[98, 99], [0xE2, 0x82]]) == ["b", ""]
    detok.finish()
    assert detok.take(finished=True) == "c\ufffd"


def test_one_character_stops_after_min_tokens_taken_step_by_step() -> None:
    # Without overlap the taken text leaves the buffer: what was ineligible goes with it.
    detok = Detokenizer(BYTES, [97], SamplingParams(stop="a", min_tokens=2))
    assert stream(detok, chars("aa")) == ["a", "a"]
    assert detok.update([ord("a")]) == "a"
    assert detok.num_tokens == 3
    assert detok.take(finished=True) == ""


def test_without_text_every_update_counts_its_tokens() -> None:
    detok = Detokenizer(None, [97], SamplingParams())
    assert detok.update([100, 101]) is None
    assert detok.update([102]) is None
    assert detok.num_tokens == 3


def test_an_included_stop_string_may_start_in_text_already_taken() -> None:
    params = SamplingParams(stop="abc", include_stop_str_in_output=True)
    detok = Detokenizer(BYTES, [97], params)
    assert stream(detok, chars("xab")) == ["x", "a", "b"]
    assert detok.update([ord("c"), ord("d")]) == "abc"
    assert detok.num_tokens == 4
    assert detok.take(finished=True) == "c"


def test_min_tokens_stays_in_force_after_the_buffer_is_trimmed() -> None:
    detok = Detokenizer(BYTES, [97], SamplingParams(stop=["ab"], min_tokens=6))
    # The first "ab" ends within the first six tokens; the second after them.
    assert stream(detok, chars("wxabyza")) == ["", "w", "x", "a", "b", "y", "z"]
    assert detok.update([ord("b")]) == "ab"
    assert detok.num_tokens == 8
    assert detok.take(finished=True) == ""


def test_a_stop_string_may_begin_within_min_tokens_and_end_after() -> None:
    detok = Detokenizer(BYTES, [97], SamplingParams(stop=["zab"], min_tokens=4))
    # "zab" begins at the fourth token and ends at the sixth: it counts (vLLM's rule).
    assert stream(detok, chars("wxyza")) == ["", "", "w", "x", "y"]
    assert detok.update([ord("b")]) == "zab"
    assert detok.take(finished=True) == ""


class CountingTokenizer(PieceTokenizer):
    def __init__(self, pieces: Sequence[str]) -> None:
        super().__init__(pieces)
        self.asked: list[int] = []

    def token_text(self, token_id: int) -> str:
        self.asked.append(token_id)
        return "<eos>" if token_id == 99 else super().token_text(token_id)


def test_logprobs_decoder_asks_each_candidates_text_once_special_tokens_included() -> None:
    tok = CountingTokenizer(["a", "b"])
    decoder = LogprobsDecoder(tok)
    entry = TokenLogprobs([1, 0, 99], [-0.1, -1.0, -2.0], [1, 2, 3])
    expected = {1: Logprob(-0.1, 1, "b"), 0: Logprob(-1.0, 2, "a"), 99: Logprob(-2.0, 3, "<eos>")}
    assert decoder.position(entry, decode=True) == expected
    assert decoder.position(entry, decode=True) == expected
    assert tok.asked == [1, 0, 99]
    assert decoder.position(entry, decode=False) == {
        1: Logprob(-0.1, 1),
        0: Logprob(-1.0, 2),
        99: Logprob(-2.0, 3),
    }
    assert LogprobsDecoder(None).token_text(0) is None
    assert LogprobsDecoder(None).position(entry, decode=True)[99] == Logprob(-2.0, 3)


def test_logprobs_decoder_rejects_an_entry_of_uneven_lengths() -> None:
    with pytest.raises(ValueError):
        LogprobsDecoder(None).position(TokenLogprobs([1, 2], [-0.1], [1, 2]), decode=False)


@pytest.mark.parametrize(
    ("token_ids", "spaced", "unspaced"),
    [
        ([98, 257, 99], "b </s> c", "b</s>c"),
        ([256, 257], "<s> </s>", "<s></s>"),  # nothing before the first: no space
        ([98, 0xC3, 257, 0xC3, 0xA9], "b\ufffd </s> \u00e9", "b\ufffd</s>\u00e9"),
    ],
)
def test_spaces_between_special_tokens(token_ids: list[int], spaced: str, unspaced: str) -> None:
    for spaces, expected in [(True, spaced), (False, unspaced)]:
        params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        detok = Detokenizer(BYTES, [97], params)
        assert finished_text(detok, [[t] for t in token_ids]) == expected
    # Skipped special tokens leave no space behind.
    detok = Detokenizer(BYTES, [97], SamplingParams(spaces_between_special_tokens=True))
    assert finished_text(detok, [[t] for t in token_ids]) == BYTES.decode(token_ids)


def test_a_stop_string_begins_in_the_completion_not_before_it() -> None:
    # The automaton starts at its root: "b" alone does not complete "ab", whatever the prompt
    # ("a" here) ended with.
    detok = Detokenizer(BYTES, [97], SamplingParams(stop=["ab"]))
    assert detok.update([ord("b"), ord("c")]) is None
    assert detok.take(finished=True) == "bc"
