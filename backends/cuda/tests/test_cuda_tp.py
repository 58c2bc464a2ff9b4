"""Tensor parallelism on the CPU: two gloo ranks (rank 0 here, rank 1 a worker process), tiny
models in float32. Multi-process tests are few and small: each starts a worker (a second Python
importing torch)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from engine_core_cuda import CudaBackend
from engine_core_cuda._hf_config import load_model_config
from engine_core_cuda._model_runner import ModelRunner
from engine_core_cuda._options import parse_options
from engine_core_cuda._tp.parallel import TensorParallel
from engine_core_cuda._tp.shard import shard_model_config, slice_of
from tiny_models import TinyModel

from engine_core import SamplingParams
from engine_core._engine.startup import resolve_async_scheduling
from engine_core._workers import WorkerDiedError
from engine_core.abc import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core.config import EngineConfig
from engine_core.testing import (
    BACKEND_CHECKS,
    BackendFactory,
    check_async_scheduling,
    check_logprobs,
    check_mixed_batch,
    check_preemption,
    check_worker_death,
)

CPU = {"device": "cpu", "kernels": "torch"}
PROMPTS = [
    "the engine",
    "decode prefill batch step chunk prefix cache model",
    "a",
    "graph kernel tensor layer head query key value",
    "token block cache model batch step",
    "rotary norm weight paged memory device",
    "request stream output prompt greedy random",
    "sample seed graph kernel",
]

# -- the sharding rules (one process) ------------------------------------------------------------


def test_shard_geometry_and_the_fields_that_do_not_divide(tiny: dict[str, TinyModel]) -> None:
    config = load_model_config(tiny["qwen3"].path)  # 4 heads, 2 KV heads, intermediate 128
    local = shard_model_config(config, 2)
    assert (local.num_heads, local.num_kv_heads) == (2, 1)
    assert local.intermediate_size == config.intermediate_size // 2
    assert local.vocab_size == config.vocab_size  # rank 0 samples over the whole vocabulary
    assert shard_model_config(config, 4).num_kv_heads == 1  # replicated: 2 KV heads, 4 ranks
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\)") as info:
        shard_model_config(config, 3)
    assert "num_key_value_heads (2)" in str(info.value)
    odd = dataclasses.replace(config, intermediate_size=130)
    with pytest.raises(ValueError, match=r"intermediate_size \(130\)"):
        shard_model_config(odd, 4)


def test_a_model_that_does_not_shard_fails_before_any_process_starts(
    tiny: dict[str, TinyModel],
) -> None:
    config = EngineConfig(
        model=str(tiny["llama"].path), backend="cuda", backend_options=CPU, tensor_parallel_size=3
    )
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\)"):
        CudaBackend(config)
    assert not _worker_pids(os.getpid())


def test_checkpoint_slices(tiny: dict[str, TinyModel]) -> None:
    c = load_model_config(tiny["qwen2"].path)  # head 16, vocab 384
    h = c.head_size
    q = slice_of("model.layers.0.self_attn.q_proj.bias", 1, c, 1, 2)
    assert q is not None and (q.dim, q.start, q.stop) == (0, 2 * h, 4 * h)
    # 2 KV heads on 4 ranks: ranks 2 and 3 both hold KV head 1.
    k = slice_of("model.layers.0.self_attn.k_proj.weight", 2, c, 3, 4)
    assert k is not None and (k.start, k.stop) == (h, 2 * h)
    o = slice_of("model.layers.1.self_attn.o_proj.weight", 2, c, 1, 2)
    assert o is not None and (o.dim, o.start, o.stop) == (1, 2 * h, 4 * h)
    down = slice_of("model.layers.0.mlp.down_proj.weight", 2, c, 0, 2)
    assert down is not None and (down.dim, down.stop) == (1, c.intermediate_size // 2)
    assert slice_of("model.layers.0.self_attn.o_proj.bias", 1, c, 1, 2) is None  # added once
    assert slice_of("model.norm.weight", 1, c, 1, 2) is None
    vocab = slice_of("lm_head.weight", 2, c, 4, 5)  # 384 rows over 5 ranks: 77 each, padded
    assert vocab is not None and (vocab.start, vocab.stop, vocab.rows) == (308, 384, 77)


# -- bitwise: two processes vs a one-process simulation of the same shards -----------------------


class _Exchange:
    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.slots: list[torch.Tensor | None] = [None] * size


class _SimulatedParallel(TensorParallel):
    """Ranks as threads of one process; an all-reduce adds the ranks' tensors in rank order."""

    def __init__(self, rank: int, size: int, exchange: _Exchange) -> None:
        super().__init__(rank, size, "simulated")
        self.exchange = exchange

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        ex = self.exchange
        if self.rank == 0:
            ex.slots[0] = x.clone()
        ex.barrier.wait()
        if self.rank:
            source = ex.slots[0]
            assert source is not None
            x.copy_(source)
        ex.barrier.wait()
        return x

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        ex = self.exchange
        ex.slots[self.rank] = x.clone()
        ex.barrier.wait()
        total = ex.slots[0]
        assert total is not None
        total = total.clone()
        for other in ex.slots[1:]:
            assert other is not None
            total += other
        ex.barrier.wait()
        x.copy_(total)
        return x


