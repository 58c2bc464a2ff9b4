from __future__ import annotations

import logging
import random
from typing import Any

import msgspec
import pytest
from helpers import every_field
from helpers.strategies import HOSTILE, SAMPLING_FIELDS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core._core.engine_io import (
    DPEngineCoreOutputs,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineLoad,
    EngineStats,
    FinishedRequest,
)
from engine_core._engine.wire import (
    AbortRequests,
    EngineDead,
    Ready,
    RejectedRequest,
    Shutdown,
    UtilityCall,
    UtilityReply,
    client_message_decoder,
    decode,
    decode_client_message,
    engine_message_decoder,
    read_add_request_id,
)
from engine_core._frontend.request_checks import check_request
from engine_core.abc import TokenLogprobs
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams, StructuredOutputsParams

encode = msgspec.msgpack.Encoder().encode


def _request() -> EngineCoreRequest:
    return EngineCoreRequest(
        "r1",
        [1, 2, 3],
        SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[7]),
        arrival_time=12.5,
        priority=2,
        eos_token_ids=[257],
        cache_salt="s",
    )


@pytest.mark.parametrize(
    "message",
    [
        _request(),
        AbortRequests(["r1", "r2"]),
        UtilityCall(7, "pause_generation", ["keep"]),
        UtilityCall(8, "get_stats"),
        Shutdown(),
    ],
    ids=["add", "abort", "call", "call-no-args", "shutdown"],
)
def test_client_messages_round_trip(message: object) -> None:
    assert client_message_decoder().decode(encode(message)) == message


@pytest.mark.parametrize(
    "message",
    [
        Ready(
            EngineInfo(
                num_kv_blocks=64, block_size=16, max_model_len=512, vocab_size=258, backend="mock"
            ),
            "ipc:///tmp/x/input",
        ),
        EngineCoreOutputs(
            ["r1", "r2"],
            [[4], [5, 6]],
            [
                FinishedRequest("r2", "stop", 6),
                FinishedRequest("r3", "error", None, "paused", retryable=True),
            ],
            {"r1": [TokenLogprobs([4, 9], [-0.5, -1.5], [1, 2])]},
            {},
            {"r1": 16},
            3.25,
        ),
        UtilityReply(3, True),
        UtilityReply(4, error="bad mode", error_type="ValueError"),
        EngineDead(reason="RuntimeError: boom", error_type="RuntimeError", traceback="tb"),
        EngineDead(exit_code=-9),
    ],
    ids=["ready", "outputs", "reply", "reply-error", "dead", "dead-exit"],
)
def test_engine_messages_round_trip(message: object) -> None:
    assert engine_message_decoder().decode(encode(message)) == message


def test_hot_messages_are_positional() -> None:
    # array_like structs encode every field by position (msgspec omits defaults only from
    # map-encoded structs, such as SamplingParams, where it keeps the parameters small).
    outputs = EngineCoreOutputs(["r1"], [[4]])
    # Without data parallelism not a byte of KV events or load reports.
    assert encode(outputs) == encode(["out", ["r1"], [[4]], [], {}, {}, {}, 0.0])
    load = EngineLoad(1, 2, 3, 4)
    dp = DPEngineCoreOutputs(["r1"], [[4]], kv_events=None, load=load)
    assert encode(dp) == encode(["dpout", ["r1"], [[4]], [], {}, {}, {}, 0.0, None, [1, 2, 3, 4]])
    assert engine_message_decoder().decode(encode(dp)) == dp
    request = EngineCoreRequest("r1", [1, 2], SamplingParams(max_tokens=3))
    params = {"max_tokens": 3, "stop": [], "stop_token_ids": []}
    assert msgspec.msgpack.decode(encode(request)) == [
        "add",
        "r1",
        [1, 2],
        params,
        0.0,
        0,
        [],
        None,
        None,
        [],
        None,
        None,  # lora_request
    ]
    assert encode(AbortRequests(["r1"])) == encode(["abort", ["r1"]])


