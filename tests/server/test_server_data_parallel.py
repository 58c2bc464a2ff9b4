"""The server over two engines: /health lists them, /metrics labels each engine's series and
counts the router's decisions, the X-Data-Parallel-Rank header pins a request."""

from __future__ import annotations

import pytest
from helpers.serving import serving
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.anyio


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


BODY = {"model": "mock", "prompt": "hello there", "max_tokens": 4, "temperature": 0}


async def test_health_metrics_and_the_rank_header() -> None:
    body = BODY
    async with serving(data_parallel_size=2) as (client, _engine):
        health = await client.get("/health")
        assert health.status_code == 200
        assert [(e["rank"], e["alive"]) for e in health.json()["engines"]] == [(0, True), (1, True)]
        pinned = await client.post(
            "/v1/completions", json=body, headers={"X-Data-Parallel-Rank": "1"}
        )
        assert pinned.status_code == 200, pinned.text
        bad = await client.post("/v1/completions", json=body, headers={"X-Data-Parallel-Rank": "2"})
        assert bad.status_code == 400
        assert "X-Data-Parallel-Rank" in bad.json()["error"]["message"]
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        samples = _samples((await client.get("/metrics")).text)
    assert (
        samples["engine_core_router_requests_total", (("engine", "1"), ("reason", "explicit"))] == 1
    )
    assert samples["engine_core_engines_alive", ()] == 2
    queries = [
        samples["engine_core_prefix_cache_queries_total", (("engine", str(e)),)] for e in (0, 1)
    ]
    assert sum(queries) == 2 * len("hello there")
    assert ("engine_core_num_requests_running", (("engine", "0"),)) in samples
    assert ("engine_core_router_predicted_hit_tokens_total", (("engine", "0"),)) in samples


RESPONSES_BODY = {"model": "mock", "input": "hello there", "max_output_tokens": 4}
CHAT_BODY = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_the_rank_header_pins_responses_and_chat_too() -> None:
    async with serving(data_parallel_size=2) as (client, _engine):
        for path, body in [("/v1/responses", RESPONSES_BODY), ("/v1/chat/completions", CHAT_BODY)]:
            pinned = await client.post(path, json=body, headers={"X-Data-Parallel-Rank": "1"})
            assert pinned.status_code == 200, pinned.text
            bad = await client.post(path, json=body, headers={"X-Data-Parallel-Rank": "2"})
            assert bad.status_code == 400
            assert bad.json()["error"]["param"] == "X-Data-Parallel-Rank"
        samples = _samples((await client.get("/metrics")).text)
    explicit = samples[
        "engine_core_router_requests_total", (("engine", "1"), ("reason", "explicit"))
    ]
    assert explicit == 2


async def test_a_header_value_is_shown_as_the_text_it_is() -> None:
    async with serving(data_parallel_size=2) as (client, _engine):
        headers = [(b"X-Data-Parallel-Rank", "é1".encode())]
        bad = await client.post("/v1/completions", json=BODY, headers=headers)
        assert bad.status_code == 400
        message = bad.json()["error"]["message"]
        assert "got 'é1'" in message and "Ã" not in message


async def test_a_pin_to_a_dead_engine_is_a_retryable_503_naming_the_header() -> None:
    fault = {"kind": "exit", "at_step": 1, "rank": 1}
    async with serving(data_parallel_size=2, backend_options={"fault": fault}) as (client, _):
        to_one = {"X-Data-Parallel-Rank": "1"}
        await client.post("/v1/completions", json=BODY, headers=to_one)  # engine 1 dies in it
        for path, body in [
            ("/v1/completions", BODY),
            ("/v1/chat/completions", CHAT_BODY),
            ("/v1/responses", RESPONSES_BODY),
        ]:
            dead = await client.post(path, json=body, headers=to_one)
            assert dead.status_code == 503, (path, dead.text)
            error = dead.json()["error"]
            assert (error["param"], error["code"]) == ("X-Data-Parallel-Rank", "retry_later")
            assert "pins engine 1, which is not alive (alive: 0)" in error["message"]
            assert (await client.post(path, json=body)).status_code == 200  # unpinned: fine


async def test_disaggregated_health_lists_roles_and_a_pin_to_a_prefill_engine_is_a_400() -> None:
    roles = {"engine_roles": ["prefill", "decode"], "block_size": 4}
    async with serving(data_parallel_size=2, **roles) as (client, _engine):
        health = await client.get("/health")
        assert health.status_code == 200
        assert [e["role"] for e in health.json()["engines"]] == ["prefill", "decode"]
        pinned = await client.post(
            "/v1/completions", json=BODY, headers={"X-Data-Parallel-Rank": "0"}
        )
        assert pinned.status_code == 400
        error = pinned.json()["error"]
        assert error["param"] == "X-Data-Parallel-Rank"
        assert "prefill-only engine" in error["message"]
        plain = await client.post("/v1/completions", json=BODY)  # prefill, then decode
        assert plain.status_code == 200, plain.text
        decode = await client.post(
            "/v1/completions", json=BODY, headers={"X-Data-Parallel-Rank": "1"}
        )
        assert decode.status_code == 200, decode.text
        assert plain.json()["choices"][0]["text"] == decode.json()["choices"][0]["text"]
        samples = _samples((await client.get("/metrics")).text)
    assert samples["engine_core_disagg_handoffs_total", ()] == 1
    assert samples["engine_core_pd_exports_total", (("engine", "0"), ("role", "prefill"))] == 1
    assert samples["engine_core_pd_transfers_total", (("engine", "1"), ("role", "decode"))] == 1
    assert ("engine_core_pd_transfer_bytes_total", (("engine", "1"), ("role", "decode"))) in samples
    assert ("engine_core_pd_recomputes_total", (("engine", "1"), ("role", "decode"))) in samples
    path = (("engine", "1"), ("path", "shm"), ("role", "decode"))
    assert samples["engine_core_pd_path_transfers_total", path] == 1
    assert ("engine_core_pd_path_handoff_seconds_total", path) in samples
    assert ("engine_core_pd_lease_expired_total", (("engine", "0"), ("role", "prefill"))) in samples
