"""AsyncLLM end to end on the mock backend, under asyncio and trio, in and out of process."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import anyio
import anyio.abc
import pytest

from engine_core import (
    AsyncLLM,
    EngineDeadError,
    RequestOutput,
    RequestOutputKind,
    RetryableRequestError,
    SamplingParams,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(multiprocess: bool = True, **kwargs: Any) -> AsyncLLM:
    return AsyncLLM(backend="mock", tokenizer="byte", multiprocess=multiprocess, **kwargs)


async def _collect(
    engine: AsyncLLM, prompt: str, params: SamplingParams, **kw: Any
) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, **kw)]


def _stepped_engine() -> AsyncLLM:
    """An engine in its own process whose steps take a millisecond: requests stay running."""
    return _engine(backend_options={"latency": {"step_s": 0.001}})


async def _consume(
    engine: AsyncLLM,
    sink: list[RequestOutput],
    params: SamplingParams,
    request_id: str | None = None,
) -> None:
    """Append every output of a request for "abc" to ``sink``."""
    async for out in engine.generate("abc", params, request_id=request_id):
        sink.append(out)


async def _streaming(outs: list[RequestOutput]) -> None:
    """Return once a stream's first output has arrived in ``outs``."""
    with anyio.fail_after(5):
        while not outs:
            await anyio.sleep(0.005)


async def _start_stream(
    task_group: anyio.abc.TaskGroup,
    engine: AsyncLLM,
    params: SamplingParams,
    request_id: str | None = None,
) -> list[RequestOutput]:
    """Start a request for "abc" in ``task_group``; its outputs, once the first has arrived."""
    outs: list[RequestOutput] = []
    task_group.start_soon(_consume, engine, outs, params, request_id)
    await _streaming(outs)
    return outs


async def _wait_idle(engine: AsyncLLM) -> Any:
    """Stats once the engine holds no request (aborts travel asynchronously)."""
    with anyio.fail_after(5):
        while True:
            stats = await engine.get_stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                return stats
            await anyio.sleep(0.01)


@pytest.mark.parametrize("multiprocess", [True, False], ids=["mp", "inproc"])
async def test_greedy_counts_up(multiprocess: bool) -> None:
    async with _engine(multiprocess) as engine:
        outs = await _collect(engine, "abc", SamplingParams(max_tokens=5, **GREEDY))
    assert outs[-1].outputs[0].text == "defgh"
    assert outs[-1].outputs[0].token_ids == [100, 101, 102, 103, 104]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert [o.finished for o in outs].count(True) == 1


async def test_100_concurrent_with_10_cancelled() -> None:
    latency = {"step_s": 0.0005}
    async with _engine(backend_options={"latency": latency}) as engine:
        results: dict[int, list[int]] = {}
        cancelled: set[int] = {i for i in range(0, 100, 10)}

        async def consume(i: int) -> None:
            if i in cancelled:
                n = 3 if i % 20 == 0 else 1
                params = SamplingParams(
                    max_tokens=5000, n=n, temperature=0.8 if n > 1 else 0.0, ignore_eos=True
                )
                with anyio.CancelScope() as scope:
                    seen = 0
                    async for _ in engine.generate("xyz", params, request_id=f"c{i}"):
                        seen += 1
                        if seen == 2:
                            scope.cancel()
                assert scope.cancelled_caught
                return
            params = SamplingParams(max_tokens=1 + i % 17, **GREEDY)
            outs = await _collect(engine, "hello", params, request_id=f"r{i}")
            results[i] = outs[-1].outputs[0].token_ids

        async with anyio.create_task_group() as tg:
            for i in range(100):
                tg.start_soon(consume, i)
        assert sorted(results) == sorted(set(range(100)) - cancelled)
        for i, tokens in results.items():
            assert len(tokens) == 1 + i % 17
            assert tokens == [(ord("o") + 1 + k) % 258 for k in range(1 + i % 17)]
        stats = await _wait_idle(engine)
        assert stats.kv_cache_usage == 0.0
        assert stats.num_free_kv_blocks == stats.num_kv_blocks


async def test_delta_concatenates_to_cumulative_and_slow_consumer_sees_everything() -> None:
    async with _stepped_engine() as engine:
        cumulative = await _collect(engine, "A", SamplingParams(max_tokens=40, **GREEDY))
        delta_params = SamplingParams(max_tokens=40, output_kind=RequestOutputKind.DELTA, **GREEDY)
        deltas = await _collect(engine, "A", delta_params)
        slow: list[RequestOutput] = []
        async for out in engine.generate("A", delta_params):
            slow.append(out)
            await anyio.sleep(0.01)  # a slow consumer: outputs merge meanwhile
    final = cumulative[-1].outputs[0]
    assert "".join(d.outputs[0].text for d in deltas) == final.text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == final.token_ids
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert "".join(d.outputs[0].text for d in slow) == final.text
    assert sum((d.outputs[0].token_ids for d in slow), []) == final.token_ids
    assert len(slow) < 40  # merged, not one per token


async def test_final_only_yields_once() -> None:
    async with _engine(multiprocess=False) as engine:
        params = SamplingParams(max_tokens=7, output_kind=RequestOutputKind.FINAL_ONLY, **GREEDY)
        outs = await _collect(engine, "abc", params)
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 7


