from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.tiny_tokenizer import save_tiny_bpe

from engine_core import LLM, EngineConfig, RequestOutputKind, SamplingParams
from engine_core._core.tokenizer import ByteTokenizer
from engine_core.errors import EngineClosedError

pytest.importorskip("engine_core_mock")

GREEDY = SamplingParams(temperature=0, max_tokens=5)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(backend="mock", tokenizer="byte", max_model_len=64) as engine:
        yield engine


def test_generate_counts_up_from_the_prompt() -> None:
    with LLM(backend="mock", tokenizer="byte") as engine:
        out = engine.generate("abc", SamplingParams(temperature=0, max_tokens=5))
    assert len(out) == 1
    assert out[0].outputs[0].text == "defgh"
    assert out[0].outputs[0].token_ids == [100, 101, 102, 103, 104]
    assert out[0].outputs[0].finish_reason == "length"
    assert out[0].finished
    assert out[0].prompt == "abc" and out[0].prompt_token_ids == [97, 98, 99]


def test_prompt_forms_and_input_order(llm: LLM) -> None:
    prompts = ["abc", {"prompt_token_ids": [65, 66]}, {"prompt": "xy"}]
    params = [
        SamplingParams(temperature=0, max_tokens=8),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=3),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == ["defghijk", "C", "z{|"]
    assert [o.prompt for o in outs] == ["abc", None, "xy"]
    assert [o.prompt_token_ids for o in outs] == [[97, 98, 99], [65, 66], [120, 121]]
    assert len({o.request_id for o in outs}) == 3