def _steps(block_ids: list[list[int]], prompts: list[list[int]], decodes: int) -> list:
    """A prefill of every prompt, then ``decodes`` decode steps of all of them."""
    greedy = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    new = [
        NewRequestData(f"r{i}", p, greedy, block_ids[i], 0, len(p)) for i, p in enumerate(prompts)
    ]
    outputs = [SchedulerOutput(new, CachedRequestData(), sum(map(len, prompts)))]
    for step in range(decodes):
        ids = [f"r{i}" for i in range(len(prompts))]
        computed = [len(p) + step for p in prompts]
        cached = CachedRequestData(ids, [None] * len(ids), computed, [1] * len(ids))
        outputs.append(SchedulerOutput([], cached, len(ids)))
    return outputs


def test_tp2_logits_equal_a_one_process_simulation_of_the_shards(
    tiny: dict[str, TinyModel],
) -> None:
    model = tiny["qwen2"]  # QKV bias: the bias rows follow the heads
    config = EngineConfig(
        model=str(model.path), backend="cuda", backend_options=CPU, dtype="float32",
        max_model_len=256, tensor_parallel_size=2,
    )  # fmt: skip
    tokenizer_ids = [[5 + i, 40 + 3 * i, 7, 100 + i, 9][: 2 + i] for i in range(3)]
    blocks = [[i * 4 + b for b in range(4)] for i in range(3)]
    outputs = _steps(blocks, tokenizer_ids, 4)

    backend = CudaBackend(config)
    try:
        # The workers take the sampled ids from a device broadcast: steps may be launched early.
        assert resolve_async_scheduling(config, backend) is True
        backend.initialize_kv_cache(16)
        real: list[torch.Tensor] = []
        for out in outputs:
            backend.execute_model(out)
            forward = backend.runner._forward
            assert forward is not None and forward.logits is not None
            real.append(forward.logits.clone())
            backend.sample_tokens(None)
    finally:
        backend.close()

    simulated = _simulate(config, model.path, 2, outputs)
    for got, expected in zip(real, simulated, strict=True):
        assert torch.equal(got, expected)


def _simulate(
    config: EngineConfig, model_dir: Path, size: int, outputs: list[SchedulerOutput]
) -> list[torch.Tensor]:
    """Rank 0's logits of each step with the ranks as threads of this process (the others take
    rank 0's sampled ids from its broadcast, as the workers do); every rank's logits are checked
    equal."""
    options = parse_options(msgspec.structs.replace(config, tensor_parallel_size=1))
    full = load_model_config(model_dir)
    exchange = _Exchange(size)
    runners = [
        ModelRunner(config, options, full, _SimulatedParallel(r, size, exchange))
        for r in range(size)
    ]
    for runner in runners:
        runner.allocate_kv_cache(16)
    logits: list[list[torch.Tensor]] = [[] for _ in range(size)]

    def run(rank: int) -> None:
        runner = runners[rank]
        with torch.inference_mode():
            for out in outputs:
                runner.execute_model(out)
                forward = runner._forward
                assert forward is not None and forward.logits is not None
                logits[rank].append(forward.logits.clone())
                if rank == 0:
                    runner.sample_tokens(None)
                else:
                    step = runner.skip_sampling()
                    assert step is not None
                    runner.receive_tokens(step)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(len(found) == len(outputs) for found in logits)
    for other in logits[1:]:
        assert all(torch.equal(a, b) for a, b in zip(logits[0], other, strict=True))
    return logits[0]


