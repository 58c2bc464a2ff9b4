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


async def test_health_metrics_and_the_rank_header() -> None:
    body = {"model": "engine-core", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
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
