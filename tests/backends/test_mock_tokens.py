"""The mock backend's token rules that requests steer: ``logit_bias`` and grammars (the first
allowed token that is not whitespace when greedy, a uniform draw among the allowed ones else)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from engine_core import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("engine_core_mock")

GREEDY = SamplingParams(temperature=0, max_tokens=5)
SEEDED = SamplingParams(temperature=1.0, seed=3, max_tokens=5)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(backend="mock", tokenizer="byte")


def texts(llm: LLM, params: list[SamplingParams]) -> list[str]:
    outs = llm.generate(["abc"] * len(params), params, use_tqdm=False)
    return [out.outputs[0].text for out in outs]


def test_minus_100_bans_a_token_and_plus_100_forces_one(llm: LLM) -> None:
    e, x, y = ord("e"), ord("x"), ord("y")
    assert texts(
        llm,
        [
            GREEDY,
            GREEDY.clone(logit_bias={e: -100}),
            GREEDY.clone(logit_bias={x: 100}),
            # Two forced tokens: the first at or after the rule's token. After "c" the rule
            # says "d" ("x" is first), after "x" "y", after "y" "z" (wrapping around to "x").
            GREEDY.clone(logit_bias={y: 100, x: 100}),
            GREEDY.clone(logit_bias={x: 100, e: -100, ord("d"): 99.0}),
        ],
    ) == ["defgh", "dfghi", "xxxxx", "xyxyx", "xxxxx"]
    banned_all_but_z = {t: -100.0 for t in range(258) if t != ord("z")}  # EOS too
    seeded = texts(
        llm,
        [
            SEEDED.clone(logit_bias={x: 100}),
            SEEDED.clone(logit_bias=banned_all_but_z),
        ],
    )
    assert seeded[0] == "xxxxx"
    assert seeded[1] == "zzzzz"


def test_greedy_takes_the_best_synthetic_logit_plus_bias(llm: LLM) -> None:
    # The synthetic logit of the token r places after the greedy one is -(r + 1) * ln 2: after
    # "c", "e" (one place after "d") needs a bias over ln 2 = 0.69 to win, "f" over 1.39; once
    # past, "f" is 255 places behind and a bias of 2 no longer brings it back.
    assert texts(
        llm,
        [
            GREEDY.clone(logit_bias={ord("e"): 0.6}),
            GREEDY.clone(logit_bias={ord("e"): 0.8}),
            GREEDY.clone(logit_bias={ord("d"): -0.8}),
            GREEDY.clone(logit_bias={ord("f"): 1.3}),
            GREEDY.clone(logit_bias={ord("f"): 2.0}),
        ],
    ) == ["defgh", "efghi", "efghi", "dfghi", "fghij"]


def test_random_sampling_with_a_bias_is_reproducible_and_ignores_small_values(llm: LLM) -> None:
    first = texts(llm, [SEEDED, SEEDED.clone(logit_bias={ord("q"): 5.0})])
    assert first[0] == first[1]
    assert texts(llm, [SEEDED.clone(logit_bias={ord("q"): 100.0})]) == ["qqqqq"]


def test_a_bias_outside_the_vocabulary_ends_the_request_with_an_error(llm: LLM) -> None:
    (out,) = llm.generate("abc", GREEDY.clone(logit_bias={258: 1.0}), use_tqdm=False)
    assert out.outputs[0].finish_reason == "error"
    assert out.error == "logit_bias token ids [258] are outside the vocabulary (size 258)"


# -- under a grammar -----------------------------------------------------------------------------

NAME_AGE: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("compact", [False, True], ids=["any-whitespace", "compact"])
def test_a_json_schema_completes_within_100_tokens_at_either_temperature(
    llm: LLM, compact: bool
) -> None:
    pytest.importorskip("llguidance")
    constraint = StructuredOutputsParams(json=NAME_AGE, disable_any_whitespace=compact)
    params = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=constraint)] + [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured_outputs=constraint)
        for seed in range(20)
    ]
    outs = [out.outputs[0] for out in llm.generate(["hello"] * 21, params, use_tqdm=False)]
    for out in outs:
        assert out.finish_reason == "stop" and len(out.token_ids) <= 100, out.text
        value = json.loads(out.text)
        assert sorted(value) == ["age", "name"] and len(value["name"]) <= 8
        assert isinstance(value["age"], int)
    # Greedy never takes whitespace where the grammar allows anything else.
    assert outs[0].text == '{"age":-0,"name":"#$%&\'()*"}'
    between_strings = [re.sub(r'"(?:[^"\\]|\\.)*"', '""', out.text) for out in outs]
    if compact:
        assert not any(re.search(r"\s", text) for text in between_strings)
    else:
        assert any(re.search(r"\s", text) for text in between_strings)
    assert len({out.text for out in outs[1:]}) == 20  # the seeds draw different outputs


def test_random_sampling_draws_uniformly_among_the_allowed_tokens(llm: LLM) -> None:
    pytest.importorskip("llguidance")
    params = SamplingParams(
        temperature=1.0,
        seed=5,
        max_tokens=400,
        structured_outputs=StructuredOutputsParams(regex="[abcd]{400}"),
    )
    (out,) = llm.generate("x", params, use_tqdm=False)
    counts = [out.outputs[0].text.count(c) for c in "abcd"]
    assert sum(counts) == 400 and min(counts) > 70, counts  # 100 each, give or take


def test_greedy_takes_whitespace_only_where_nothing_else_is_allowed(llm: LLM) -> None:
    pytest.importorskip("llguidance")
    params = SamplingParams(
        temperature=0,
        max_tokens=10,
        structured_outputs=StructuredOutputsParams(regex="[ \t]?[ \t]y[ \t]?"),
    )
    (out,) = llm.generate("x", params, use_tqdm=False)
    # First only whitespace is allowed: the first at or after the rule's "y", wrapping, is a
    # tab (9). Then "y" beats a second tab, and EOS the trailing whitespace.
    assert out.outputs[0].text == "\ty"
    assert out.outputs[0].finish_reason == "stop"


def test_nth_allowed_counts_set_bits_past_banned_and_past_the_vocabulary() -> None:
    from engine_core_mock._sampling import nth_allowed

    words = [0b1010, -(2**31), 0xFF]  # tokens 1, 3; 63 (the sign bit); 64..71
    assert [nth_allowed(d, 70, None, words) for d in range(9)] == [1, 3, 63, 64, 65, 66, 67, 68, 69]
    assert nth_allowed(9, 70, None, words) == 1  # 9 allowed ids: 70 and 71 are past the vocab
    assert [nth_allowed(d, 70, {3, 64}, words) for d in range(3)] == [1, 63, 65]
    assert nth_allowed(0, 70, {1, 3, 63, 64, 65, 66, 67, 68, 69}, words) is None


def test_whitespace_token_ids(tmp_path: Path) -> None:
    from engine_core_mock._whitespace import whitespace_token_ids

    assert whitespace_token_ids("byte") == frozenset(b" \t\n\r\x0b\x0c")
    vocab = {"a": 0, "\u0120": 1, "\u010a\u010a": 2, "\u0120a": 3, "\u2581": 4, "<0x0A>": 5}
    data = {
        "model": {"type": "BPE", "vocab": vocab},
        "added_tokens": [
            {"id": 6, "content": "   ", "special": False},
            {"id": 7, "content": "<s>", "special": True},
        ],
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    assert whitespace_token_ids(str(tmp_path)) == {1, 2, 4, 5, 6}
    assert whitespace_token_ids(str(tmp_path / "missing")) == frozenset()
