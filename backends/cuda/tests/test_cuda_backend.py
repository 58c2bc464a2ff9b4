"""The backend in the engine: discovery, the startup handshake, state that persists between
steps, and the control calls (profiler, sleep/wake, dtype)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_core_cuda import CudaBackend
from engine_core_cuda._options import CPU_DEFAULT_KV_CACHE_BYTES, DEVICE_ENV
from engine_core_cuda._provider import provider
from hf_reference import PROMPTS, greedy
from tiny_models import TinyModel

from engine_core import LLM, SamplingParams
from engine_core._plugins import list_backends, resolve_backend
from engine_core.abc import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core.config import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_discovery_imports_neither_torch_nor_triton() -> None:
    script = (
        "import sys; from engine_core._plugins import list_backends; "
        "info = list_backends()['cuda']; "
        "print(info.usable, sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'triton', 'numpy', 'engine_core_cuda')))"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != DEVICE_ENV}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
    )
    usable = torch.cuda.is_available()
    # The provider reads the requested device through the options module, which imports no torch.
    expected = "['engine_core_cuda', 'engine_core_cuda._options', 'engine_core_cuda._provider']"
    assert result.stdout.strip() == f"{usable} {expected}"


def test_usable_on_the_cpu_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = EngineConfig(backend="cuda", backend_options={"device": "cpu"})
    assert provider.is_available(cpu) == (True, "CPU (torch CPU tensors, Triton interpreter)")
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    if not torch.cuda.is_available():
        usable, detail = provider.is_available()
        assert not usable
        assert detail.startswith("no CUDA device found; backend_options={'device': 'cpu'}")
        assert not list_backends()["cuda"].usable
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert resolve_backend("cuda").name == "cuda"


def test_auto_runs_a_model_on_the_cpu_and_says_so(
    tiny: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``backend="auto"`` with a model and no GPU runs the model (the CUDA backend on the CPU),
    never the mock's counting tokens, and says so in one warning."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: auto runs the model there")
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    model = tiny["llama"]
    with caplog.at_level("WARNING", logger="engine_core._plugins"):
        llm = LLM(model=str(model.path), max_model_len=64, num_kv_blocks=16)
    with llm:
        assert llm._client.info.backend == "cuda"
        assert isinstance(llm._client.engine_core.backend, CudaBackend)
        (out,) = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    expected = greedy(model.hf, out.prompt_token_ids, GREEDY.max_tokens or 0)
    assert out.outputs[0].token_ids == expected
    (record,) = [r for r in caplog.records if r.name == "engine_core._plugins"]
    assert record.getMessage().startswith(
        f"backend 'auto': cuda runs the model {model.path} with {{'device': 'cpu'}} "
        "(no CUDA device found;"
    )


def test_the_handshake_sizes_the_kv_cache(tiny: dict[str, TinyModel]) -> None:
    model = tiny["qwen3"]
    block_bytes = 2 * 2 * 16 * 2 * 32 * 4  # layers, K and V, block, kv heads, head size, fp32
    options = {"kv_cache_bytes": 100 * block_bytes + 5}
    with model.llm(num_kv_blocks=None, backend_options=options) as llm:
        backend = llm._client.engine_core.backend
        spec = backend.kv_cache_spec()
        assert (spec.num_layers, spec.num_kv_heads, spec.head_size, spec.dtype_bytes) == (
            2, 2, 32, 4)  # fmt: skip
        assert spec.bytes_per_block(16) == block_bytes
        assert llm._client.info.num_kv_blocks == 100
        kv = backend.runner.kv_caches
        assert len(kv) == 2 and kv[0][0].shape == (100, 16, 2, 32)
        # Per-layer views of one tensor.
        assert kv[1][1].untyped_storage().data_ptr() == kv[0][0].untyped_storage().data_ptr()
    with model.llm(num_kv_blocks=None) as llm:
        assert llm._client.info.num_kv_blocks <= CPU_DEFAULT_KV_CACHE_BYTES // block_bytes


def test_steps_send_only_diffs(tiny: dict[str, TinyModel]) -> None:
    """After a request's first step nothing of its context is sent again; sampled tokens are
    written into the persistent rows on the device."""
    config = EngineConfig(
        model=str(tiny["llama"].path), backend="cuda", backend_options={"device": "cpu"},
        block_size=4, max_model_len=64,
    )  # fmt: skip
    backend = CudaBackend(config)
    try:
        backend.initialize_kv_cache(32)
        batch = backend.runner.batch
        prompt = list(range(3, 23))
        new = NewRequestData("r", prompt, SamplingParams(temperature=0.0), list(range(5)), 0, 20)
        backend.execute_model(SchedulerOutput([new], CachedRequestData(), 20))
        first = backend.sample_tokens(None).sampled_token_ids[0]
        row = batch.requests["r"].row
        assert batch.token_ids[row, :21].tolist() == [*prompt, *first]
        staged: list[tuple[int, list[int]]] = []
        flush = batch.flush

        def recording_flush() -> None:
            staged.append((len(batch._token_writes.values), list(batch._block_writes[0].values)))
            flush()

        batch.flush = recording_flush  # type: ignore[method-assign]
        tokens = [*first]
        for step in range(6):
            computed = 20 + step
            new_blocks = {20: [5], 24: [6]}.get(computed)
            cached = CachedRequestData(["r"], [new_blocks], [computed], [1])
            backend.execute_model(SchedulerOutput([], cached, 1))
            forward = backend.runner._forward
            assert forward is not None and forward.step is not None
            assert forward.step.positions.tolist() == [computed]
            tokens += backend.sample_tokens(None).sampled_token_ids[0]
        # No token was sent again; the block table only received its new blocks.
        assert staged == [(0, [5]), (0, []), (0, []), (0, []), (0, [6]), (0, [])]
        assert batch.token_ids[row, : 20 + len(tokens)].tolist() == prompt + tokens
        assert batch.block_table[row, :7].tolist() == [0, 1, 2, 3, 4, 5, 6]
        assert tokens == greedy(tiny["llama"].hf, prompt, 7)
        backend.execute_model(SchedulerOutput([], CachedRequestData(), 0, finished_req_ids=["r"]))
        backend.sample_tokens(None)
        assert batch.requests == {}
    finally:
        backend.close()


def test_a_scheduler_contract_violation_raises(tiny: dict[str, TinyModel]) -> None:
    config = EngineConfig(
        model=str(tiny["llama"].path), backend="cuda", backend_options={"device": "cpu"}
    )
    backend = CudaBackend(config)
    try:
        backend.initialize_kv_cache(8)
        with pytest.raises(RuntimeError, match="cached request 'ghost' is unknown"):
            backend.execute_model(
                SchedulerOutput([], CachedRequestData(["ghost"], [None], [3], [1]), 1)
            )
    finally:
        backend.close()


def test_profiler_writes_a_trace(tiny: dict[str, TinyModel], tmp_path: Path) -> None:
    options = {"profile_dir": str(tmp_path / "traces")}
    with tiny["llama"].llm(backend_options=options) as llm:
        llm._client.call_utility("profile", "start")
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        llm._client.call_utility("profile", "stop")
    traces = list((tmp_path / "traces").glob("trace-*.json"))
    assert len(traces) == 1 and "aten::linear" in traces[0].read_text()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_keep_the_model(tiny: dict[str, TinyModel], level: int) -> None:
    model = tiny["qwen2"]
    with model.llm(enable_prefix_caching=False) as llm:
        first = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0]
        llm._client.call_utility("sleep", level)
        backend = llm._client.engine_core.backend
        assert backend.is_sleeping and backend.runner.kv_caches == []
        if level == 2:
            assert backend.runner.model.model.norm.weight.numel() == 0
        llm._client.call_utility("wake_up")
        after = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    expected = greedy(model.hf, first.prompt_token_ids, 6)
    assert first.outputs[0].token_ids == after == expected


def test_bfloat16_on_the_cpu(tiny: dict[str, TinyModel]) -> None:
    with tiny["llama"].llm(dtype="bfloat16") as llm:
        backend = llm._client.engine_core.backend
        assert backend.dtype == torch.bfloat16 and backend.kv_cache_spec().dtype_bytes == 2
        out = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 6
