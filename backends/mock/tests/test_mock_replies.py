"""The mock's scripted replies (``backend_options["replies"]``), through the offline ``LLM``."""

from __future__ import annotations

from typing import Any

import pytest
from engine_core_mock._options import parse_options

from engine_core import LLM, SamplingParams
from engine_core.config import EngineConfig
from engine_core.sampling_params import StructuredOutputsParams

REPLIES = [
    {"match": r"weather in \w+", "text": "It is sunny."},
    {"match": r"^count", "text": "ab", "eos": False},
]


def _llm(**options: Any) -> LLM:
    return LLM(backend="mock", tokenizer="byte", backend_options={"replies": REPLIES, **options})


def _text(llm: LLM, prompt: str, **params: Any) -> str:
    out = llm.generate(prompt, SamplingParams(**{"max_tokens": 30, **params}), use_tqdm=False)
    return out[0].outputs[0].text


def test_a_matching_prompt_gets_the_reply_then_eos() -> None:
    llm = _llm()
    out = llm.generate(
        "what is the weather in Paris?",
        SamplingParams(temperature=0, max_tokens=30),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == "It is sunny."
    assert out.finish_reason == "stop"


def test_the_reply_overrides_random_sampling_too() -> None:
    llm = _llm()
    assert _text(llm, "the weather in Oslo", temperature=1.0, seed=3) == "It is sunny."


def test_other_prompts_follow_the_usual_rule() -> None:
    assert _text(_llm(), "abc", temperature=0, max_tokens=3) == "def"


def test_past_a_reply_without_eos_the_rule_counts_on() -> None:
    # "ab" then the rule counts up from "b".
    assert _text(_llm(), "count", temperature=0, max_tokens=4) == "abcd"


def test_a_grammar_moves_a_disallowed_reply_token_to_the_next_allowed_one() -> None:
    llm = _llm()
    params = StructuredOutputsParams(regex="[a-z ]+[.]")
    # "I" is not allowed: the next allowed byte at or after it is "a"; the rest fits.
    text = _text(llm, "weather in Rome", temperature=0, structured_outputs=params)
    assert text == "at is sunny."


@pytest.mark.parametrize(
    ("replies", "message"),
    [
        ({"match": "x"}, "must be a list"),
        ([{"match": "x"}], "keys 'match' and 'text'"),
        ([{"match": "(", "text": "y"}], "not a valid regex"),
        ([{"match": "x", "text": 3}], "must be strings"),
    ],
)
def test_invalid_replies_are_refused(replies: Any, message: str) -> None:
    config = EngineConfig(backend="mock", tokenizer="byte", backend_options={"replies": replies})
    with pytest.raises(ValueError, match=message):
        parse_options(config)


def test_replies_work_in_the_engine_process() -> None:
    # As `engine-core serve --backend mock` runs it: the engine core in its own process.
    with LLM(
        backend="mock", tokenizer="byte", multiprocess=True, backend_options={"replies": REPLIES}
    ) as llm:
        assert _text(llm, "the weather in Lima", temperature=0) == "It is sunny."