async def test_leaving_the_loop_early_aborts_the_request() -> None:
    async with _stepped_engine() as engine:
        async for _ in engine.generate("abc", SamplingParams(max_tokens=5000, **GREEDY)):
            break
        stats = await _wait_idle(engine)
        assert stats.kv_cache_usage == 0.0


async def test_abort_by_user_id_reaches_all_children_and_ids_can_be_reused() -> None:
    async with _stepped_engine() as engine:
        params = SamplingParams(max_tokens=5000, n=3, temperature=1.0, seed=7, ignore_eos=True)
        async with anyio.create_task_group() as tg:
            outs = await _start_stream(tg, engine, params, "same")
            await engine.abort("same")
        assert outs[-1].finished
        assert {c.finish_reason for c in outs[-1].outputs} == {"abort"}
        assert await _wait_idle(engine)
        again = await _collect(
            engine, "abc", SamplingParams(max_tokens=2, **GREEDY), request_id="same"
        )
        assert again[-1].request_id == "same" and again[-1].outputs[0].text == "de"


async def test_pause_abort_rejects_until_resume() -> None:
    async with _stepped_engine() as engine:
        async with anyio.create_task_group() as tg:
            outs = await _start_stream(tg, engine, SamplingParams(max_tokens=5000, **GREEDY))
            await engine.pause_generation(mode="abort")
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert await engine.is_paused()
        with pytest.raises(RetryableRequestError):
            await _collect(engine, "abc", SamplingParams(max_tokens=2, **GREEDY))
        await engine.resume_generation()
        assert not await engine.is_paused()
        done = await _collect(engine, "abc", SamplingParams(max_tokens=2, **GREEDY))
        assert done[-1].outputs[0].text == "de"


async def test_pause_wait_lets_in_flight_finish() -> None:
    async with _stepped_engine() as engine:
        async with anyio.create_task_group() as tg:
            outs = await _start_stream(tg, engine, SamplingParams(max_tokens=60, **GREEDY))
            await engine.pause_generation(mode="wait")
            with pytest.raises(RetryableRequestError):
                await _collect(engine, "abc", SamplingParams(max_tokens=2, **GREEDY))
        assert outs[-1].outputs[0].finish_reason == "length"
        assert len(outs[-1].outputs[0].token_ids) == 60
        await engine.resume_generation()


async def test_pause_keep_freezes_and_queues() -> None:
    async with _stepped_engine() as engine:
        late: list[RequestOutput] = []
        async with anyio.create_task_group() as tg:
            outs = await _start_stream(tg, engine, SamplingParams(max_tokens=100, **GREEDY))
            await engine.pause_generation(mode="keep")
            frozen = await engine.get_stats()
            tg.start_soon(_consume, engine, late, SamplingParams(max_tokens=3, **GREEDY))
            await anyio.sleep(0.1)
            still = await engine.get_stats()
            assert still.num_steps == frozen.num_steps
            assert still.num_running == 1 and still.num_waiting == 1
            assert not outs[-1].finished and not late
            await engine.resume_generation()
        assert len(outs[-1].outputs[0].token_ids) == 100
        assert late[-1].outputs[0].text == "def"


async def test_reset_prefix_cache_false_while_blocks_held() -> None:
    async with _stepped_engine() as engine:
        outs: list[RequestOutput] = []

        async def consume() -> None:
            async for out in engine.generate("a" * 40, SamplingParams(max_tokens=5000, **GREEDY)):
                outs.append(out)
                if len(outs) == 3:
                    assert await engine.reset_prefix_cache() is False
                    return

        await consume()
        await _wait_idle(engine)
        assert await engine.reset_prefix_cache() is True


@pytest.mark.parametrize("kind", ["raise", "exit"])
async def test_engine_death_reaches_every_caller(kind: str) -> None:
    fault = {"kind": kind, "at_step": 20}
    async with _engine(backend_options={"fault": fault}) as engine:
        with pytest.raises(EngineDeadError) as info:
            await _collect(engine, "abc", SamplingParams(max_tokens=1000, **GREEDY))
        if kind == "raise":
            assert "mock fault injected" in "".join(
                str(e) for e in (info.value, info.value.__cause__) if e is not None
            )
        with pytest.raises(EngineDeadError):
            await _collect(engine, "abc", SamplingParams(max_tokens=2, **GREEDY))
        with pytest.raises(EngineDeadError):
            await engine.check_health()


async def test_kill_9_detected_within_a_second() -> None:
    async with _stepped_engine() as engine:
        outs: list[RequestOutput] = []
        failed_at: list[float] = []

        async def consume() -> None:
            with pytest.raises(EngineDeadError):
                async for out in engine.generate("abc", SamplingParams(max_tokens=5000, **GREEDY)):
                    outs.append(out)
            failed_at.append(time.monotonic())

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await _streaming(outs)
            pid = engine._client.pid  # type: ignore[union-attr]
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
        assert failed_at[0] - killed_at < 1.0
        with pytest.raises(EngineDeadError):
            await engine.get_stats()


async def test_backend_failing_at_startup_reports_its_message() -> None:
    with pytest.raises(ValueError, match=r"status 1.*bogus"):
        async with _engine(backend_options={"bogus": 1}):
            pass


async def test_closing_aborts_in_flight_streams() -> None:
    async with anyio.create_task_group() as tg, _stepped_engine() as engine:
        outs = await _start_stream(tg, engine, SamplingParams(max_tokens=5000, **GREEDY))
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
