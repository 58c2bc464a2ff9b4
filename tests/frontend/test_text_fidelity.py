"""Differential tests of output text: random token sequences (ids that cut multi-byte
characters, special tokens mid-stream, prompts ending inside a character) go through the
output processor, and what it streams is compared with the tokenizer's own ``decode`` of the
output ids alone, on a byte-level BPE with multi-byte pieces and on a SentencePiece-style
tokenizer with byte fallback."""

from __future__ import annotations

import pytest
from helpers.tiny_tokenizer import save_tiny_bpe, save_tiny_byte_fallback
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core._core.engine_io import EngineCoreOutputs, FinishedRequest
from engine_core._core.hf_tokenizer import HFTokenizer
from engine_core._frontend.output_processor import OutputProcessor
from engine_core.sampling_params import RequestOutputKind, SamplingParams

CORPUS = [
    "Hello brown fox, the quick brown fox jumps over the lazy dog",
    "He said hello world",
    "こんにちは 世界 カタカナ ひらがな 東京 大阪",
]
WORDS = ["Hello", " brown", " He", " the", " ア", " 東京", "😀", "é", " a", "\n"]
"""Text the outputs are partly made of, so that whole characters and merges occur too."""
ANCHOR = "Hello"
"""A word decoded before the output ids in the reference, so that the decoder's strip of the
text's one leading space (SentencePiece) does not apply to them: they are text after a word."""


@pytest.fixture(
    scope="module",
    params=[
        ("byte_level", True),
        ("byte_fallback", True),
        ("byte_level", False),
        ("byte_fallback", False),
    ],
    ids=["byte_level", "byte_fallback", "byte_level-window", "byte_fallback-window"],
)
def tokenizer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> HFTokenizer:
    """Each tokenizer with each incremental decoder (``DecodeStream``, the window)."""
    kind, use_decode_stream = request.param
    path = tmp_path_factory.mktemp(kind)
    if kind == "byte_level":
        save_tiny_bpe(path, CORPUS, ["<s>", "</s>"])
    else:
        # No CJK in its vocabulary: those characters come as byte pieces.
        save_tiny_byte_fallback(path, CORPUS[:2], ["<unk>", "<s>", "</s>"])
    return HFTokenizer(path, use_decode_stream=use_decode_stream)


def decode_alone(tok: HFTokenizer, ids: list[int], skip: bool) -> str:
    """The tokenizer's decode of ``ids`` as text that follows a word."""
    anchor = tok.encode(ANCHOR)
    text = tok.decode(anchor + ids, skip_special_tokens=skip)
    assert text.startswith(ANCHOR)
    return text[len(ANCHOR) :]


def committed_texts(tok: HFTokenizer, ids: list[int], skip: bool) -> list[str]:
    """The text of ``ids`` that is final after each token: the tokenizer's decode of the ids
    since the last point where it ended on a whole character (no U+FFFD at the end).

    NOTE: byte-fallback decoders turn a whole run of byte pieces into U+FFFDs when one of them
    is invalid, so decoding all ids at once would take back characters that an earlier prefix
    of the run completed; streamed text never changes, so the reference decodes run by run.
    """
    texts = [""]
    start = 0
    for end in range(1, len(ids) + 1):
        piece = decode_alone(tok, ids[start:end], skip)
        if piece and not piece.endswith("\ufffd"):
            texts.append(texts[-1] + piece)
            start = end
        else:
            texts.append(texts[-1])
    return texts


def expected_output(
    tok: HFTokenizer, ids: list[int], params: SamplingParams
) -> tuple[str, int, str | None]:
    """(text, number of tokens kept, stop string) the completion must end with: the stop
    string that ends earliest in the text after the first ``min_tokens`` tokens (ties: the one
    listed first), else all the text with the unfinished tail decoded."""
    skip = params.skip_special_tokens
    texts = committed_texts(tok, ids, skip)
    scanned = texts[-1]
    eligible = texts[min(params.min_tokens, len(ids))]
    best: tuple[int, int, str] | None = None
    for order, stop in enumerate(params.stop_strings):
        at = scanned.find(stop, max(0, len(eligible) - len(stop) + 1))
        if at >= 0 and (best is None or (at + len(stop), order) < best[:2]):
            best = (at + len(stop), order, stop)
    if best is None:
        tail = decode_alone(tok, ids[_last_commit(texts) :], skip)
        return scanned + tail, len(ids), None
    end, _, stop = best
    kept = next(k for k, text in enumerate(texts) if len(text) >= end)
    text = scanned[:end] if params.include_stop_str_in_output else scanned[: end - len(stop)]
    return text, kept, stop


def _last_commit(texts: list[str]) -> int:
    """Tokens up to the last that completed text."""
    count = len(texts) - 1
    while count > 0 and texts[count] == texts[count - 1]:
        count -= 1
    return count