def assert_shards_match_tp1(config: EngineConfig, ranks: int, outputs: list) -> None:
    """``ranks`` simulated shards' logits for ``outputs`` within float32 rounding of TP=1's."""
    path = Path(config.model or "")
    sharded = _simulate(config, path, ranks, outputs)
    single = ModelRunner(config, parse_options(config), load_model_config(path))
    single.allocate_kv_cache(16)
    with torch.inference_mode():
        for out, got in zip(outputs, sharded, strict=True):
            single.execute_model(out)
            forward = single._forward
            assert forward is not None and forward.logits is not None
            torch.testing.assert_close(got, forward.logits, rtol=0, atol=1e-4)
            single.sample_tokens(None)


@pytest.mark.parametrize("kind", ["qwen3", "gemma2"])
def test_four_simulated_ranks_replicating_kv_heads_match_tp1(
    tiny: dict[str, TinyModel], kind: str
) -> None:
    """4 ranks over 2 KV heads (each replicated on two ranks), Qwen3's q/k norms and its
    head_dim != hidden / heads, Gemma 2's windows, soft caps (the final one after the gather)
    and norms: the shards' logits stay within float32 rounding of TP=1."""
    model = tiny[kind]
    config = EngineConfig(
        model=str(model.path), backend="cuda", backend_options=CPU, dtype="float32",
        max_model_len=256,
    )  # fmt: skip
    prompts = [[5 + i, 40 + 3 * i, 7, 100 + i, 9][: 2 + i] for i in range(3)]
    outputs = _steps([[i * 4 + b for b in range(4)] for i in range(3)], prompts, 4)
    assert_shards_match_tp1(config, 4, outputs)


# -- against TP=1 ------------------------------------------------------------------------------


