"""The mock's pretend tensor parallelism: real worker processes, the msgspec step broadcast,
per-rank KV sizing, control calls and worker deaths, without torch."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from engine_core_mock import MockBackend
from engine_core_mock._worker import MockWorker
from mock_driver import Driver

from engine_core import LLM, SamplingParams
from engine_core._core.engine_io import EngineCoreOutputs, EngineCoreRequest
from engine_core._engine.core import EngineCore
from engine_core._workers import Sampled, Step, WorkerDiedError
from engine_core.abc import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core.config import EngineConfig
from engine_core.testing import check_backend, check_worker_death

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _config(**options: object) -> EngineConfig:
    return EngineConfig(backend="mock", backend_options={"tensor_parallel_size": 2, **options})


def test_tp_mock_passes_the_backend_checks() -> None:
    check_backend(MockBackend, _config())


def test_tp_mock_passes_the_backend_checks_with_async_scheduling() -> None:
    # A latency model: the steps take device time, and the engine schedules asynchronously.
    config = _config(latency={"step_s": 0.0002})
    backend = MockBackend(config)
    try:
        assert backend.supports_async_scheduling and backend.step_in_thread
    finally:
        backend.close()
    check_backend(MockBackend, config)


# -- the sampled ids reach the workers only once their step has run ------------------------------


def _worker() -> MockWorker:
    worker = MockWorker(_config(), 1, 2, "")
    worker.call("initialize_kv_cache", [64])
    greedy = SamplingParams(temperature=0.0)
    prefill = SchedulerOutput([NewRequestData("a", [1, 2, 3], greedy, [0, 1], 0, 3)],
                              CachedRequestData(), 3)  # fmt: skip
    worker.step(Step(prefill))
    return worker


DECODE = Step(SchedulerOutput([], CachedRequestData(["a"], [None], [3], [1]), 1))


def test_a_worker_holds_a_step_back_until_the_previous_steps_ids_arrive() -> None:
    worker = _worker()
    worker.step(DECODE)  # launched before step 1's ids exist (async scheduling)
    assert (worker.num_steps, worker.computed["a"], worker.num_held) == (1, 3, 1)
    worker.sampled(Sampled(1, [[4]]))
    assert (worker.num_steps, worker.computed["a"]) == (2, 4)
    with pytest.raises(
        RuntimeError, match="ids of step 1 arrived; the worker awaits those of step 2"
    ):
        worker.sampled(Sampled(1, [[5]]))


def test_a_step_run_without_the_previous_steps_ids_fails_the_worker() -> None:
    worker = _worker()
    worker.step(DECODE)
    # Ids that do not include the token the decode step reads: the step would run on stale
    # inputs, and the worker's checks catch it.
    with pytest.raises(RuntimeError, match=r"request 'a': 4 tokens scheduled, the worker knows 3"):
        worker.sampled(Sampled(1, [[]]))


def _workload(tp: int, async_scheduling: bool) -> tuple[dict[str, list[int]], int, int]:
    """Chunked prefills, prefix hits, preemptions (few blocks) and an abort with a token in
    flight, stepped to the end: the tokens per request, the preemptions and the worker's held
    steps."""
    options: dict[str, object] = {"latency": {"step_s": 0.0002}}
    if tp > 1:
        options["tensor_parallel_size"] = tp
    core = EngineCore(
        EngineConfig(
            backend="mock", tokenizer="byte", block_size=4, num_kv_blocks=12, max_model_len=48,
            max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=async_scheduling,
            backend_options=options,
        )
    )  # fmt: skip
    assert core.async_scheduling is async_scheduling
    shared = list(b"a shared prefix")
    tokens: dict[str, list[int]] = {}
    try:
        for i in range(6):
            params = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=12,
                                    ignore_eos=True)  # fmt: skip
            prompt = (shared if i % 3 else []) + list(f"request {i}".encode())
            core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
            tokens[f"r{i}"] = []
        aborted = False
        for _ in range(500):
            if not core.has_unfinished_requests():
                break
            outputs: EngineCoreOutputs = core.step()
            for rid, new in zip(outputs.req_ids, outputs.new_token_ids, strict=True):
                tokens[rid].extend(new)
            if not aborted and len(tokens["r2"]) >= 3:
                core.abort_requests(["r2"])  # under async scheduling its next token is in flight
                aborted = True
        assert not core.has_unfinished_requests()
        backend = core.backend
        workers = backend.workers  # type: ignore[attr-defined]
        held = workers.call("num_held")[0] if workers is not None else 0
        return tokens, core.scheduler.num_preemptions, held
    finally:
        core.close()


def test_tp2_async_scheduling_gives_the_tokens_of_sync_and_of_tp1() -> None:
    one, _, _ = _workload(1, False)
    sync, preemptions, sync_held = _workload(2, False)
    asynchronous, _, held = _workload(2, True)
    assert sync == one and asynchronous == one
    assert preemptions > 0 and sync_held == 0
    assert held > 0  # the workers did receive steps before the previous step's ids


def test_tp2_async_scheduling_with_stop_strings_gives_the_texts_of_tp1() -> None:
    prompts = [f"prompt {c}" for c in "abcdef"]
    params = [SamplingParams(max_tokens=20, stop=[s], **GREEDY) for s in ("s", "v", "xy", "zz")]
    texts = {}
    for tp, async_scheduling in ((1, False), (2, True)):
        options: dict[str, object] = {"latency": {"step_s": 0.0002}, "tensor_parallel_size": tp}
        with LLM(backend="mock", tokenizer="byte", backend_options=options,
                 async_scheduling=async_scheduling, max_num_batched_tokens=16, max_num_seqs=4) as llm:  # fmt: skip
            outs = llm.generate(prompts, [params[i % 4] for i in range(6)], use_tqdm=False)
        texts[tp] = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
    assert texts[2] == texts[1]
    assert sum(reason == "stop" for _, reason in texts[2]) >= 4


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
    assert backend.supports_async_scheduling is True
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


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.anyio
async def test_kill_9_of_rank_1_reaches_the_caller_as_engine_dead_within_a_second(
    async_scheduling: bool,
) -> None:
    options = {"tensor_parallel_size": 2, "latency": {"step_s": 0.001}}
    await check_worker_death(
        EngineConfig(
            backend="mock", tokenizer="byte", backend_options=options,
            async_scheduling=async_scheduling,
        )
    )  # fmt: skip


def test_a_step_in_flight_fails_when_a_worker_dies() -> None:
    d = Driver(tensor_parallel_size=2, latency={"step_s": 0.001})
    backend = d.backend
    assert backend.workers is not None
    backend.execute_model(SchedulerOutput([d.new("a", [1, 2, 3])], CachedRequestData(), 3))
    handle = backend.sample_tokens_async(None)
    process = backend.workers.processes[1]
    process.kill()
    process.wait()
    assert backend.workers.failure() is not None  # the death is recorded
    with pytest.raises(WorkerDiedError, match=r"rank 1 was killed by signal 9"):
        handle.get_output()
    backend.close()


def test_a_message_to_a_dead_worker_fails_instead_of_blocking() -> None:
    """Once a worker's connection is gone its PUSH socket takes no frame: a send must notice the
    death (the pending step's sampled ids are sent without a check first)."""
    d = Driver(tensor_parallel_size=2)
    workers = d.backend.workers
    assert workers is not None
    process = workers.processes[1]
    process.kill()
    process.wait()
    with pytest.raises(WorkerDiedError, match=r"rank 1 was killed by signal 9"):
        for step in range(1, 1_000_000):  # frames queue until the connection's end is seen
            workers.sampled(step, [])
            time.sleep(0.001)
    d.backend.close()


def test_a_worker_error_is_reported_and_fails_the_next_step() -> None:
    d = Driver(tensor_parallel_size=2)
    assert d.backend.workers is not None
    d.step(new=[d.new("a", [1, 2, 3])])
    # Only the worker is told of a request it has never seen: it fails and says why.
    d.backend.workers.step(SchedulerOutput([], CachedRequestData(["ghost"], [None], [3], [1]), 1))
    with pytest.raises(WorkerDiedError, match=r"rank 1 failed: RuntimeError: request 'ghost'"):
        for _ in range(100):
            d.step(cached=[("a", d.backend.num_computed_tokens("a"), 1, None)])
            time.sleep(0.01)
    d.backend.close()
