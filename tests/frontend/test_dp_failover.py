"""Data parallelism survives an engine's death: engine 1 of 2 exits mid-run under load, for each
``dp_failover`` mode; only when every engine is dead does the deployment fail."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import anyio
import pytest

from engine_core import (
    LLM,
    AsyncLLM,
    EngineDeadError,
    RequestOutputKind,
    RetryableRequestError,
    SamplingParams,
)
from engine_core._engine.dp import failover
from engine_core._engine.dp.client import DPClient

pytestmark = pytest.mark.anyio

PROMPTS = [f"request number {i} " * 3 for i in range(16)]
PARAMS = SamplingParams(
    temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA
)
FAULT = {"kind": "exit", "at_step": 6, "rank": 1}


def _expected() -> list[str]:
    final = PARAMS.clone(output_kind=RequestOutputKind.FINAL_ONLY)
    with LLM(backend="mock", tokenizer="byte") as single:
        return [o.outputs[0].text for o in single.generate(PROMPTS, final, use_tqdm=False)]


def _engine(mode: str, fault: dict[str, Any] = FAULT) -> AsyncLLM:
    return AsyncLLM(
        backend="mock",
        tokenizer="byte",
        data_parallel_size=2,
        max_num_seqs=4,
        dp_failover=mode,
        backend_options={"latency": {"step_s": 0.002}, "fault": fault},
    )


class _Stream:
    def __init__(self) -> None:
        self.text = ""
        self.times: list[float] = []
        self.error: BaseException | None = None


async def _run_all(engine: AsyncLLM) -> list[_Stream]:
    streams = [_Stream() for _ in PROMPTS]

    async def run(i: int) -> None:
        stream = streams[i]
        try:
            async for out in engine.generate(PROMPTS[i], PARAMS):
                stream.text += out.outputs[0].text
                stream.times.append(time.monotonic())
        except RetryableRequestError as exc:
            stream.error = exc

    with anyio.fail_after(30):  # no hang
        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(run, i)
    return streams


async def _after_the_failure(engine: AsyncLLM) -> None:
    outs = [o async for o in engine.generate("abc", PARAMS)]
    assert "".join(o.outputs[0].text for o in outs) == "defghijklmno"
    stats = await engine.get_stats()
    assert (stats.num_engines, stats.num_engines_alive, stats.engine_ranks) == (2, 1, [0])
    await engine.check_health()


@pytest.mark.parametrize("mode", ["retry", "fail", "resume"])
async def test_one_engine_dies_under_load(mode: str) -> None:
    expected = _expected()
    async with _engine(mode) as engine:
        client = engine._client
        assert isinstance(client, DPClient)
        streams = await _run_all(engine)
        failed = [i for i, s in enumerate(streams) if s.error is not None]
        for i, stream in enumerate(streams):
            if stream.error is None:
                assert stream.text == expected[i]
            else:
                assert "engine 1 of the data-parallel deployment died" in str(stream.error)
        moved = client.metrics.requests[0, "failover"]
        if mode == "resume":
            assert not failed
            assert moved >= 4  # started and unstarted ones
            # detection and recompute stay within a second: no stream paused longer
            gaps = [b - a for s in streams for a, b in zip(s.times, s.times[1:], strict=False)]
            assert max(gaps) < 1.0
        elif mode == "retry":
            assert failed and all(streams[i].times for i in failed)  # only started ones fail
            assert moved > 0  # unstarted ones moved to engine 0 and completed
        else:
            assert failed and moved == 0
            assert any(not streams[i].times for i in failed)  # unstarted ones fail too
        assert not client._tracked
        await _after_the_failure(engine)


async def test_when_every_engine_dies_the_deployment_is_dead() -> None:
    async with _engine("retry", {"kind": "exit", "at_step": 2}) as engine:
        errors: list[BaseException] = []

        async def run(rank: int) -> None:
            try:
                async for _ in engine.generate("abc", PARAMS, data_parallel_rank=rank):
                    pass
            except (RetryableRequestError, EngineDeadError) as exc:
                errors.append(exc)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, 0)
                tg.start_soon(run, 1)
        # the first death fails its request over (here: a retryable error), the last one is
        # the deployment's
        assert len(errors) == 2
        assert any(isinstance(e, EngineDeadError) for e in errors)
        assert "all 2 engine cores are dead" in str(engine.dead_error)
        with pytest.raises(EngineDeadError):
            await engine.get_stats()
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("abc", PARAMS):
                pass


async def test_a_dead_engine_restarts_and_rejoins() -> None:
    engine = AsyncLLM(
        backend="mock",
        tokenizer="byte",
        data_parallel_size=2,
        dp_restart_engines=True,
        backend_options={"fault": {"kind": "exit", "at_step": 2, "rank": 1}},
    )
    async with engine:
        client = engine._client
        assert isinstance(client, DPClient)
        with pytest.raises(RetryableRequestError, match="engine 1"):
            async for _ in engine.generate("abc", PARAMS, data_parallel_rank=1):
                pass
        with anyio.fail_after(30):
            while (await engine.get_stats()).num_engines_alive < 2:
                await anyio.sleep(0.05)
        assert client.metrics.engine_restarts == [0, 1]
        one = SamplingParams(temperature=0.0, max_tokens=1)
        outs = [o async for o in engine.generate("abc", one, data_parallel_rank=1)]
        assert outs[-1].outputs[0].text == "d"


def _kill_all(client: DPClient) -> None:
    for pid in client.pids:
        assert pid is not None
        os.kill(pid, signal.SIGKILL)


def _restarting_engine(**options: Any) -> AsyncLLM:
    return AsyncLLM(
        backend="mock",
        tokenizer="byte",
        data_parallel_size=2,
        max_num_seqs=4,
        dp_restart_engines=True,
        dp_failover="resume",
        backend_options={"latency": {"step_s": 0.01}},
        **options,
    )


async def test_when_every_engine_dies_with_restarts_on_requests_wait_for_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both engines are killed while streams run on them: the streams (resumed) and the
    # requests sent while none is alive wait for the restarted engines and complete exactly.
    monkeypatch.setattr(failover, "RESTART_BACKOFF_S", (0.2, 1.0))
    params = PARAMS.clone(max_tokens=40)
    final = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
    prompts = PROMPTS[:6]
    with LLM(backend="mock", tokenizer="byte") as single:
        expected = [o.outputs[0].text for o in single.generate(prompts, final, use_tqdm=False)]
    async with _restarting_engine() as engine:
        client = engine._client
        assert isinstance(client, DPClient)
        texts = [""] * len(prompts)
        started = [anyio.Event() for _ in prompts[:4]]

        async def run(i: int) -> None:
            async for out in engine.generate(prompts[i], params):
                texts[i] += out.outputs[0].text
                if i < len(started):
                    started[i].set()

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(len(started)):
                    tg.start_soon(run, i)
                for event in started:
                    await event.wait()
                _kill_all(client)
                while client.engines_alive:  # both deaths seen
                    await anyio.sleep(0.01)
                for i in range(len(started), len(prompts)):  # sent while none is alive
                    tg.start_soon(run, i)
        assert texts == expected
        assert engine.dead_error is None
        with anyio.fail_after(60):  # the second engine may come back after the work is done
            while (await engine.get_stats()).num_engines_alive < 2:
                await anyio.sleep(0.05)
        assert client.metrics.engine_restarts == [1, 1]
        outs = [o async for o in engine.generate("abc", PARAMS)]
        assert "".join(o.outputs[0].text for o in outs) == "defghijklmno"


async def test_a_request_waits_for_a_restart_no_longer_than_dp_restart_wait_s() -> None:
    async with _restarting_engine(dp_restart_wait_s=0.2) as engine:
        client = engine._client
        assert isinstance(client, DPClient)
        _kill_all(client)
        with anyio.fail_after(60):
            while client.engines_alive:
                await anyio.sleep(0.01)
            stats = await engine.get_stats()  # an outage, not an error
            assert (stats.num_engines, stats.num_engines_alive) == (2, 0)
            with pytest.raises(EngineDeadError, match="dead for now; 2 restarting"):
                await engine.check_health()
            began = time.monotonic()
            with pytest.raises(RetryableRequestError, match=r"dp_restart_wait_s \(0.2 s\)"):
                async for _ in engine.generate("abc", PARAMS):
                    pass
            assert time.monotonic() - began < 1.5  # an engine is back after 1 s and its start
            assert engine.dead_error is None  # the deployment comes back: the test above


async def test_resume_continues_seeded_sampling_exactly() -> None:
    seeded = SamplingParams(
        temperature=0.8,
        seed=7,
        max_tokens=12,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    with LLM(backend="mock", tokenizer="byte") as single:
        expected = [o.outputs[0].text for o in single.generate(PROMPTS, seeded, use_tqdm=False)]
    async with _engine("resume") as engine:
        texts: dict[int, str] = {}

        async def run(i: int) -> None:
            async for out in engine.generate(PROMPTS[i], seeded):
                texts[i] = out.outputs[0].text

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(run, i)
        client = engine._client
        assert isinstance(client, DPClient)
        assert client.metrics.requests[0, "failover"] > 0
        assert [texts[i] for i in range(len(PROMPTS))] == expected


def test_offline_llm_resumes_after_an_engine_dies() -> None:
    expected = _expected()
    final = PARAMS.clone(output_kind=RequestOutputKind.FINAL_ONLY)
    with LLM(
        backend="mock",
        tokenizer="byte",
        multiprocess=True,
        data_parallel_size=2,
        max_num_seqs=4,
        dp_failover="resume",
        backend_options={"latency": {"step_s": 0.002}, "fault": FAULT},
    ) as llm:
        outs = llm.generate(PROMPTS, final, use_tqdm=False)
        assert [o.outputs[0].text for o in outs] == expected
        assert llm.get_stats().num_engines_alive == 1