def _greedy(model: TinyModel, tp: int) -> list[tuple[list[int], list[float]]]:
    """Tokens and the top-2 logprob margin at each position."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    with model.llm(tensor_parallel_size=tp, dtype="float32", multiprocess=False) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    found = []
    for out in outs:
        c = out.outputs[0]
        assert c.logprobs is not None
        margins = []
        for entry in c.logprobs:
            top = sorted((lp.logprob for lp in entry.values()), reverse=True)
            margins.append(top[0] - top[1])
        found.append((list(c.token_ids), margins))
    return found


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3"])
def test_tp2_greedy_tokens_equal_tp1(tiny: dict[str, TinyModel], kind: str) -> None:
    one = _greedy(tiny[kind], 1)
    two = _greedy(tiny[kind], 2)
    compared = 0
    for (expected, margins), (got, _) in zip(one, two, strict=True):
        for position, (a, b) in enumerate(zip(expected, got, strict=True)):
            if margins[position] < 1e-4:
                break  # a near-tie: the sequences may part here
            assert a == b, (kind, position)
            compared += 1
    assert compared >= 0.9 * len(PROMPTS) * 16


# -- the contract and failures -------------------------------------------------------------------


# Each check starts a backend, hence a worker importing torch (~4 s on 2 loaded cores): the
# checks that reach TP-specific paths (rows reused after preemption, prompt logprobs from
# gathered logits, steps launched before the previous step's ids reached the host) run by
# default, the rest of ``check_backend`` under ``slow``. Prefix hits and preemptions under both
# schedulings are also in test_tp2_async_scheduling_gives_the_tokens_of_sync_and_of_tp1.
TP_CHECKS = (check_mixed_batch, check_preemption, check_logprobs, check_async_scheduling)


def _tp_config(tiny: dict[str, TinyModel]) -> EngineConfig:
    return EngineConfig(
        model=str(tiny["llama"].path), backend="cuda", backend_options=CPU,
        max_model_len=256, tensor_parallel_size=2,
    )  # fmt: skip


@pytest.mark.parametrize("check", TP_CHECKS, ids=lambda c: c.__name__)
def test_tp2_passes_the_backend_checks_on_its_paths(
    tiny: dict[str, TinyModel], check: Callable[[BackendFactory, EngineConfig | None], None]
) -> None:
    check(CudaBackend, _tp_config(tiny))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_passes_the_rest_of_check_backend(tiny: dict[str, TinyModel]) -> None:
    """With the checks above, the whole of ``check_backend`` (async scheduling included)."""
    for check in BACKEND_CHECKS:
        if check not in TP_CHECKS:
            check(CudaBackend, _tp_config(tiny))


# -- async scheduling ------------------------------------------------------------------------


# Few blocks (preemption) and a small token budget (chunked prefill).
SMALL = {
    "block_size": 4, "num_kv_blocks": 32, "max_model_len": 128, "max_num_batched_tokens": 16,
    "max_num_seqs": 4, "dtype": "float32",
}  # fmt: skip


def _outputs(outs: list[Any]) -> list[tuple[list[int], str, str | None]]:
    return [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason)
            for o in outs]  # fmt: skip


def test_tp2_async_scheduling_gives_the_tokens_of_sync_and_of_tp1(
    tiny: dict[str, TinyModel],
) -> None:
    """Chunked prefills, prefix hits, forced preemptions and stop strings (the front end aborts
    those requests in the engine), with a step always in flight: the workers' input ids come
    from rank 0's device broadcast, never from the host."""
    model = tiny["llama"]
    shared = PROMPTS[3]
    prompts = [*PROMPTS[:6], shared + " again", shared + " and more"]
    margins_params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with model.llm(**SMALL) as llm:
        one = llm.generate(prompts, margins_params, use_tqdm=False)
    stops = [
        SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, stop=[o.outputs[0].text[8:11]]
        )
        for o in one
    ]
    results = {}
    for async_scheduling in (False, True):
        with model.llm(tensor_parallel_size=2, async_scheduling=async_scheduling, **SMALL) as llm:
            core = llm._client.engine_core  # type: ignore[attr-defined]
            assert core.async_scheduling is async_scheduling
            plain = _outputs(llm.generate(prompts, params, use_tqdm=False))
            stopped = _outputs(llm.generate(prompts, stops, use_tqdm=False))
            stats = llm.get_stats()
            assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        results[async_scheduling] = (plain, stopped)
    assert results[True] == results[False]
    assert any(reason == "stop" for _, _, reason in results[True][1])
    compared = 0
    for out, (got, _, _) in zip(one, results[True][0], strict=True):
        entries = out.outputs[0].logprobs
        assert entries is not None
        for position, (a, b) in enumerate(zip(out.outputs[0].token_ids, got, strict=True)):
            top = sorted((lp.logprob for lp in entries[position].values()), reverse=True)
            if top[0] - top[1] < 1e-4:
                break  # a near-tie: the sequences may part here
            assert a == b, position
            compared += 1
    assert compared >= 0.9 * len(prompts) * 24


class _NeverReady:
    """A step's handle whose device work never completes (a collective waiting for a peer)."""

    device_time_s = None

    def ready(self) -> bool:
        return False

    def get_output(self) -> object:
        raise AssertionError("a handle whose step never completed returned its output")


def test_a_pending_step_fails_when_a_worker_dies(tiny: dict[str, TinyModel]) -> None:
    backend = CudaBackend(_tp_config(tiny))
    try:
        assert backend.tp is not None
        handle = backend.tp.watch(_NeverReady())  # type: ignore[arg-type]
        process = backend.tp.workers.processes[1]
        killed_at = time.monotonic()
        process.kill()
        with pytest.raises(WorkerDiedError, match=r"rank 1 was killed by signal 9"):
            handle.get_output()
        assert time.monotonic() - killed_at < 1.0
    finally:
        backend.close()


def _chunked(backend: CudaBackend) -> list[list[int]]:
    """A partial prefill chunk alone (nothing sampled, so nothing broadcast), its last chunk,
    then a decode step: the tokens sampled."""
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    steps = [
        SchedulerOutput([NewRequestData("r", prompt, greedy, [0, 1, 2, 3], 0, 3)],
                        CachedRequestData(), 3),
        SchedulerOutput([], CachedRequestData(["r"], [None], [3], [2]), 2),
        SchedulerOutput([], CachedRequestData(["r"], [None], [5], [1]), 1),
    ]  # fmt: skip
    sampled = []
    for out in steps:
        backend.execute_model(out)
        sampled.append(backend.sample_tokens(None).sampled_token_ids[0])
    return sampled


