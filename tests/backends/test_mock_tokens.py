"""The mock backend's token rules that requests steer: ``logit_bias``."""

from __future__ import annotations

import pytest

from engine_core import LLM, SamplingParams

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
