"""Data parallelism: two engine-core processes behind one AsyncLLM (and LLM), on the mock."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from engine_core import (
    LLM,
    AsyncLLM,
    RequestOutput,
    RetryableRequestError,
    SamplingParams,
)
from engine_core._engine.dp.client import DPClient

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [("shared prefix " * 4) + f"question {i}" for i in range(12)]


def _dp(**kwargs: Any) -> AsyncLLM:
    return AsyncLLM(backend="mock", tokenizer="byte", data_parallel_size=2, **kwargs)


async def _text(engine: AsyncLLM, prompt: str, **kwargs: Any) -> str:
    outs: list[RequestOutput] = [o async for o in engine.generate(prompt, GREEDY, **kwargs)]
    assert outs[-1].finished
    return outs[-1].outputs[0].text


def _expected() -> list[str]:
    with LLM(backend="mock", tokenizer="byte") as single:
        return [o.outputs[0].text for o in single.generate(PROMPTS, GREEDY, use_tqdm=False)]


async def test_two_engines_serve_like_one_and_aggregate_their_stats() -> None:
    expected = _expected()
    async with _dp(max_num_seqs=4) as engine:
        client = engine._client
        assert isinstance(client, DPClient)
        texts: dict[int, str] = {}
        async with anyio.create_task_group() as tg:
            for i, prompt in enumerate(PROMPTS):

                async def run(i: int = i, prompt: str = prompt) -> None:
                    texts[i] = await _text(engine, prompt)

                tg.start_soon(run)
        assert [texts[i] for i in range(len(PROMPTS))] == expected
        stats = await engine.get_stats()
        assert stats.num_engines == stats.num_engines_alive == 2
        assert stats.engine_ranks == [0, 1]
        per = stats.engines
        assert all(s.num_steps > 0 for s in per)  # both engines served
        assert stats.num_steps == sum(s.num_steps for s in per)
        assert stats.num_kv_blocks == sum(s.num_kv_blocks for s in per)
        assert stats.prefix_cache_hits == sum(s.prefix_cache_hits for s in per)
        assert stats.prefix_cache_queries == sum(s.prefix_cache_queries for s in per)
        assert stats.prefix_cache_hit_rate == stats.prefix_cache_hits / stats.prefix_cache_queries
        free = sum(s.num_free_kv_blocks for s in per)
        assert stats.kv_cache_usage == 1.0 - free / stats.num_kv_blocks
        # control calls reach every engine
        await engine.pause_generation("keep")
        assert await engine.is_paused()
        await engine.resume_generation()
        assert not await engine.is_paused()
        assert await engine.reset_prefix_cache()
        await engine.check_health()
        snapshot = await engine._call("kv_cache_snapshot")
        assert snapshot == [[], []]  # reset above


async def test_pinning_aborts_and_router_accuracy() -> None:
    async with _dp(backend_options={"latency": {"step_s": 0.002}}) as engine:
        client = engine._client
        assert isinstance(client, DPClient)
        # Quiet engines, one request at a time: the router predicts the hits exactly.
        for i in range(6):
            await _text(engine, ("a long common system prompt " * 3) + f"turn {i % 3}")
        metrics = client.metrics
        assert sum(metrics.actual_hit_tokens) > 0
        assert metrics.predicted_hit_tokens == metrics.actual_hit_tokens
        # A pinned request goes to its engine.
        before = (await engine.get_stats()).engines[1].prefix_cache_queries
        await _text(engine, "pinned", data_parallel_rank=1)
        assert (await engine.get_stats()).engines[1].prefix_cache_queries > before
        assert metrics.requests[1, "explicit"] == 1
        with pytest.raises(ValueError, match="data_parallel_rank"):
            await _text(engine, "x", data_parallel_rank=2)
        # An abort reaches the engine that runs the request.
        long = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
        async for _ in engine.generate("endless", long, data_parallel_rank=1):
            break
        with anyio.fail_after(10):
            while (await engine.get_stats()).engines[1].num_running:
                await anyio.sleep(0.01)
        assert not client._tracked


async def test_a_pin_to_a_dead_engine_fails_alone() -> None:
    fault = {"kind": "exit", "at_step": 1, "rank": 1}
    async with _dp(backend_options={"fault": fault}) as engine:
        # in flight when the engine dies: a retryable error naming the engine
        with pytest.raises(RetryableRequestError, match="engine 1 .* died"):
            await _text(engine, "to one", data_parallel_rank=1)
        # pinned to it after: retryable too (it may be restarted, or sent elsewhere)
        with pytest.raises(RetryableRequestError, match="not a live engine"):
            await _text(engine, "to one", data_parallel_rank=1)
        assert await _text(engine, "abc") == "defghijk"
        stats = await engine.get_stats()
        assert (stats.num_engines, stats.num_engines_alive) == (2, 1)


def test_offline_llm_with_two_engine_processes() -> None:
    expected = _expected()
    with LLM(
        backend="mock", tokenizer="byte", multiprocess=True, data_parallel_size=2, max_num_seqs=4
    ) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].text for o in outs] == expected
        stats = llm.get_stats()
        assert stats.num_engines_alive == 2
        assert all(s.num_steps > 0 for s in stats.engines)


def test_in_process_llm_refuses_data_parallelism() -> None:
    with pytest.raises(ValueError, match="multiprocess=True"):
        LLM(backend="mock", tokenizer="byte", data_parallel_size=2)
