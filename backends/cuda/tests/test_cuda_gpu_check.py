"""``bench/gpu_check.py`` on a machine without CUDA: its arguments, its refusal, and its CPU
smoke run (toy sizes, Triton interpreted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_help_lists_the_options() -> None:
    result = _run("--help")
    assert result.returncode == 0
    for option in ("--only", "--batch-sizes", "--context", "--bandwidth", "--target", "--device"):
        assert option in result.stdout


def test_unknown_checks_are_rejected() -> None:
    result = _run("--only", "kernels,speed")
    assert result.returncode == 2
    assert "unknown check(s) ['speed']" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_says_so_and_fails() -> None:
    result = _run()
    assert result.returncode == 2
    assert result.stderr.startswith("gpu_check: no CUDA device is available")
    assert result.stdout == ""


def test_cpu_smoke_run(tmp_path: Path) -> None:
    rows = tmp_path / "rows.json"
    result = _run("--device", "cpu", "--only", "kernels,parity,throughput", "--json", str(rows))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failed" in result.stdout
    import json

    checks = [row["check"] for row in json.loads(rows.read_text())]
    assert "kernels/write_kv 64 tokens" in checks
    assert "parity/qwen3 fp32 greedy vs transformers" in checks
    assert "decode b=1 ctx=24 graphs off" in checks