def test_stats_reply_converts_back_to_engine_stats() -> None:
    stats = every_field.instance(EngineStats)
    reply = engine_message_decoder().decode(encode(UtilityReply(1, stats)))
    assert isinstance(reply, UtilityReply)
    assert msgspec.convert(reply.result, EngineStats) == stats


def test_arbitrary_objects_are_not_encoded() -> None:
    class Thing:
        pass

    with pytest.raises(TypeError, match="Encoding objects of type Thing is unsupported"):
        encode(UtilityReply(1, Thing()))


_INVALID_FRAMES = {
    "random-bytes": random.Random(0).randbytes(40),
    "truncated": encode(_request())[:-3],
    "unknown-tag": encode(["bogus", 1, 2]),
    "wrong-field-type": encode(["abort", "r1"]),
    "invalid-params": encode(["add", "r1", [1], {"max_tokens": -1}]),
    "not-an-array": encode({"add": 1}),
}


@pytest.mark.parametrize("frame", _INVALID_FRAMES.values(), ids=_INVALID_FRAMES.keys())
def test_invalid_frames_are_logged_and_dropped(
    frame: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="engine_core._engine.wire"):
        assert decode(client_message_decoder(), frame) is None
    assert len(caplog.records) == 1
    assert (
        caplog.records[0]
        .getMessage()
        .startswith(f"dropped an invalid message of {len(frame)} bytes ({frame[:64]!r}...): ")
    )


def test_client_messages_are_rejected_by_the_engine_message_decoder(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="engine_core._engine.wire"):
        assert decode(engine_message_decoder(), encode(Shutdown())) is None
    assert "Invalid value 'shutdown'" in caplog.records[0].getMessage()


# -- undecodable requests whose id can be read -------------------------------------------------


def _add(*fields: Any) -> bytes:
    return encode(["add", *fields])


_REJECTED = {
    "bool-field": (_add("r1", [1], {"ignore_eos": "no"}), "at `$.sampling_params.ignore_eos`"),
    "output-kind": (_add("r1", [1], {"output_kind": 7}), "at `$.sampling_params.output_kind`"),
    "priority": (_add("r1", [1], {}, 0.0, "high"), "Expected `int`, got `str` - at `$.priority`"),
    "cache-salt": (_add("r1", [1], {}, 0.0, 0, [], 5), "at `$.cache_salt`"),
    "structured": (
        _add("r1", [1], {"structured_outputs": {"json": 5}}),
        "got `int` - at `$.sampling_params.structured_outputs.json`",
    ),
    "deep-json": (
        _add("r1", [1], {"structured_outputs": {"json": "[" * 100_000}}),
        "structured_outputs.json is nested deeper than 100 levels",
    ),
    "truncated": (encode(_request())[:-3], "Input data was truncated"),
    # Nested past msgspec's recursion limit: a RecursionError, not a DecodeError.
    "deep-prompt": (b"\x94\xa3add\xa2r1" + b"\x91" * 100_000 + b"\x90", "Expected `int`"),
    "deep-schema": (  # a JSON schema (typed Any inside) nested 100000 deep
        encode(["add", "r1", [1], {"structured_outputs": {"json": {"a": 0}}}])[:-1]
        + b"\x91" * 100_000
        + b"\x90",
        "RecursionError: maximum recursion depth exceeded",
    ),
}


@pytest.mark.parametrize("frame,reason", _REJECTED.values(), ids=_REJECTED.keys())
def test_undecodable_requests_with_a_readable_id_are_rejected(
    frame: bytes, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="engine_core._engine.wire"):
        rejected = decode_client_message(client_message_decoder(), frame)
    assert isinstance(rejected, RejectedRequest)
    assert rejected.request_id == "r1"
    assert rejected.error.startswith("the engine could not decode the request: ")
    assert reason in rejected.error
    assert len(rejected.error) <= 600
    assert (
        caplog.records[0]
        .getMessage()
        .startswith(f"rejected request 'r1': an invalid message of {len(frame)} bytes")
    )


