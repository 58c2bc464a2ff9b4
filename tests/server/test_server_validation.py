"""Hostile request bodies get a 400 naming the field, at once, under asyncio and trio: values
beyond 64 bits, limits a request can never meet (never a retryable 503), and a deeply nested
JSON schema; the engine holds no request afterwards."""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import pytest
from helpers.serving import serving

pytestmark = pytest.mark.anyio


BASE = {"prompt": "abc", "max_tokens": 2, "temperature": 0.0}
# (extra body fields, the param the 400 names, a piece of its message)
BAD_BODIES: dict[str, tuple[dict[str, Any], str | None, str]] = {
    "n-billion": ({"n": 10**9, "temperature": 1.0}, "n", "n must be at most 128 (max_n)"),
    "n-over-max": ({"n": 129, "temperature": 1.0}, "n", "n must be at most 128"),
    "n-huge": ({"n": 10**30, "temperature": 1.0}, "n", "n must be between"),
    "max-tokens": ({"max_tokens": 2**64}, "max_tokens", "max_tokens must be between"),
    "seed": ({"seed": -(2**64)}, "seed", "seed must be between"),
    "top-k": ({"top_k": 2**70}, "top_k", "top_k must be between"),
    "stop-token-ids": ({"stop_token_ids": [2**70]}, "stop_token_ids", "below 2**63"),
    "priority": ({"priority": 2**64}, "priority", "priority must be between"),
    "stops": ({"stop": ["x"] * 65}, "stop", "stop must hold at most 64 strings"),
    "stop-len": ({"stop": ["x" * 1025]}, "stop", "at most 1024 characters long"),
    "deep-schema-text": (
        {"structured_outputs": {"json": "[" * 100_000}},
        "structured_outputs",
        "structured_outputs.json is nested deeper than 100 levels",
    ),
    "deep-schema": (
        {"structured_outputs": {"json": json.loads("[" * 110 + "]" * 110)}},
        "structured_outputs",
        "got `array` - at `$.structured_outputs.json`",
    ),
    "deep-schema-dict": (
        {"structured_outputs": {"json": json.loads('{"a":' * 110 + "1" + "}" * 110)}},
        "structured_outputs",
        "structured_outputs.json is nested deeper than 100 levels",
    ),
    "deep-body": (
        {"structured_outputs": {"json": json.loads('{"a":' * 150 + "1" + "}" * 150)}},
        "structured_outputs",
        "the body nests arrays and objects deeper than 128 levels",
    ),
    "prompt-ids": ({"prompt": [1, 2**64]}, "prompt", "is outside the vocabulary"),
}


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc", "mp"])
async def test_hostile_bodies_get_a_400_naming_the_field(multiprocess: bool) -> None:
    async with serving(multiprocess=multiprocess, max_num_seqs=1, max_queued_requests=1) as (
        client,
        engine,
    ):
        with anyio.fail_after(20):
            for name, (fields, param, message) in BAD_BODIES.items():
                response = await client.post("/v1/completions", json={**BASE, **fields})
                assert response.status_code == 400, (name, response.text)
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error", name
                assert error["param"] == param, (name, error)
                assert message in error["message"], (name, error)
            chat = await client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "n": 10**9},
            )
            assert chat.status_code == 400
            assert chat.json()["error"]["param"] == "n"
            stats = await engine.get_stats()
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            ok = await client.post("/v1/completions", json=BASE)
            assert ok.status_code == 200
            assert ok.json()["choices"][0]["text"] == "de"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),
        ("/tokenize", b'{"prompt": "a\\udc00"}', "prompt"),
        ("/tokenize", b'{"model": "mock", "prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", b'{"prompt": "x\\ud83d", "max_tokens": 2}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
            "messages",
        ),
    ],
)
async def test_a_lone_surrogate_is_named_as_such(path: str, body: bytes, param: str) -> None:
    async with serving(multiprocess=False) as (client, _engine):
        headers = {"content-type": "application/json"}
        response = await client.post(path, content=body, headers=headers)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == param
        assert "lone UTF-16 surrogate" in error["message"]
        assert "truncated" not in error["message"]
        pair = body.replace(b"\\ud800", b"\\ud83d\\ude00").replace(b"\\udc00", b"\\ud83d\\ude00")
        if path == "/tokenize" and pair != body:
            assert (await client.post(path, content=pair, headers=headers)).status_code == 200


def test_lone_surrogates_are_found_and_pairs_and_escaped_backslashes_are_not() -> None:
    from engine_core.server._serving import _lone_surrogate

    assert _lone_surrogate(rb'"\ud83d\ude00 \u00e9"') is None
    assert _lone_surrogate(rb'"\\ud800"') is None  # a backslash, then "ud800"
    assert _lone_surrogate(rb'"\\\ud800"') == (3, 9)
    assert _lone_surrogate(rb'"a\ud800"') == (2, 8)
    assert _lone_surrogate(rb'"\ud800\ud800\udc00"') == (1, 7)
    assert _lone_surrogate(rb'"\ud800 \udc00"') == (1, 7)
    assert _lone_surrogate(rb'"\udc00\ud800"') == (1, 7)
    # Linear in a run of backslashes (a backtracking scan would take minutes here).
    started = time.perf_counter()
    assert _lone_surrogate(b'{"stop": ["' + b"\\" * 300_001 + b'u"]}') is None
    assert time.perf_counter() - started < 2.0