def test_steps_that_sample_nothing_and_a_close_after_a_step_rank_0_did_not_finish(
    tiny: dict[str, TinyModel],
) -> None:
    """Every rank skips the broadcast of a step that samples nothing (the ranks would otherwise
    pair different collectives). Then a step that fails on rank 0 before its sampling leaves the
    workers waiting in its broadcast: closing kills them rather than waiting for an answer they
    cannot give."""
    single = CudaBackend(msgspec.structs.replace(_tp_config(tiny), tensor_parallel_size=1))
    try:
        single.initialize_kv_cache(16)
        expected = _chunked(single)
    finally:
        single.close()
    backend = CudaBackend(_tp_config(tiny))
    assert backend.tp is not None
    process = backend.tp.workers.processes[1]
    try:
        backend.initialize_kv_cache(16)
        got = _chunked(backend)
        assert got[0] == [] and got == expected
        backend.execute_model(SchedulerOutput([], CachedRequestData(["r"], [None], [6], [1]), 1))
    finally:
        started = time.monotonic()
        backend.close()
    assert time.monotonic() - started < 2.0
    assert process.returncode is not None


def test_a_worker_dying_during_the_rendezvous_fails_startup_naming_it(
    tiny: dict[str, TinyModel],
) -> None:
    """Rank 0 waits in the rendezvous for a worker killed meanwhile: startup fails at once with
    the rank, not at the store's timeout. In a process of its own: the rendezvous rank 0 left
    stays in torch's process-wide group state until the store's timeout, and a later
    tensor-parallel test in the same process would wait behind it."""
    config = msgspec.json.encode(_tp_config(tiny)).decode()
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import test_cuda_tp; test_cuda_tp.startup_with_rank_1_killed_in_the_rendezvous({config!r})"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "startup failed naming rank 1" in done.stdout


def startup_with_rank_1_killed_in_the_rendezvous(config_json: str) -> None:
    """The body of the test above, in its own process (which it ends: the abandoned rendezvous
    thread must not hold up the interpreter's exit)."""
    config = msgspec.json.decode(config_json, type=EngineConfig)
    killed_at: list[float] = []

    def kill_rank_1_once_the_store_exists() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                for pid in _worker_pids(os.getpid()):
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if Path(argv[3].decode(), "store").exists():  # a rank is in the rendezvous
                        os.kill(pid, signal.SIGKILL)
                        killed_at.append(time.monotonic())
                        return
            except OSError:
                pass  # a process ended while it was looked at
            time.sleep(0.002)

    killer = threading.Thread(target=kill_rank_1_once_the_store_exists)
    killer.start()
    try:
        with pytest.raises(WorkerDiedError, match=r"rank 1 was killed by signal 9"):
            CudaBackend(config)
    finally:
        killer.join()
    assert killed_at and time.monotonic() - killed_at[0] < 1.0
    assert not _worker_pids(os.getpid())
    print("startup failed naming rank 1", flush=True)
    sys.stdout.flush()
    os._exit(0)


def _worker_pids(parent: int) -> list[int]:
    pids = []
    for task in Path(f"/proc/{parent}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"engine_core_cuda._tp.worker" in cmdline:
                pids.append(int(child))
    return pids


@pytest.fixture
def anyio_backend() -> str:
    """One runtime: the death path is the engine's own (tested under both with the mock's
    pretend TP); this test pays for an engine process and a worker importing torch."""
    return "asyncio"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
@pytest.mark.anyio
async def test_kill_9_of_rank_1_is_an_engine_death_naming_it_within_a_second(
    tiny: dict[str, TinyModel],
) -> None:
    config = EngineConfig(
        model=str(tiny["llama"].path), backend="cuda", backend_options=CPU, max_model_len=256,
        num_kv_blocks=96, tensor_parallel_size=2, async_scheduling=True,
    )  # fmt: skip
    await check_worker_death(config, worker_pids=_worker_pids)
