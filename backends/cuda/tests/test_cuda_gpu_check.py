"""``bench/gpu_check.py`` on a machine without CUDA: its arguments, its roofline arithmetic, the
isolation of its checks in processes, its preflight rows, its refusal, and its CPU smoke run
(toy sizes, Triton interpreted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gpu_check_script import SCRIPT, gpu_check_module

_module = gpu_check_module


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)  # fmt: skip


def test_help_lists_the_options() -> None:
    result = _run("--help")
    assert result.returncode == 0
    for option in ("--only", "--out", "--batch-sizes", "--context", "--bandwidth", "--peak-flops",
                   "--target", "--device", "--long-context", "--window", "--timeout-scale",
                   "--budget"):  # fmt: skip
        assert option in result.stdout


def test_help_names_every_check_with_one_line() -> None:
    result = _run("--help")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    for name in _module().CHECKS:
        described = [line for line in lines if line.split()[:1] == [name] and len(line.split()) > 3]
        assert len(described) == 1, (name, result.stdout)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--only", "kernels,speed"], "unknown check(s) ['speed']"),
        (["--batch-sizes", "1,x"], "--batch-sizes must be comma-separated ints"),
        (["--batch-sizes", "0,4"], "--batch-sizes must be positive"),
        (["--device", "tpu"], "--device must be cuda, cuda:N or cpu"),
        (["--timeout-scale", "0"], "--timeout-scale must be > 0"),
        (["--budget", "-1"], "--budget must be > 0"),
        (["--window", "0"], "--window must be > 0"),
    ],
)
def test_bad_arguments_are_rejected(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _module().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_arguments_and_the_output_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_check = _module()
    monkeypatch.setenv("OUT", "/tmp/somewhere")
    args = gpu_check.parse_args(["--batch-sizes", "256,1,64,1"])
    assert args.batch_sizes == [1, 64, 256] and args.out == Path("/tmp/somewhere")
    assert args.only == list(gpu_check.CHECKS) and args.gpu
    assert gpu_check.parse_args(["--out", "x", "--device", "cpu"]).out == Path("x")
    monkeypatch.delenv("OUT")
    assert gpu_check.parse_args([]).out == Path("gpu_check_out")
    assert set(gpu_check.TIMEOUTS_S) == set(gpu_check.CHECKS) == set(gpu_check.CHECK_FUNCTIONS)


def test_the_verify_cost_fit() -> None:
    a, b = _module()._fit_line([1.0, 2.0, 3.0, 4.0], [5.05, 5.10, 5.15, 5.20])
    assert (a, b) == (pytest.approx(5.0), pytest.approx(0.05))


def test_the_roofline_counts_compute_and_memory() -> None:
    gpu_check = _module()
    shape = gpu_check.Shape.from_config(gpu_check.LLAMA3_8B)
    assert shape.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2
    # Llama-3-8B multiplies ~7.5e9 weights per token (6.98e9 in the layers, 0.53e9 LM head).
    assert (
        shape.matmul_params == 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336) + 4096 * 128256
    )
    weights = 16 * 10**9
    big = gpu_check.decode_roofline(shape, weights, 256, 512, 4.8e12, 989e12)
    assert big.compute_s >= 3.9e-3  # the GEMMs alone, at peak
    assert big.memory_s == pytest.approx((weights + 256 * 512 * 131072) / 4.8e12)
    assert big.seconds == max(big.memory_s, big.compute_s)
    small = gpu_check.decode_roofline(shape, weights, 1, 512, 4.8e12, 989e12)
    assert small.bound == "memory" and small.seconds == small.memory_s
    # A step at the roofline reaches the bandwidth (memory-bound) or the peak (compute-bound).
    assert small.describe(small.seconds).startswith("4.80 TB/s")
    prefill = gpu_check.prefill_roofline(shape, weights, 4, 2048, 4.8e12, 989e12)
    assert prefill.bound == "compute"
    assert prefill.describe(prefill.seconds).endswith("989 TFLOP/s")


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


WRITE_ROW = (
    "import json, os, sys; open(sys.argv[1], 'a').write(json.dumps({'check': 'demo: first', "
    "'value': 'written', 'target': '', 'ok': True, 'detail': []}) + '\\n'); print('last words')"
)


def test_a_crash_keeps_the_rows_written_before_it(tmp_path: Path) -> None:
    gpu_check = _module()
    rows_file = str(tmp_path / "demo.jsonl")
    command = [*_python(WRITE_ROW + "; os.abort()"), rows_file]
    rows, _ = gpu_check.run_isolated("demo", command, tmp_path, 60, dict(os.environ))
    assert [r.check for r in rows] == ["demo: first", "demo: crashed (signal 6)"]
    assert rows[0].ok is True and rows[1].ok is False
    assert (tmp_path / "demo.log").read_text().strip().endswith("last words")


def test_a_hang_is_killed_at_its_limit(tmp_path: Path) -> None:
    gpu_check = _module()
    command = _python("import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)")
    started = time.monotonic()
    rows, elapsed = gpu_check.run_isolated("demo", command, tmp_path, 1.5, dict(os.environ))
    assert time.monotonic() - started < 30  # the whole process group went
    assert [r.check for r in rows] == ["demo: timed out"] and rows[0].ok is False
    assert "killed after 2 s" in rows[0].value


def test_an_exit_status_or_no_rows_is_a_failure(tmp_path: Path) -> None:
    gpu_check = _module()
    rows, _ = gpu_check.run_isolated("demo", _python("raise SystemExit(3)"), tmp_path, 60,
                                     dict(os.environ))  # fmt: skip
    assert [(r.check, r.ok) for r in rows] == [("demo: crashed (exit 3)", False)]
    rows, _ = gpu_check.run_isolated("demo", _python("pass"), tmp_path, 60, dict(os.environ))
    assert [(r.check, r.ok) for r in rows] == [("demo: no rows", False)]


def test_preflight_failure_rows_say_why(tmp_path: Path) -> None:
    gpu_check = _module()
    env = {"TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp_path / "absent"),
           "CC": "/nonexistent/cc"}  # fmt: skip
    rows = gpu_check.preflight_rows("cuda", env, include_dir=tmp_path, which=lambda _: None)
    assert [r.ok for r in rows] == [False] * 4
    text = " | ".join(f"{r.check}: {r.value}" for r in rows)
    assert "none: set CC or install gcc" in text
    assert f"missing in {tmp_path}" in text
    assert "'1' for the checks" in text
    good = gpu_check.preflight_rows(
        "cuda", {"TRITON_CACHE_DIR": str(tmp_path)}, include_dir=tmp_path, which=lambda n: n
    )
    assert [r.ok for r in good] == [True, False, True, True]  # no Python.h in tmp_path


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_says_so_and_fails(tmp_path: Path) -> None:
    result = _run("--out", str(tmp_path), "--only", "kernels,throughput")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("gpu_check: no CUDA device is available")
    rows = {r["check"]: r for r in json.loads((tmp_path / "summary.json").read_text())}
    assert rows["preflight: GPU visible"]["ok"] is False
    assert rows["kernels: not run"]["ok"] is False
    assert rows["kernels: not run"]["value"].startswith("preflight failed: GPU visible")
    assert rows["throughput: not run"]["ok"] is False
    assert (tmp_path / "preflight.log").is_file()


def test_checks_past_the_budget_are_failed_rows(tmp_path: Path) -> None:
    result = _run("--device", "cpu", "--out", str(tmp_path), "--only", "kernels,prefill",
                  "--budget", "1")  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["check"], r["value"], r["ok"]) for r in rows] == [
        (f"{name}: not run", "out of time (--budget 1 s)", False)
        for name in ("preflight", "kernels", "prefill")
    ]


@pytest.mark.timeout(600)  # nine checks, each in a process of its own, Triton interpreted
def test_cpu_smoke_run(tmp_path: Path) -> None:
    only = "kernels,startup,throughput,sampling,longctx,prefill,profile,spec"
    result = _run("--device", "cpu", "--out", str(tmp_path), "--only", only, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 failed" in result.stdout
    checks = [row["check"] for row in json.loads((tmp_path / "summary.json").read_text())]
    for expected in ("preflight: a one-line Triton kernel runs", "kernels/write_kv 64 tokens",
                     "kernels/sampling T=1 top_p=0.9 b=8", "decode b=1 ctx=24 graphs off",
                     "startup: profiling pass (compiles prefill)",
                     "sampling b=4: T=1 top_p=0.9 step vs greedy",
                     "decode b=1 ctx=96 16 KV splits graphs off", "prefill 2 x 40 tokens per step",
                     "kernels/attention window 8 split-KV x4", "kernels/gemma_add_rms_norm",
                     "kernels/attention softcap 50, sinks, split-KV x4",
                     "profile: eager decode b=4, top 15 kernels",
                     "spec: verify cost b=2 (eager)",
                     "spec: ngram k=4 vs off b=1 (copy prompts)",
                     "spec: draft k=4 vs off b=2 (copy prompts)"):  # fmt: skip
        assert expected in checks
    for name in only.split(","):
        assert (tmp_path / f"{name}.jsonl").is_file() and (tmp_path / f"{name}.log").is_file()


def test_cpu_window_row(tmp_path: Path) -> None:
    """Sliding-window decode against full attention on the same (toy) shape."""
    result = _run("--device", "cpu", "--out", str(tmp_path), "--only", "window")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {r["check"]: r for r in json.loads((tmp_path / "summary.json").read_text())}
    for b in (1, 2):
        for label in ("full attention", "window 16"):
            assert rows[f"window: decode b={b} ctx=96 {label}"]["value"].endswith("TFLOP/s")
        assert rows[f"window: speedup of window 16 b={b} ctx=96"]["value"].startswith("x")
    assert "16 keys per layer" in rows["window: decode b=1 ctx=96 window 16"]["detail"][0]


@pytest.mark.timeout(300)
def test_cpu_tp_rows(tmp_path: Path) -> None:
    """TP=2 on one device against TP=1 in bfloat16, every tiny model and gpt-oss: the rows pass
    on the CPU too (the same sharding, gloo, torch kernels)."""
    result = _run("--device", "cpu", "--out", str(tmp_path), "--only", "tp", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {r["check"]: r for r in json.loads((tmp_path / "summary.json").read_text())}
    for kind in ("llama", "gemma2", "gemma3", "gpt-oss"):
        assert rows[f"tp/{kind} bf16 TP=2 (gloo, one device) vs TP=1"]["ok"] is True
    assert rows["tp/llama bf16 TP=2 greedy: async scheduling vs sync"]["ok"] is True
    for method in ("ngram", "draft model"):
        row = rows[f"tp/llama bf16 TP=2 greedy: {method} speculation vs none"]
        assert row["value"].endswith("/4 sequences identical")  # bf16: reported, not asserted
