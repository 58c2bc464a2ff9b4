"""The mock's pretend tensor parallelism: real worker processes, the msgspec step broadcast,
per-rank KV sizing, control calls and worker deaths, without torch."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import anyio
import pytest
from engine_core_mock import MockBackend
from mock_driver import Driver

from engine_core import AsyncLLM, EngineDeadError, SamplingParams
from engine_core._workers import WorkerDiedError
from engine_core.abc import CachedRequestData, SchedulerOutput
from engine_core.config import EngineConfig
from engine_core.testing import check_backend

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _config(**options: object) -> EngineConfig:
    return EngineConfig(backend="mock", backend_options={"tensor_parallel_size": 2, **options})


def test_tp_mock_passes_the_backend_checks() -> None:
    check_backend(MockBackend, _config())


def test_sizing_takes_the_minimum_over_ranks_and_reports_per_rank_heads() -> None:
    backend = MockBackend(_config(tensor_parallel_memory_bytes=[8 << 30, 4 << 30]))
    try:
        fraction = backend.config.kv_cache_memory_fraction
        assert backend.available_kv_cache_memory() == int((4 << 30) * fraction)
        assert backend.kv_cache_spec().num_kv_heads == 4  # 8 synthetic heads over 2 ranks
    finally:
        backend.close()


def test_workers_model_the_steps_and_close() -> None:
    d = Driver(tensor_parallel_size=2)
    backend = d.backend
    assert backend.workers is not None
    assert backend.supports_async_scheduling is False  # as the CUDA backend under TP
    d.step(new=[d.new("a", [1, 2, 3]), d.new("b", [4, 5])])
    d.step(cached=[("a", 3, 1, None), ("b", 2, 1, None)])
    assert backend.workers.call("num_steps") == [2]
    assert backend.workers.call("num_live_requests") == [2]
    process = backend.workers.processes[1]
    backend.close()
    assert process.returncode == 0


def test_killed_worker_fails_the_next_step_naming_its_rank() -> None:
    d = Driver(tensor_parallel_size=2)
    assert d.backend.workers is not None
    d.step(new=[d.new("a", [1, 2, 3])])
    process = d.backend.workers.processes[1]
    process.kill()
    process.wait()
    with pytest.raises(WorkerDiedError, match=r"rank 1 was killed by signal 9"):
        for _ in range(100):  # the watcher thread records the death
            d.step(cached=[("a", d.backend.num_computed_tokens("a"), 1, None)])
            time.sleep(0.01)
    d.backend.close()


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
@pytest.mark.anyio
async def test_kill_9_of_rank_1_reaches_the_caller_as_engine_dead_within_a_second() -> None:
    options = {"tensor_parallel_size": 2, "latency": {"step_s": 0.001}}
    async with AsyncLLM(backend="mock", tokenizer="byte", backend_options=options) as engine:
        outs: list[object] = []
        failed: list[tuple[float, str]] = []

        async def consume() -> None:
            with pytest.raises(EngineDeadError) as info:
                async for out in engine.generate("abc", SamplingParams(max_tokens=5000, **GREEDY)):
                    outs.append(out)
            failed.append((time.monotonic(), str(info.value)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with anyio.fail_after(5):
                while not outs:
                    await anyio.sleep(0.005)
            (worker,) = _children(engine._client.pid)  # type: ignore[union-attr]
            killed_at = time.monotonic()
            os.kill(worker, signal.SIGKILL)
        assert failed[0][0] - killed_at < 1.0
        assert "rank 1" in failed[0][1]


def test_a_worker_error_is_reported_and_fails_the_next_step() -> None:
    d = Driver(tensor_parallel_size=2)
    assert d.backend.workers is not None
    d.step(new=[d.new("a", [1, 2, 3])])
    # Only the worker is told of a request it has never seen: it fails and says why.
    d.backend.workers.step(
        SchedulerOutput([], CachedRequestData(["ghost"], [None], [3], [1]), 1), None
    )
    with pytest.raises(WorkerDiedError, match=r"rank 1 failed: RuntimeError: request 'ghost'"):
        for _ in range(100):
            d.step(cached=[("a", d.backend.num_computed_tokens("a"), 1, None)])
            time.sleep(0.01)
    d.backend.close()
