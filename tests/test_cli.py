"""The ``engine-core`` command line: backends, generate, serve and the benchmarks."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_core import EngineConfig
from engine_core._bench.server_process import server_process
from engine_core.cli import build_parser, engine_config_from_args, main
from engine_core.config import COMMAND_LINE_ENV, SpeculativeConfig

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
    ray = engine_config_from_args(
        parser.parse_args(
            ["serve", "--data-parallel-size", "2", "--data-parallel-backend", "ray"]
            + ["--ray-address", "10.0.0.1:6379", "--ray-placement-strategy", "STRICT_SPREAD"]
            + ["--ray-driver-host", "10.0.0.1", "--placement-timeout-s", "30"]
        )
    )
    assert (ray.data_parallel_backend, ray.ray_address, ray.ray_placement_strategy) == (
        "ray",
        "10.0.0.1:6379",
        "STRICT_SPREAD",
    )
    assert (ray.ray_driver_host, ray.placement_timeout_s) == ("10.0.0.1", 30.0)
    spec = engine_config_from_args(
        parser.parse_args(
            ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
        )
    )
    assert spec.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    fp8 = engine_config_from_args(
        parser.parse_args(["serve", "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    )
    assert (fp8.quantization, fp8.kv_cache_dtype) == ("fp8", "fp8")
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
    words = " ".join(printed.split())  # what it measured, in words
    assert "Generated 48 tokens (8 requests x 6 output tokens, 4-token prompts) in " in words
    assert "does no model compute" in words and "the engine's own overhead" in words
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

    # vllm bench serve's random dataset: prompts of exactly N random tokens, EOS ignored.
    random_prompts = ["--random-input-len", "20", "--tokenizer", "byte", "--ignore-eos"]
    assert main([*argv, "--endpoint", "completions", *random_prompts, "--api-key", "secret"]) == 0
    summary = json.loads(out.read_text())
    assert (summary["prompt_tokens"], summary["output_tokens"]) == (8 * 20, 40)
    assert "input=20 random tokens ignore_eos=True" in capsys.readouterr().out
    assert main([*argv, *random_prompts, "--api-key", "secret"]) == 0  # chat: their text
    assert json.loads(out.read_text())["failed"] == 0

    assert main([*argv, "--api-key", "wrong"]) == 1
    assert json.loads(out.read_text())["failed"] == 8
    assert "HTTP 401" in capsys.readouterr().err

    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 0


def test_serve_prints_where_once_and_logs_requests() -> None:
    """Without --served-model-name the mock is served as "mock"; "serving on" comes once (read
    by server_process) and --enable-log-requests logs each request."""
    flags = ["--port", "0", *MOCK, "--enable-log-requests"]
    with server_process(flags, start_timeout_s=60, stop_grace_s=None) as (url, process):
        body = {"model": "mock", "prompt": "abc", "max_tokens": 5, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body)
        assert response.json()["choices"][0]["text"] == "defgh"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        assert process.stderr is not None
        rest = process.stderr.read()
    assert "serving on" not in rest
    assert "3 prompt tokens, 5 output tokens, finish_reason length" in rest


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[Any]:
    """(command path, parser) of every command that takes flags."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for sub in subs:
        for name, child in sub.choices.items():
            yield from _commands(child, (*path, name))


def test_every_flag_has_help_text() -> None:
    commands = dict(_commands(build_parser()))
    assert {" ".join(c) for c in commands} >= {
        "serve",
        "generate",
        "bench throughput",
        "bench latency",
        "bench serve",
    }
    for command, parser in commands.items():
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, (command, action.option_strings or action.dest)
    # The engine's flags say what their EngineConfig field's docstring says.
    serve = commands[("serve",)]
    flags = {a.dest: a.help for a in serve._actions}
    assert flags["cfg_max_num_seqs"] == (
        "Most requests running at once (the batch); more wait in the queue. (default: 256)"
    )
    assert flags["cfg_step_timeout_s"] is not None
    assert "None: no limit. (default: 300.0) [or 'none']" in flags["cfg_step_timeout_s"]
    assert flags["cfg_enable_prefix_caching"] is not None
    assert flags["cfg_enable_prefix_caching"].endswith("(default: --enable-prefix-caching)")


