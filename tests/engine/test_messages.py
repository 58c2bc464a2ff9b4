from __future__ import annotations

import logging
import random

import msgspec
import pytest

from engine_core._core.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineStats,
    FinishedRequest,
)
from engine_core._engine.wire import (
    AbortRequests,
    EngineDead,
    Ready,
    Shutdown,
    UtilityCall,
    UtilityReply,
    client_message_decoder,
    decode,
    engine_message_decoder,
)
from engine_core.abc import TokenLogprobs
from engine_core.sampling_params import SamplingParams

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
    assert encode(outputs) == encode(["out", ["r1"], [[4]], [], {}, {}, {}, 0.0])
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
    ]
    assert encode(AbortRequests(["r1"])) == encode(["abort", ["r1"]])


def test_stats_reply_converts_back_to_engine_stats() -> None:
    stats = EngineStats(
        num_running=1,
        num_waiting=2,
        kv_cache_usage=0.5,
        prefix_cache_hit_rate=0.25,
        num_preemptions=3,
        num_steps=4,
        num_kv_blocks=64,
        num_free_kv_blocks=32,
    )
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