def test_one_params_for_all_prompts(llm: LLM) -> None:
    outs = llm.generate(["a", "b"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == ["bc", "cd"]


def test_params_length_mismatch(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling_params has 1 entries but there are 2 prompts"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


def test_bad_requests_fail_alone(llm: LLM) -> None:
    prompts = ["ab", {"prompt_token_ids": [1] * 64}, {"prompt_token_ids": [5, 300]}, "cd"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert [o.outputs[0].text for o in outs] == ["cd", "", "", "ef"]
    assert outs[0].error is None and outs[3].error is None
    assert outs[1].error is not None and "max_model_len is 64" in outs[1].error
    assert outs[2].error is not None and "outside the vocabulary" in outs[2].error
    assert all(o.finished for o in outs)


def test_stats_after_completion(llm: LLM) -> None:
    llm.generate(["abc", "xyz"], GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert llm.reset_prefix_cache() is True


def test_max_tokens_none_fills_the_context(llm: LLM) -> None:
    (out,) = llm.generate(
        {"prompt_token_ids": [0] * 60}, SamplingParams(temperature=0, max_tokens=None)
    )
    assert out.outputs[0].token_ids == [1, 2, 3, 4]
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(("skip_special_tokens", "text"), [(True, ""), (False, "<s>")])
def test_tokenizer_eos_stops_generation(llm: LLM, skip_special_tokens: bool, text: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, skip_special_tokens=skip_special_tokens)
    (out,) = llm.generate({"prompt_token_ids": [255]}, params, use_tqdm=False)
    c = out.outputs[0]
    assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == ([256, 257], text, "stop", None)


def test_stop_string_ends_and_aborts_in_the_engine(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, stop=["fg", "zz"])
    (out,) = llm.generate("abc", params, use_tqdm=False)
    c = out.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == (
        "de",
        [100, 101, 102, 103],
        "stop",
        "fg",
    )
    stats = llm.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_parallel_sampling(llm: LLM) -> None:
    params = SamplingParams(n=3, seed=11, max_tokens=4, logprobs=1, ignore_eos=True)
    (out,) = llm.generate("abc", params, use_tqdm=False)
    (again,) = llm.generate("abc", params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    for c in out.outputs:
        assert len(c.token_ids) == 4 and c.finish_reason == "length"
        assert c.logprobs is not None and len(c.logprobs) == 4
        sampled = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert c.cumulative_logprob is not None
        assert math.isclose(c.cumulative_logprob, math.fsum(sampled), rel_tol=1e-9)


def test_greedy_parallel_sampling_gives_identical_completions(llm: LLM) -> None:
    (out,) = llm.generate("abc", SamplingParams(n=3, temperature=0, max_tokens=4), use_tqdm=False)
    assert [(c.index, c.text, c.finish_reason) for c in out.outputs] == [
        (0, "defg", "length"),
        (1, "defg", "length"),
        (2, "defg", "length"),
    ]


def test_child_seeds_match_single_requests(llm: LLM) -> None:
    (parent,) = llm.generate("abc", SamplingParams(n=2, seed=5, max_tokens=4), use_tqdm=False)
    singles = llm.generate(
        ["abc", "abc"],
        [SamplingParams(seed=5, max_tokens=4), SamplingParams(seed=6, max_tokens=4)],
        use_tqdm=False,
    )
    assert [c.token_ids for c in parent.outputs] == [s.outputs[0].token_ids for s in singles]


def test_progress_bar(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate("abc", GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""
    llm.generate("abc", GREEDY)
    assert "Processed prompts" in capsys.readouterr().err


def test_progress_bar_without_tqdm(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    (out,) = llm.generate("abc", GREEDY)
    assert out.outputs[0].text == "defgh"
    assert capsys.readouterr().err == ""


def test_unknown_config_field() -> None:
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(backend="mock", max_num_seq=4)


def test_multiprocess_runs_the_engine_in_its_own_process() -> None:
    prompts: list[Any] = ["abc", {"prompt_token_ids": [10, 20]}, {"prompt_token_ids": [999]}]
    with LLM(backend="mock", tokenizer="byte", multiprocess=True) as llm:
        assert llm.config.max_model_len == llm.info.max_model_len
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.get_stats()
    assert [o.outputs[0].token_ids for o in outs[:2]] == [
        [100, 101, 102, 103, 104],
        [21, 22, 23, 24, 25],
    ]
    assert outs[2].outputs[0].finish_reason == "error"
    assert outs[2].error == "token ids [999] are outside the vocabulary (size 258)"
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)


def test_from_config_and_close() -> None:
    engine = LLM.from_config(EngineConfig(backend="mock", tokenizer="byte", max_model_len=32))
    assert engine.config.max_model_len == 32
    (out,) = engine.generate("a", GREEDY, use_tqdm=False)
    assert out.outputs[0].text == "bcdef"
    engine.close()
    engine.close()
    with pytest.raises(EngineClosedError):
        engine.generate("a", GREEDY, use_tqdm=False)


def test_bad_prompt_type_sends_nothing(llm: LLM) -> None:
    with pytest.raises(TypeError, match="a prompt must be a str or a dict"):
        llm.generate(["abc", 5], GREEDY, use_tqdm=False)  # type: ignore[list-item]
    stats = llm.get_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)


def test_hf_tokenizer_end_to_end(tmp_path: Path) -> None:
    corpus = ["hello world", "the quick brown fox jumps over the lazy dog"]
    save_tiny_bpe(tmp_path, corpus, ["<s>", "</s>"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with LLM(
        backend="mock", tokenizer=str(tmp_path), backend_options={"vocab_size": 300}
    ) as engine:
        params = SamplingParams(temperature=0, max_tokens=3)
        first, wrapped = engine.generate(["a b", {"prompt_token_ids": [298]}], params)
    assert first.prompt_token_ids == [66, 222, 67]  # "a", " ", "b"
    assert (first.outputs[0].token_ids, first.outputs[0].text) == ([68, 69, 70], "cde")
    # 299 wraps to <s> (0), then </s> (1): the tokenizer's EOS ends the request.
    c = wrapped.outputs[0]
    expected_text = engine.get_tokenizer().decode([299])
    assert (c.token_ids, c.text, c.finish_reason) == ([299, 0, 1], expected_text, "stop")


def test_interrupted_generate_aborts_its_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    with LLM(backend="mock", tokenizer="byte") as engine:
        real_get_output = engine._client.get_output
        calls = []

        def interrupted_get_output() -> object:
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real_get_output()

        monkeypatch.setattr(engine._client, "get_output", interrupted_get_output)
        with pytest.raises(KeyboardInterrupt):
            engine.generate(["abc", "xyz"], GREEDY, use_tqdm=False)
        stats = engine.get_stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
        monkeypatch.undo()
        (out,) = engine.generate("abc", GREEDY, use_tqdm=False)
        assert out.outputs[0].text == "defgh"


@pytest.mark.parametrize("kind", list(RequestOutputKind))
@pytest.mark.parametrize(
    ("prompt_token_ids", "max_tokens"),
    [([0xE1], 1), ([0xE1], 2), ([0xDF], 3), ([0xEF], 3), ([0xEF], 4)],
)
def test_final_text_equals_the_tokenizers_decode(
    llm: LLM, kind: RequestOutputKind, prompt_token_ids: list[int], max_tokens: int
) -> None:
    # The mock counts up from the last prompt byte: 0xE2 0xE3 ... start three-byte characters
    # that the next bytes never finish, so the text ends in an unfinished UTF-8 sequence.
    params = SamplingParams(temperature=0, max_tokens=max_tokens, output_kind=kind)
    [out] = llm.generate({"prompt_token_ids": prompt_token_ids}, params, use_tqdm=False)
    completion = out.outputs[0]
    assert "\ufffd" in completion.text
    assert completion.text == ByteTokenizer().decode(completion.token_ids)
