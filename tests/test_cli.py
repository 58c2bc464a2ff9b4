"""The ``engine-core`` command line: backends, generate, serve and the benchmarks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine_core import EngineConfig
from engine_core._bench.server_process import server_process
from engine_core.cli import build_parser, engine_config_from_args, main

MOCK = ["--backend", "mock", "--tokenizer", "byte"]


def test_backends_lists_the_mock(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("mock"))
    assert line.split()[:2] == ["mock", "usable"]


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_generate_streams_to_stdout(runtime: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "abc", "--max-tokens", "5", "--runtime", runtime, *MOCK]) == 0
    assert capsys.readouterr().out == "defgh\n"


def test_generate_stop_string(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "abc", "--max-tokens", "9", "--stop", "g", *MOCK]) == 0
    assert capsys.readouterr().out == "def\n"


def test_every_engine_config_field_is_a_serve_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--max-num-seqs", "3", "--no-enable-prefix-caching", "--port", "0"]
        + ["--served-model-name", "a", "b", "--backend-options", '{"vocab_size": 300}']
    )
    config = engine_config_from_args(args)
    assert (config.max_num_seqs, config.enable_prefix_caching) == (3, False)
    assert config.backend_options == {"vocab_size": 300}
    assert (config.step_timeout_s, config.engine_heartbeat_timeout_s) == (300.0, 10.0)
    timeouts = engine_config_from_args(
        parser.parse_args(
            ["serve", "--step-timeout-s", "none", "--engine-heartbeat-timeout-s", "2.5"]
        )
    )
    assert (timeouts.step_timeout_s, timeouts.engine_heartbeat_timeout_s) == (None, 2.5)
    assert (args.port, args.host, args.served_model_name) == (0, "127.0.0.1", ["a", "b"])
    assert (args.runtime, args.api_key) == ("asyncio", None)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    serve_help = capsys.readouterr().out
    for flag in ("--host", "--port", "--runtime", "--api-key", "--served-model-name"):
        assert flag in serve_help
    for name in EngineConfig.__struct_fields__:
        assert "--" + name.replace("_", "-") in serve_help, name


def test_bench_throughput(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--num-prompts", "8", "--input-len", "4", "--output-len", "6"]
    assert main([*argv, "--no-progress", "--json", str(out), *MOCK]) == 0
    printed = capsys.readouterr().out
    assert "output tokens/s" in printed and printed.startswith("machine: ")
    data = json.loads(out.read_text())
    assert data["machine"].startswith("machine: ")
    assert float(data["requests/s"].replace(",", "")) > 0


def test_bench_latency(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--batch-size", "2", "--input-len", "4", "--output-len", "5"]
    argv += ["--num-iters-warmup", "1", "--num-iters", "3", "--no-progress", "--json", str(out)]
    assert main([*argv, *MOCK]) == 0
    printed = capsys.readouterr().out
    assert "batch_size=2" in printed and "p99 latency (s)" in printed
    assert set(json.loads(out.read_text())) >= {"mean latency (s)", "p50 latency (s)"}


@pytest.fixture(params=["asyncio", "trio"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``engine-core serve`` in a subprocess on a free port, its key from the environment."""
    flags = ["--port", "0", *MOCK, "--served-model-name", "m", "--max-num-seqs", "8"]
    env = {**os.environ, "ENGINE_CORE_API_KEY": "secret"}
    with server_process(
        [*flags, "--runtime", request.param], start_timeout_s=60, stop_grace_s=None, env=env
    ) as (url, process):
        assert url.startswith("http://127.0.0.1:")
        yield url, process


def test_serve_and_bench_serve(
    served: tuple[str, subprocess.Popen[str]],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    url, process = served
    assert httpx.get(f"{url}/v1/models").status_code == 401
    models = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer secret"})
    assert [m["id"] for m in models.json()["data"]] == ["m"]

    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--url", url, "--concurrency", "4", "--num-requests", "8"]
    argv += ["--max-tokens", "5", "--model", "m", "--no-progress", "--json", str(out)]
    assert main([*argv, "--api-key", "secret"]) == 0
    printed = capsys.readouterr().out
    assert "TTFT p99 (ms)" in printed and "ITL p50 (ms)" in printed
    summary = json.loads(out.read_text())
    assert (summary["requests"], summary["failed"], summary["output_tokens"]) == (8, 0, 40)

    assert main([*argv, "--endpoint", "completions", "--api-key", "secret"]) == 0
    assert json.loads(out.read_text())["output_tokens"] == 40

    assert main([*argv, "--api-key", "wrong"]) == 1
    assert json.loads(out.read_text())["failed"] == 8
    assert "HTTP 401" in capsys.readouterr().err

    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 0