@pytest.mark.parametrize("frame", _INVALID_FRAMES.values(), ids=_INVALID_FRAMES.keys())
def test_frames_without_a_readable_id_are_dropped(frame: bytes) -> None:
    message = decode_client_message(client_message_decoder(), frame)
    # "truncated" and "invalid-params" start with a readable id; the others do not.
    if frame in (_INVALID_FRAMES["truncated"], _INVALID_FRAMES["invalid-params"]):
        assert message == RejectedRequest("r1", message.error)  # type: ignore[union-attr]
    else:
        assert message is None


@pytest.mark.parametrize(
    "frame,request_id",
    [
        (encode(EngineCoreRequest("x" * 31, [1], SamplingParams())), "x" * 31),  # fixstr
        (encode(EngineCoreRequest("y" * 200, [1], SamplingParams())), "y" * 200),  # str 8
        (encode(EngineCoreRequest("z" * 300, [1], SamplingParams())), "z" * 300),  # str 16
        (encode(EngineCoreRequest("w" * 70_000, [1], SamplingParams())), "w" * 70_000),  # str 32
        (encode(["add", "\u00e9t\u00e9"]), "\u00e9t\u00e9"),
        (b"\xdc\x00\x02\xa3add\xa1q", "q"),  # array 16
        (b"\xdd\x00\x00\x00\x02\xa3add\xa1q", "q"),  # array 32
        (encode(["add", 5]), None),
        (encode(["add"]), None),
        (encode(["abort", "x"]), None),
        (encode({"add": "x"}), None),
        (b"\x92\xa3add\xa5ab", None),  # the id itself is cut short
        (b"\x92\xa3add\xa2\xff\xfe", None),  # not UTF-8
        (b"", None),
    ],
)
def test_read_add_request_id(frame: bytes, request_id: str | None) -> None:
    assert read_add_request_id(frame) == request_id


# -- whatever constructs crosses the wire --------------------------------------------------------


_JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**65), max_value=2**65),
        st.floats(allow_nan=False),
        st.text(st.characters(exclude_categories=()), max_size=3),
    ),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=12,
)


_STRUCTURED: dict[str, st.SearchStrategy[Any]] = {
    "json": st.one_of(
        st.dictionaries(st.text(max_size=3), _JSON_VALUES, max_size=3), st.text(min_size=1)
    ),
    "json_object": st.just(True),
    "regex": st.text(min_size=1, max_size=4),
    "choice": st.lists(st.text(max_size=3), min_size=1, max_size=3),
    "grammar": st.text(min_size=1, max_size=4),
}


@st.composite
def _structured(draw: st.DrawFn) -> Any:
    """Valid StructuredOutputsParams, or whatever failed to make one (hostile itself)."""
    name = draw(st.sampled_from(sorted(_STRUCTURED)))
    value = draw(_mostly(_STRUCTURED[name]))
    try:
        return StructuredOutputsParams(**{name: value})
    except (TypeError, ValueError):
        return value


def _mostly(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``plausible`` about nine times in ten, else a hostile value."""
    return st.integers(0, 9).flatmap(lambda i: HOSTILE if i == 9 else plausible)


_FIELDS = {name: _mostly(plausible) for name, plausible in SAMPLING_FIELDS.items()}
_FIELDS["structured_outputs"] = st.one_of(st.none(), _structured())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kwargs=st.fixed_dictionaries({}, optional=_FIELDS),
    priority=st.one_of(st.integers(-5, 5), HOSTILE),
    cache_salt=st.one_of(st.none(), st.text(max_size=3), HOSTILE),
)
def test_what_constructs_and_passes_the_front_end_round_trips(
    kwargs: dict[str, Any], priority: Any, cache_salt: Any
) -> None:
    try:  # anything but TypeError or ValueError fails the test
        params = SamplingParams(**kwargs)
        check_request(EngineConfig(), params, priority=priority, cache_salt=cache_salt)
    except (TypeError, ValueError):
        return
    request = EngineCoreRequest("r", [1, 2**63 - 1], params, 1.5, priority, [257], cache_salt)
    frame = encode(request)
    decoded = client_message_decoder().decode(frame)
    assert encode(decoded) == frame
    assert decoded == request
    assert isinstance(decoded, EngineCoreRequest)
    assert decoded.sampling_params.output_kind is params.output_kind