def test_backend_hints_take_the_command_lines_form(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a GPU the installed CUDA backend is listed as installed, with how to run it on
    the CPU in flags; asking for it says the same, in flags on the command line and in Python
    from Python."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    import engine_core_cuda._provider as cuda_provider

    from engine_core import LLM
    from engine_core.errors import BackendError

    monkeypatch.setattr(cuda_provider, "cuda_device_present", lambda: False)
    monkeypatch.delenv("ENGINE_CORE_CUDA_DEVICE", raising=False)
    monkeypatch.delenv(COMMAND_LINE_ENV, raising=False)
    with pytest.raises(BackendError) as info:
        LLM(backend="cuda", tokenizer="byte")
    assert "backend_options={'device': 'cpu'}" in str(info.value)
    assert "pip install" not in str(info.value)

    assert main(["backends"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("cuda"))
    assert line.split()[:2] == ["cuda", "installed"]
    assert """--backend-options '{"device": "cpu"}'""" in line
    assert "pip install" not in line
    assert main(["generate", "abc", "--backend", "cuda", "--tokenizer", "byte"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("engine-core: error: backend 'cuda' is not usable here")
    assert """--backend-options '{"device": "cpu"}'""" in error
    assert COMMAND_LINE_ENV not in os.environ  # main() leaves the environment as it found it


def test_the_parser_flags_offer_every_registered_parser() -> None:
    from engine_core.server._reasoning import REASONING_PARSERS
    from engine_core.server.tools import tool_parser_names

    serve = dict(_commands(build_parser()))[("serve",)]
    choices = {a.dest: a.choices for a in serve._actions if a.choices is not None}
    assert sorted(choices["tool_call_parser"]) == tool_parser_names()
    assert sorted(choices["reasoning_parser"]) == sorted(REASONING_PARSERS)


def test_the_forced_reasoning_bound_is_a_serve_flag() -> None:
    from engine_core.server import ServerSettings

    serve = dict(_commands(build_parser()))[("serve",)]
    (action,) = [a for a in serve._actions if a.dest == "max_forced_reasoning_chars"]
    assert action.help is not None
    assert f"default {ServerSettings().max_forced_reasoning_chars}," in action.help
    args = build_parser().parse_args(["serve", "--max-forced-reasoning-chars", "0"])
    assert args.max_forced_reasoning_chars == 0


def test_serve_help_says_how_it_stops_and_when_a_step_is_cut(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the listening socket closes at once: a new connection" in text
    assert "is refused while the responses in flight finish" in text
    assert "is cut after --step-timeout-s, 300 s by default" in text
    assert "(--step-timeout-s 30)" in text
    serve = dict(_commands(build_parser()))[("serve",)]
    flags = {a.dest: a.help or "" for a in serve._actions}
    assert "one that hangs while its process stays alive" in flags["cfg_step_timeout_s"]
    assert "new connections are refused" in flags["shutdown_timeout"]


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (
            ["--backend", "Mock"],
            "engine-core: error: the engine core failed to start (its process exited with "
            "status 1): BackendError: unknown backend 'Mock': did you mean 'mock'? installed: ",
        ),
        (
            ["--model", "/nonexistent/model"],
            "engine-core: error: model '/nonexistent/model' is not a directory: give the "
            "directory of an HF model (config.json, safetensors, tokenizer.json)",
        ),
        (
            ["--backend", "mock", "--port", "PORT"],
            "engine-core: error: [Errno 98] Address already in use (while attempting to bind on "
            "address ('127.0.0.1', PORT)) (another process listens there: choose another "
            "--port, or --port 0)",
        ),
    ],
    ids=["misspelt-backend", "missing-model", "port-in-use"],
)
def test_serve_startup_errors_are_one_line(flags: list[str], error: str) -> None:
    """What keeps ``serve`` from starting is said in one line, with no traceback, and the exit
    status is 2 (as ``generate`` does)."""
    import socket
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        argv = ["serve", "--port", "0", *[port if f == "PORT" else f for f in flags]]
        result = subprocess.run(
            [sys.executable, "-m", "engine_core", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("engine-core: starting the engine")
    assert lines[1].startswith(error.replace("PORT", port))
