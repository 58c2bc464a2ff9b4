"""Async scheduling against synchronous scheduling through the front ends: the same outputs for
the same requests (n > 1, stop strings, logprobs, structured outputs, early exits), offline
(``LLM``) and streaming from an engine process under both runtimes (``AsyncLLM``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from helpers.differential import ENGINE, prompts, sampling_params, summary
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from engine_core.sampling_params import StructuredOutputsParams

pytest.importorskip("llguidance")


async_test = pytest.mark.anyio


@pytest.fixture(scope="module")
def llms() -> Iterator[tuple[LLM, LLM]]:
    with (
        LLM(**ENGINE, async_scheduling=False) as sync,
        LLM(**ENGINE, async_scheduling=True) as asynchronous,
    ):
        yield sync, asynchronous


PARAMS = sampling_params()
PROMPTS = prompts(["", "a shared prompt prefix ", "zz"])


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(prompts=PROMPTS, params=st.lists(PARAMS, min_size=6, max_size=6))
def test_llm_outputs_are_those_of_synchronous_scheduling(
    llms: tuple[LLM, LLM], prompts: list[tuple[str, str]], params: list[SamplingParams]
) -> None:
    texts = [(prefix + body) or "x" for prefix, body in prompts]
    per_prompt = params[: len(texts)]
    sync, asynchronous = llms
    expected = sync.generate(texts, per_prompt, use_tqdm=False)
    got = asynchronous.generate(texts, per_prompt, use_tqdm=False)
    assert summary(got) == summary(expected)
    assert not asynchronous.get_stats().num_running


async def _stream(engine: AsyncLLM, index: int, stop_after: int | None) -> Any:
    """The stream's tokens, text, logprobs and finish reason (deltas merge when the consumer
    lags, so their boundaries are not compared); with ``stop_after``, its first tokens."""
    params = SamplingParams(
        temperature=0.0 if index % 2 else 0.8,
        seed=index,
        max_tokens=12 + index,
        stop=["q"] if index % 3 == 0 else [],
        logprobs=1 if index % 4 == 0 else None,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=(
            StructuredOutputsParams(choice=["yes", "no way", "maybe so"])
            if index % 6 == 5
            else None
        ),
    )
    text, tokens, logprobs, finish = "", [], [], None
    async for out in engine.generate(f"prompt {index} " * (index % 5 + 1), params, f"r{index}"):
        c = out.outputs[0]
        text += c.text
        tokens += c.token_ids
        logprobs += c.logprobs or []
        finish = c.finish_reason
        if stop_after is not None and len(tokens) >= stop_after:
            return tokens[:stop_after]  # leaving early aborts the request
    return text, tokens, logprobs, finish


async def _streams(async_scheduling: bool) -> tuple[dict[int, list[Any]], float]:
    results: dict[int, list[Any]] = {}
    options = {"latency": {"step_s": 0.002}}
    async with AsyncLLM(
        **ENGINE, async_scheduling=async_scheduling, backend_options=options
    ) as engine:

        async def one(i: int) -> None:
            results[i] = await _stream(engine, i, 3 if i % 5 == 4 else None)

        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(one, i)
        stats = await engine.get_stats()
        assert stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
    return results, stats.device_busy_s


@async_test
async def test_async_llm_streams_are_those_of_synchronous_scheduling() -> None:
    expected, sync_busy = await _streams(False)
    got, async_busy = await _streams(True)
    assert got == expected
    assert sync_busy > 0 and async_busy > 0
