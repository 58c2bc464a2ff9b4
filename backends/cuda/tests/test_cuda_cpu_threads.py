"""torch's threads on the CPU: the option, ``OMP_NUM_THREADS``, the default (usable cores less
one), per tensor-parallel rank; applied on the thread that steps; shown at startup."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from engine_core_cuda import _device
from engine_core_cuda._device import resolve_cpu_threads
from engine_core_cuda._options import parse_options
from tiny_models import TinyModel

from engine_core import EngineConfig, SamplingParams
from engine_core._core.engine_io import EngineInfo

pytestmark = pytest.mark.usefixtures("torch_threads")  # the backend sets the count


@pytest.mark.parametrize(
    ("cores", "expected"), [(1, 1), (2, 1), (3, 2), (16, 15)], ids=["1", "2", "3", "16"]
)
def test_the_default_leaves_a_core(
    monkeypatch: pytest.MonkeyPatch, cores: int, expected: int
) -> None:
    monkeypatch.setattr(_device, "usable_cpus", lambda: cores)
    threads = resolve_cpu_threads(None, environ={})
    assert (threads.threads, threads.source) == (expected, f"{cores} cores - 1")


def test_the_option_wins_then_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_device, "usable_cpus", lambda: 8)
    env = {"OMP_NUM_THREADS": "3"}
    assert resolve_cpu_threads(5, environ=env).describe() == "5 (cpu_threads)"
    assert resolve_cpu_threads(None, environ=env).describe() == "3 (OMP_NUM_THREADS)"
    # Not a positive count: as if unset.
    for value in ("0", "", "four", "-2"):
        assert resolve_cpu_threads(None, environ={"OMP_NUM_THREADS": value}).threads == 7


def test_ranks_divide_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_device, "usable_cpus", lambda: 9)
    threads = resolve_cpu_threads(None, 2, environ={})
    assert threads.describe() == "4 (9 cores - 1, over 2 ranks)"
    assert resolve_cpu_threads(None, 16, environ={}).threads == 1
    assert resolve_cpu_threads(3, 2, environ={}).threads == 3  # the option is per rank


@pytest.mark.parametrize(
    ("text", "expected"), [("max 100000", None), ("150000 100000", 2), ("50000 100000", 1)]
)
def test_a_cgroup_quota_caps_the_cores(tmp_path: Path, text: str, expected: int | None) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(text + "\n")
    assert _device._cgroup_cpu_limit(str(path)) == expected
    assert _device._cgroup_cpu_limit(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("value", [0, -1, "2", True, 1.5])
def test_bad_cpu_threads_are_rejected(value: object) -> None:
    config = EngineConfig(backend="cuda", backend_options={"device": "cpu", "cpu_threads": value})
    with pytest.raises(ValueError, match="cpu_threads"):
        parse_options(config)


def test_the_startup_line_shows_the_backend_settings() -> None:
    info = EngineInfo(
        num_kv_blocks=8, block_size=16, max_model_len=64, vocab_size=10, backend="cuda",
        backend_options={"device": "cpu"},
        backend_settings={"device": "cpu", "cpu_threads": "1 (2 cores - 1)"},
    )  # fmt: skip
    assert info.describe().startswith(
        "backend cuda {'device': 'cpu'} (device cpu, cpu_threads 1 (2 cores - 1)); KV cache 8 "
    )


def test_the_engine_steps_on_its_threads_on_any_thread(tiny: dict[str, TinyModel]) -> None:
    """Built on this thread, stepped on another whose torch ran with 2 threads: each step sets
    the engine's count on the thread it runs on; the startup line says it."""
    llm = tiny["llama"].llm(backend_options={"cpu_threads": 1})
    try:
        assert "cpu_threads 1 (cpu_threads)" in llm.info.describe()
        assert "dtype float32, kernels torch" in llm.info.describe()
        seen: list[int] = []

        def step_elsewhere() -> None:
            torch.set_num_threads(2)
            outs = llm.generate(
                [{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=3, ignore_eos=True)
            )
            seen.extend([len(outs[0].outputs[0].token_ids), torch.get_num_threads()])

        thread = threading.Thread(target=step_elsewhere)
        thread.start()
        thread.join(timeout=120)
        assert seen == [3, 1]
    finally:
        llm.close()