def stream(
    tok: HFTokenizer, prompt: list[int], ids: list[int], steps: list[int], params: SamplingParams
) -> tuple[list[str], list[int], str | None]:
    """Feed ``ids`` in steps of the given sizes to an output processor (DELTA): the text
    deltas, the token ids and the stop reason it reports."""
    proc = OutputProcessor(tok)
    proc.add_request("r", None, prompt, params)
    deltas: list[str] = []
    token_ids: list[int] = []
    stop_reason = None
    done = 0
    for size in steps:
        chunk = ids[done : done + size]
        done += len(chunk)
        finished = [FinishedRequest("r", "length")] if done == len(ids) else []
        result = proc.process_outputs(EngineCoreOutputs(["r"], [chunk], finished))
        for output in result.request_outputs:
            (completion,) = output.outputs
            deltas.append(completion.text)
            token_ids += completion.token_ids
            if completion.finish_reason is not None:
                stop_reason = completion.stop_reason  # type: ignore[assignment]
        if result.reqs_to_abort or done == len(ids):
            break
    assert not proc.has_unfinished_requests()
    return deltas, token_ids, stop_reason


@st.composite
def token_ids(draw: st.DrawFn, tok: HFTokenizer, max_chunks: int) -> list[int]:
    """Random ids (single bytes that cut characters, special tokens) mixed with the ids of
    whole words."""
    chunks = draw(
        st.lists(
            st.one_of(
                st.integers(0, tok.vocab_size - 1).map(lambda t: [t]),
                st.sampled_from(WORDS).map(tok.encode),
            ),
            min_size=1,
            max_size=max_chunks,
        )
    )
    return [t for chunk in chunks for t in chunk]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_streamed_text_is_the_decode_of_the_output_alone(
    tokenizer: HFTokenizer, data: st.DataObject
) -> None:
    tok = tokenizer
    # A clean word, then random ids: the prompt often ends inside a character.
    prompt = tok.encode(ANCHOR) + data.draw(token_ids(tok, 4), label="prompt tail")
    ids = data.draw(token_ids(tok, 12), label="output")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    scanned = committed_texts(tok, ids, skip)[-1]
    stop_strings = st.one_of(
        st.text(alphabet="a ブ東\ufffdoel", min_size=1, max_size=3),
        st.integers(0, max(0, len(scanned) - 1)).flatmap(
            lambda i: st.integers(1, 3).map(lambda n: scanned[i : i + n] or "x")
        ),
    )
    params = SamplingParams(
        max_tokens=len(ids),
        min_tokens=data.draw(st.integers(0, min(3, len(ids))), label="min_tokens"),
        stop=data.draw(st.lists(stop_strings, max_size=3), label="stop"),
        include_stop_str_in_output=data.draw(st.booleans(), label="include_stop"),
        skip_special_tokens=skip,
        spaces_between_special_tokens=False,  # as the tokenizer's decode has it
        output_kind=RequestOutputKind.DELTA,
    )
    steps = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    deltas, out_ids, stop_reason = stream(tok, prompt, ids, steps, params)
    text, kept, stop = expected_output(tok, ids, params)
    if stop is None and "byte_level" in str(tok.path):
        # The decode of a byte-level prefix never changes: the reference is the plain decode.
        assert text == tok.decode(ids, skip_special_tokens=skip)
    # The deltas never hold text a stop string later removes: they add up to the final text.
    assert "".join(deltas) == text
    assert (out_ids, stop_reason) == (ids[:kept], stop)


# -- regressions --------------------------------------------------------------------------------


def words(tok: HFTokenizer, text: str) -> list[int]:
    """Ids of `` text`` after a word (SentencePiece marks the word start itself)."""
    return tok.encode(" " + text if "byte_level" in str(tok.path) else text)


def finish(proc: OutputProcessor, ids: list[int]) -> tuple[str, str | None, int | str | None]:
    """The text, finish reason and stop reason of request "r" after ``ids`` in one step."""
    result = proc.process_outputs(EngineCoreOutputs(["r"], [ids], [FinishedRequest("r", "length")]))
    (output,) = result.request_outputs
    (completion,) = output.outputs
    return completion.text, completion.finish_reason, completion.stop_reason


@pytest.mark.parametrize("stop", [[], ["brown"]])
def test_prompt_ending_inside_a_character_does_not_leak(
    tokenizer: HFTokenizer, stop: list[str]
) -> None:
    tok = tokenizer
    kana = "ア".encode()
    if "byte_level" in str(tok.path):
        # Byte-level pieces of the first two bytes of the kana character.
        unfinished = [tok._tokenizer.token_to_id(c) for c in ("ã", "Ĥ")]
    else:
        unfinished = [tok._tokenizer.token_to_id(f"<0x{b:02X}>") for b in kana[:2]]
    prompt = tok.encode("Hello brown") + unfinished
    assert tok.decode(prompt).rstrip("\ufffd") == "Hello brown"
    proc = OutputProcessor(tok)
    proc.add_request("r", None, prompt, SamplingParams(max_tokens=1, stop=stop))
    assert finish(proc, words(tok, "a")) == (" a", "length", None)


def test_text_prompt_in_byte_pieces_does_not_leak(tokenizer: HFTokenizer) -> None:
    tok = tokenizer
    prompt = tok.encode("/東京")
    proc = OutputProcessor(tok)
    proc.add_request("r", "/東京", prompt, SamplingParams(max_tokens=2))
    # A word-start piece (SentencePiece) keeps its leading space after the prompt.
    assert finish(proc, words(tok, "He said")) == (" He said", "length", None)
