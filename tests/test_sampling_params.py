"""SamplingParams: vLLM's defaults, validation naming the parameter, normalisation, wire format."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from engine_core.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)


def test_defaults_equal_vllm() -> None:
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.seed is None
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.include_stop_str_in_output is False
    assert p.logprobs is None
    assert p.prompt_logprobs is None
    assert p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.repetition_penalty == 1.0
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.detokenize is True
    assert p.skip_special_tokens is True
    assert p.structured_outputs is None
    assert p.is_greedy is False


@pytest.mark.parametrize(
    "name,value",
    [
        ("temperature", -0.1),
        ("temperature", 2.01),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_k", -2),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("presence_penalty", -2.01),
        ("presence_penalty", 2.01),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", 2.01),
        ("frequency_penalty", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("min_tokens", -1),
        ("n", 0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", -1),
        ("stop", [""]),
        ("stop", ["ok", ""]),
        ("stop", ""),
        ("stop_token_ids", [-1]),
    ],
)
def test_invalid_value_names_the_parameter(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"min_tokens": 5, "max_tokens": 4}, r"^min_tokens must be <= max_tokens \(4\), got 5"),
        ({"n": 2, "temperature": 0.0}, r"^n must be 1 with greedy sampling"),
        ({"stop": ["x"], "detokenize": False}, r"^stop strings need detokenize=True"),
        # Invalid values are reported even though greedy sampling would reset them.
        ({"temperature": 0.0, "top_p": 5.0}, r"^top_p must be in \(0, 1\], got 5.0"),
        ({"temperature": 0.0, "top_k": -3}, r"^top_k must be -1, 0 \(disabled\) or >= 1"),
        ({"temperature": 0.0, "min_p": 2.0}, r"^min_p must be in \[0.0, 1.0\], got 2.0"),
    ],
)
def test_invalid_combinations(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "name,value",
    [
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", None),
        ("n", 1.5),
        ("top_k", True),
        ("max_tokens", 2.0),
        ("min_tokens", "1"),
        ("seed", 1.0),
        ("repetition_penalty", "1"),
    ],
)
def test_wrong_type_names_the_parameter(name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"^{name} must be"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 2.0},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"max_tokens": 1},
        {"max_tokens": None, "min_tokens": 100},
        {"min_tokens": 4, "max_tokens": 4},
        {"n": 3, "temperature": 0.5},
        {"logprobs": 0, "prompt_logprobs": 20},
        {"logprobs": 20},
        {"stop_token_ids": [0, 5]},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name not in ("top_p", "top_k", "min_p") or not params.is_greedy:
            assert getattr(params, name) == value


def test_greedy_normalisation() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.1)
    assert p.is_greedy
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(temperature=1e-6, top_k=7).top_k == 0
    # Tiny positive temperatures below 0.01 are raised to 0.01 (numerically safe), not greedy.
    tiny = SamplingParams(temperature=0.005, top_k=7)
    assert tiny.temperature == 0.01
    assert not tiny.is_greedy
    assert tiny.top_k == 7
    assert SamplingParams(temperature=0.01).temperature == 0.01
    assert SamplingParams(temperature=0.7, top_p=0.5).top_p == 0.5


def test_normalisation_of_stop_seed_and_logprobs() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams(stop_token_ids=[5, 3, 5, 9, 3]).stop_token_ids == [5, 3, 9]
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=7).seed == 7
    assert SamplingParams(logprobs=True).logprobs == 1  # type: ignore[arg-type]
    assert SamplingParams(logprobs=False).logprobs is None  # type: ignore[arg-type]
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1  # type: ignore[arg-type]


def test_clone_validates() -> None:
    p = SamplingParams(temperature=0.5, max_tokens=8)
    q = p.clone(max_tokens=4)
    assert (q.temperature, q.max_tokens) == (0.5, 4)
    assert p.max_tokens == 8
    with pytest.raises(ValueError, match="^temperature must be in"):
        p.clone(temperature=3.0)


def test_structured_outputs_validation() -> None:
    assert StructuredOutputsParams(regex="[a-z]+").regex == "[a-z]+"
    assert StructuredOutputsParams(json={"type": "object"}).json == {"type": "object"}
    with pytest.raises(ValueError, match="exactly one of .* got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"exactly one of .* got \['regex', 'choice'\]"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs.choice must not be empty"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.json_object must be True"):
        StructuredOutputsParams(json_object=False)
    for name in ("regex", "grammar", "json"):
        with pytest.raises(ValueError, match=f"structured_outputs.{name} must not be empty"):
            StructuredOutputsParams(**{name: ""})


def test_msgpack_round_trip() -> None:
    p = SamplingParams(
        n=2,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=11,
        max_tokens=99,
        min_tokens=3,
        stop=["\n\n", "END"],
        stop_token_ids=[42, 7],
        ignore_eos=True,
        include_stop_str_in_output=True,
        logprobs=5,
        prompt_logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        output_kind=RequestOutputKind.DELTA,
        skip_special_tokens=False,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert decoded == p
    assert decoded.output_kind is RequestOutputKind.DELTA
    assert decoded.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])
    default = SamplingParams()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(default), type=SamplingParams) == default


def test_decoding_validates() -> None:
    payload = msgspec.msgpack.encode({"temperature": 7.0})
    with pytest.raises(msgspec.ValidationError, match="temperature must be in"):
        msgspec.msgpack.decode(payload, type=SamplingParams)
    payload = msgspec.msgpack.encode({"top_k": "many"})
    with pytest.raises(msgspec.ValidationError, match="top_k"):
        msgspec.msgpack.decode(payload, type=SamplingParams)
