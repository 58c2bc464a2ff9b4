"""Logprobs as the server writes them, from outputs made by the output processor: each
token's text in context, chat ``bytes``, completions ``text_offset``."""

from __future__ import annotations

import pytest
from helpers.tiny_tokenizer import save_tiny_byte_fallback

from engine_core._core.engine_io import EngineCoreOutputs, FinishedRequest
from engine_core._core.hf_tokenizer import HFTokenizer
from engine_core._core.tokenizer import ByteTokenizer, Tokenizer
from engine_core._frontend.output_processor import OutputProcessor
from engine_core.abc import TokenLogprobs
from engine_core.outputs import CompletionOutput
from engine_core.sampling_params import SamplingParams
from engine_core.server._logprobs import TextOffsets, chat_logprobs, completion_logprobs

CORPUS = ["Hello brown fox, the quick brown fox jumps over the lazy dog", "He said hello world"]


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    path = tmp_path_factory.mktemp("byte_fallback")
    return HFTokenizer(save_tiny_byte_fallback(path, CORPUS, ["<unk>", "<s>", "</s>"]))


def generate(
    tok: Tokenizer, prompt: list[int], ids: list[int], params: SamplingParams
) -> CompletionOutput:
    """The completion of ``ids`` after ``prompt``, each sampled with logprob -1 (rank 1) beside
    the next id in the vocabulary (rank 2)."""
    proc = OutputProcessor(tok)
    proc.add_request("r", None, prompt, params.clone(max_tokens=len(ids)))
    entries = [TokenLogprobs([t, (t + 1) % tok.vocab_size], [-1.0, -2.0], [1, 2]) for t in ids]
    step = EngineCoreOutputs(["r"], [ids], [FinishedRequest("r", "length")], {"r": entries})
    (output,) = proc.process_outputs(step).request_outputs
    return output.outputs[0]


def test_sentencepiece_tokens_keep_their_leading_space(sentencepiece: HFTokenizer) -> None:
    tok = sentencepiece
    ids = tok.encode("He said hello")
    params = SamplingParams(logprobs=1)
    completion = generate(tok, tok.encode("Hello"), ids, params)
    assert completion.text == " He said hello"
    assert completion.logprobs is not None
    logprobs = completion_logprobs(
        tok, completion.logprobs, ids, TextOffsets(tok, tok.encode("Hello"), params)
    )
    assert [tok._tokenizer.id_to_token(t) for t in ids] == ["▁He", "▁said", "▁hello"]
    assert logprobs.tokens == [" He", " said", " hello"]
    assert logprobs.text_offset == [0, 3, 8]
    chat = chat_logprobs(completion.logprobs, 1, tok).content
    assert [(t.token, bytes(t.bytes or [])) for t in chat] == [
        (" He", b" He"),
        (" said", b" said"),
        (" hello", b" hello"),
    ]


def test_text_offset_counts_only_text_that_appears(sentencepiece: HFTokenizer) -> None:
    # "ア" in three byte pieces, a special token skipped in the text, then a word.
    tok = sentencepiece
    kana = [tok._tokenizer.token_to_id(f"<0x{b:02X}>") for b in "ア".encode()]
    eos = tok._tokenizer.token_to_id("</s>")
    ids = [*tok.encode("He"), *kana, eos, *tok.encode("said")]
    params = SamplingParams(logprobs=0, ignore_eos=True)
    completion = generate(tok, tok.encode("Hello"), ids, params)
    assert completion.text == " Heア said"
    assert completion.logprobs is not None
    logprobs = completion_logprobs(
        tok, completion.logprobs, ids, TextOffsets(tok, tok.encode("Hello"), params)
    )
    assert logprobs.tokens == [" He", "\ufffd", "\ufffd", "\ufffd", "</s>", " said"]
    assert logprobs.text_offset == [0, 3, 3, 3, 4, 4]


def test_chat_bytes_are_the_tokens_own(sentencepiece: HFTokenizer) -> None:
    # Each byte of "é" alone: the text shows U+FFFD, the bytes are the token's.
    for tok, ids in [
        (ByteTokenizer(), [0xC3, 0xA9]),
        (
            sentencepiece,
            [sentencepiece._tokenizer.token_to_id(f"<0x{b:02X}>") for b in b"\xc3\xa9"],
        ),
    ]:
        completion = generate(tok, tok.encode("a"), ids, SamplingParams(logprobs=1))
        assert completion.text == "é"
        assert completion.logprobs is not None
        content = chat_logprobs(completion.logprobs, 1, tok).content
        assert [(t.token, t.bytes) for t in content] == [("\ufffd", [0xC3]), ("\ufffd", [0xA9])]
        assert [[x.bytes for x in t.top_logprobs] for t in content] == [[[0xC3]], [[0xA9]]]


def test_top_candidates_of_the_same_text_are_entries_of_their_own(
    sentencepiece: HFTokenizer,
) -> None:
    """Distinct candidates that show the same text (the byte pieces of a character, U+FFFD
    each) never collapse into one key of the completions ``top_logprobs``: a later one is keyed
    by its bytes, as OpenAI writes them; chat lists each with its own bytes."""
    tok = sentencepiece
    pieces = [tok._tokenizer.token_to_id(f"<0x{b:02X}>") for b in (0xE3, 0x82, 0xA2, 0xC3, 0xA9)]
    proc = OutputProcessor(tok)
    params = SamplingParams(logprobs=4, max_tokens=1)
    proc.add_request("r", None, tok.encode("a"), params)
    entry = TokenLogprobs(pieces, [-0.5, -1.0, -2.0, -3.0, -4.0], [1, 2, 3, 4, 5])
    step = EngineCoreOutputs(["r"], [[pieces[0]]], [FinishedRequest("r", "length")], {"r": [entry]})
    (output,) = proc.process_outputs(step).request_outputs
    completion = output.outputs[0]
    assert completion.logprobs is not None
    columns = completion_logprobs(
        tok, completion.logprobs, completion.token_ids, TextOffsets(tok, tok.encode("a"), params)
    )
    assert columns.top_logprobs == [
        {
            "\ufffd": -0.5,
            "bytes:\\x82": -1.0,
            "bytes:\\xa2": -2.0,
            "bytes:\\xc3": -3.0,
            "bytes:\\xa9": -4.0,
        }
    ]
    (content,) = chat_logprobs(completion.logprobs, 4, tok).content
    assert [t.bytes for t in content.top_logprobs] == [[0xE3], [0x82], [0xA2], [0xC3]]
