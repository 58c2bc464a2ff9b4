"""SamplingParams: vLLM's defaults, validation naming the parameter, normalisation, wire format."""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import pytest
from helpers import every_field

from engine_core.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)


def test_defaults_equal_vllm() -> None:
    p = SamplingParams()
    assert every_field.typed(p) == every_field.typed(
        {
            "n": 1,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "seed": None,
            "max_tokens": 16,
            "min_tokens": 0,
            "stop": [],
            "stop_token_ids": [],
            "ignore_eos": False,
            "include_stop_str_in_output": False,
            "logprobs": None,
            "prompt_logprobs": None,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "output_kind": RequestOutputKind.CUMULATIVE,
            "detokenize": True,
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "structured_outputs": None,
            "logit_bias": None,
        },
    )
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
        {"n": 3, "temperature": 0.0},  # n identical completions, as OpenAI's API gives
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
    p = every_field.instance(SamplingParams)
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


# -- hostile input: every wrong type or out-of-range value is refused at construction -----------


@pytest.mark.parametrize(
    "name,value",
    [
        ("ignore_eos", "no"),
        ("ignore_eos", 1),
        ("include_stop_str_in_output", 0),
        ("detokenize", 1),
        ("detokenize", None),
        ("skip_special_tokens", None),
        ("output_kind", True),
        ("output_kind", "delta"),
        ("output_kind", 1.0),
        ("stop", 5),
        ("stop", ("a", 1)),
        ("stop", [b"x"]),
        ("stop", b"x"),
        ("stop_token_ids", "abc"),
        ("stop_token_ids", [True]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", 7),
        ("structured_outputs", {"json": {}}),
        ("n", True),
        ("seed", "1"),
        ("logprobs", 1.5),
        ("min_p", [0.1]),
    ],
)
def test_wrong_type_is_a_type_error_naming_the_field(name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"^{name} must be"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize(
    "name,value",
    [
        ("max_tokens", 2**64),
        ("max_tokens", 2**63),
        ("top_k", 10**4000),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("n", 2**70),
        ("min_tokens", 2**63),
        ("stop_token_ids", [2**63]),
        ("stop_token_ids", [5, 2**100]),
        ("temperature", 10**400),
        ("repetition_penalty", 10**400),
        ("output_kind", 7),
        ("output_kind", -1),
        ("stop", "\ud800"),
        ("stop", ["ok", "a\udfffb"]),
    ],
)
def test_value_beyond_the_wire_is_a_value_error_naming_the_field(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must") as info:
        SamplingParams(**{name: value})
    assert len(str(info.value)) < 200  # a huge value is shown by its size


def test_accepted_conversions() -> None:
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA  # type: ignore[arg-type]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=(3, 3, 4)).stop_token_ids == [3, 4]  # type: ignore[arg-type]
    p = SamplingParams(temperature=1, top_p=1, repetition_penalty=2)  # type: ignore[arg-type]
    assert [type(v) for v in (p.temperature, p.top_p, p.repetition_penalty)] == [float] * 3
    top = 2**63 - 1
    assert SamplingParams(max_tokens=top, top_k=top, seed=top).seed == top
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    # Completion i of n samples with seed + i, which must fit too.
    assert SamplingParams(n=3, seed=top - 2).seed == top - 2
    with pytest.raises(ValueError, match=r"^seed must be at most 2\*\*63 - n \(3\)"):
        SamplingParams(n=3, seed=top - 1)


def test_validate_checks_fields_assigned_after_construction() -> None:
    p = SamplingParams()
    p.ignore_eos = "no"  # type: ignore[assignment]
    with pytest.raises(TypeError, match="^ignore_eos must be a bool"):
        p.validate()
    q = SamplingParams(max_tokens=5)
    q.max_tokens = 2**64
    with pytest.raises(ValueError, match="^max_tokens must be"):
        q.validate()


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"json": 5}, TypeError, r"structured_outputs.json must be a JSON schema"),
        ({"json": b"{}"}, TypeError, r"structured_outputs.json must be a JSON schema"),
        ({"json": {1: "x"}}, TypeError, r"structured_outputs.json must have str keys"),
        ({"json": {"a": {1, 2}}}, TypeError, r"structured_outputs.json must hold JSON values"),
        ({"json": {"a": [b"x"]}}, TypeError, r"structured_outputs.json must hold JSON values"),
        ({"json": {"max": 2**64}}, ValueError, r"structured_outputs.json holds an integer"),
        ({"json": "[" * 100_000}, ValueError, r"structured_outputs.json is nested deeper"),
        (
            {"json": '{"a":' * 101 + "1" + "}" * 101},
            ValueError,
            r"structured_outputs.json is nested deeper than 100",
        ),
        ({"json": "\ud800"}, ValueError, r"structured_outputs.json must be valid Unicode"),
        ({"choice": ["a", 1]}, TypeError, r"structured_outputs.choice must be a list of str"),
        ({"choice": "ab"}, TypeError, r"structured_outputs.choice must be a list of str"),
        ({"choice": ["\udc80"]}, ValueError, r"structured_outputs.choice must be valid Unicode"),
        ({"regex": b"x"}, TypeError, r"structured_outputs.regex must be a str"),
        ({"grammar": 3}, TypeError, r"structured_outputs.grammar must be a str"),
        ({"json_object": 1}, TypeError, r"structured_outputs.json_object must be a bool"),
    ],
)
def test_structured_outputs_wrong_types_and_values(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{message}"):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_depth_limit_is_exact() -> None:
    def nested(depth: int) -> Any:
        value: Any = 1
        for _ in range(depth):
            value = {"a": value}
        return value

    StructuredOutputsParams(json=nested(100))
    StructuredOutputsParams(json=json.dumps(nested(100)))
    # Brackets inside strings are not nesting.
    StructuredOutputsParams(json=json.dumps({"pattern": "[" * 500, "k": ['\\"[{']}))
    for schema in (nested(101), json.dumps(nested(101))):
        with pytest.raises(ValueError, match="nested deeper than 100 levels"):
            StructuredOutputsParams(json=schema)
    deep_list: Any = []
    for _ in range(100_000):  # far beyond the recursion limit: the check is iterative
        deep_list = [deep_list]
    with pytest.raises(ValueError, match="nested deeper than 100 levels"):
        StructuredOutputsParams(json={"a": deep_list})
    assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]  # type: ignore[arg-type]


def test_every_field_is_type_checked() -> None:
    from engine_core import sampling_params as module

    groups = (
        module._FLOAT_FIELDS,
        module._INT_FIELDS,
        module._OPTIONAL_INT_FIELDS,
        module._BOOL_FIELDS,
    )
    grouped = [name for group in groups for name in group]
    # The rest have checks of their own in _coerce_others.
    special = ["stop", "stop_token_ids", "output_kind", "structured_outputs", "logit_bias"]
    # A field declared with another annotation than the groups read falls out: this fails.
    assert sorted(grouped + special) == sorted(SamplingParams.__struct_fields__)
