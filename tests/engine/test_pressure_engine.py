"""The engine under KV pressure: refusal at arrival, ``seconds_since_progress`` and the stall
check, recomputed tokens in the stats, and a custom victim policy's bug ending the engine."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import anyio
import pytest
from helpers.clock import Clock

from engine_core import AsyncLLM, SamplingParams
from engine_core._core.engine_io import EngineCoreRequest, PauseMode
from engine_core._core.scheduler_output import CachedRequestData, SchedulerOutput
from engine_core._engine.core import EngineCore
from engine_core.config import EngineConfig
from engine_core.errors import EngineDeadError, EngineStalledError

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def _errors(core: EngineCore) -> dict[str, str]:
    errors: dict[str, str] = {}
    while core.has_unfinished_requests():
        for finished in core.step().finished:
            if finished.error:
                errors[finished.req_id] = finished.error
    return errors


def test_a_request_the_cache_cannot_hold_now_is_refused_at_arrival() -> None:
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte", num_kv_blocks=10))
    core.scheduler.kv.reserve_blocks(4)
    core.add_request(EngineCoreRequest("big", list(range(100)), PARAMS))  # 7 blocks
    core.add_request(EngineCoreRequest("ok", list(range(50)), PARAMS))
    assert "big" not in core.scheduler.requests  # never queued
    errors = _errors(core)
    assert list(errors) == ["big"]
    assert errors["big"] == (
        "the request needs 7 KV-cache blocks of 16 tokens for its 100 tokens and the 3 it must "
        "generate, but one request can hold at most 6 blocks (the cache has 10, 4 of them "
        "pinned or parked)"
    )


def test_a_queued_request_is_refused_when_the_cache_shrinks_under_it() -> None:
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte", num_kv_blocks=10))
    core.add_request(EngineCoreRequest("held", list(range(100)), PARAMS))
    core.scheduler.kv.reserve_blocks(4)
    assert "needs 7 KV-cache blocks" in _errors(core)["held"]


def _stuck(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = SchedulerOutput([], CachedRequestData([], [], [], []), 0)
    monkeypatch.setattr(core.scheduler, "schedule", lambda: empty)


def test_no_progress_for_stall_timeout_s_fails_the_health_check_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock(100.0)
    config = EngineConfig(backend="mock", tokenizer="byte", stall_timeout_s=60.0)
    core = EngineCore(config, clock=clock)
    clock.now = 500.0  # idle time before the first request is no stall
    core.add_request(EngineCoreRequest("a", [1, 2, 3], PARAMS))
    _stuck(core, monkeypatch)
    core.step()
    clock.now += 59.0
    core.check_health()
    assert core.get_stats().seconds_since_progress == pytest.approx(59.0)
    assert core.stall_wait_s() == pytest.approx(1.0)
    clock.now += 2.0
    with caplog.at_level(logging.ERROR):
        core.step()
        core.step()
        with pytest.raises(
            EngineStalledError, match="no token computed for 61 s .stall_timeout_s 60"
        ):
            core.check_health()
    logged = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(logged) == 1
    assert "waiting: a(waiting, 3 tokens, 0 computed, 0 bypassed); running: none" in logged[0]
    assert core.stall_wait_s() is None  # logged: nothing more to wake for
    # A "keep" pause freezes requests on purpose: no stall.
    core.pause_generation(PauseMode.KEEP)
    core.check_health()
    assert core.get_stats().seconds_since_progress == 0.0
    core.resume_generation()
    monkeypatch.undo()
    core.step()
    core.check_health()
    assert core.get_stats().seconds_since_progress == 0.0


def test_recomputed_tokens_reach_the_stats() -> None:
    core = EngineCore(
        EngineConfig(
            backend="mock",
            tokenizer="byte",
            num_kv_blocks=8,
            max_model_len=128,
            enable_prefix_caching=False,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for name in "ab":
        core.add_request(EngineCoreRequest(name, list(range(1, 41)), params))
    assert _errors(core) == {}
    stats = core.get_stats()
    assert stats.num_preemptions >= 1
    assert stats.num_recomputed_tokens >= 40


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_custom_victim_policy_that_raises_ends_the_engine_with_that_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_victims.py").write_text(
        textwrap.dedent(
            """
            from engine_core.abc import PreemptionVictimPolicy

            class Broken(PreemptionVictimPolicy):
                def pick(self, running, requester):
                    raise KeyError("no victim today")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the engine process imports it too
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    async with AsyncLLM(
        backend="mock",
        tokenizer="byte",
        num_kv_blocks=8,
        max_model_len=128,
        preemption_victim="broken_victims:Broken",
    ) as engine:
        errors: list[EngineDeadError] = []

        async def run(prompt: str) -> None:
            try:
                async for _ in engine.generate(prompt, params):
                    pass
            except EngineDeadError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as task_group:
            for prompt in ("a" * 60, "b" * 60):
                task_group.start_soon(run, prompt)
    assert len(errors) == 2
    cause = str(errors[0].__cause__)
    assert "the preemption victim policy 'broken_victims:Broken' raised KeyError" in cause
