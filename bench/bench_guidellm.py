#!/usr/bin/env python3
"""``guidellm`` (the load tester vLLM users run) against ``engine-core serve``: synchronous,
concurrent and constant-rate runs of ``--seconds`` each complete with sane figures.

The server is the mock with the tiny byte-level BPE tokenizer of the CUDA backend's tests (so
guidellm's synthetic prompts and the mock's outputs are real text of that vocabulary) and a
latency model of ``--step-ms`` per step, under ``--runtime``. Each profile streams chat
completions of 128-token synthetic prompts and 64 output tokens; the table gives per profile
the requests completed and errored, requests/s, output tokens/s, and the TTFT and ITL medians
and p99 as guidellm measured them, with the machine line and the load average. An errored
request (a stream guidellm could not read, say) fails the run.

guidellm is not a dependency of the project: install it where it does not disturb the test
environment (``python -m venv /tmp/guidellm && /tmp/guidellm/bin/pip install guidellm``) and
pass its command with ``--guidellm``.

Usage: ``python bench/bench_guidellm.py --guidellm /tmp/guidellm/bin/guidellm [--seconds 30]
[--rate 40] [--runtime asyncio|trio] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backends" / "cuda" / "tests"))  # the tiny tokenizer

from tiny_models import write_tokenizer  # noqa: E402

from engine_core._bench.machine import machine_line, write_results  # noqa: E402
from engine_core._bench.server_process import server_process  # noqa: E402

PROFILES: dict[str, dict[str, Any]] = {
    "synchronous": {"kind": "synchronous"},
    "concurrent 16": {"kind": "concurrent", "streams": [16]},
    "constant rate": {"kind": "constant"},  # the rate is --rate
}


def scenario(url: str, tokenizer: Path, profile: dict[str, Any], seconds: float, out: Path) -> Any:
    return {
        "metadata": {"name": "engine-core", "description": "bench/bench_guidellm.py"},
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": "mock",
                "request_format": "/v1/chat/completions",
            },
            "profile": profile,
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            "data": [{"kind": "synthetic_text", "prompt_tokens": 128, "output_tokens": 64}],
            "constraints": [{"kind": "max_duration", "seconds": seconds}],
            "outputs": [{"kind": "json", "path": str(out)}],
        },
        "benchmarks": [None],
    }


def figures(path: Path) -> dict[str, float]:
    """What one guidellm run measured, from its JSON report."""
    (benchmark,) = json.loads(path.read_text())["benchmarks"]
    metrics = benchmark["metrics"]

    def stat(name: str, key: str) -> float:
        successful = metrics[name]["successful"]
        return float(successful[key] if key in successful else successful["percentiles"][key])

    totals = metrics["request_totals"]
    return {
        "completed": totals["successful"],
        "errored": totals["errored"],
        "incomplete": totals["incomplete"],
        "request_per_s": stat("requests_per_second", "mean"),
        "output_tok_per_s": stat("output_tokens_per_second", "mean"),
        "ttft_p50_ms": stat("time_to_first_token_ms", "median"),
        "ttft_p99_ms": stat("time_to_first_token_ms", "p99"),
        "itl_p50_ms": stat("inter_token_latency_ms", "median"),
        "itl_p99_ms": stat("inter_token_latency_ms", "p99"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--guidellm", default="guidellm", help="the guidellm command")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each run")
    parser.add_argument("--rate", type=float, default=40.0, help="requests/s of the constant run")
    parser.add_argument("--step-ms", type=float, default=5.0, help="the mock's step time")
    parser.add_argument("--runtime", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--json", default=None, help="also write the results to this path")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-guidellm-"))
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    write_tokenizer(tokenizer)
    latency = json.dumps({"latency": {"step_s": args.step_ms / 1000}})
    flags = ["--port", "0", "--backend", "mock", "--tokenizer", str(tokenizer)]
    flags += ["--backend-options", latency, "--runtime", args.runtime]
    results: dict[str, Any] = {"runtime": args.runtime, "step_ms": args.step_ms}
    with server_process(flags, start_timeout_s=120) as (url, _):
        for name, profile in PROFILES.items():
            if profile["kind"] == "constant":
                profile = {**profile, "rate": [args.rate]}
            path = root / f"{name.replace(' ', '-')}.json"
            spec = root / f"{name.replace(' ', '-')}-scenario.json"
            spec.write_text(json.dumps(scenario(url, tokenizer, profile, args.seconds, path)))
            command = [args.guidellm, "run", "-c", str(spec), "--disable-console-interactive"]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=root)
            results[name] = figures(path)
    print(machine_line())
    print(f"load average: {os.getloadavg()[0]:.2f}")
    print(
        f"guidellm vs engine-core serve ({args.runtime}), mock at {args.step_ms:g} ms per step, "
        f"128-token prompts, 64 output tokens, {args.seconds:g} s per profile"
    )
    header = ("profile", "done", "errored", "cut at the end", "req/s", "out tok/s")
    header += ("TTFT p50 / p99 ms", "ITL p50 / p99 ms")
    print("| " + " | ".join(header) + " |")
    for name in PROFILES:
        row = results[name]
        print(
            f"| {name} | {row['completed']} | {row['errored']} | {row['incomplete']} | "
            f"{row['request_per_s']:.1f} | {row['output_tok_per_s']:.0f} | "
            f"{row['ttft_p50_ms']:.1f} / {row['ttft_p99_ms']:.1f} | "
            f"{row['itl_p50_ms']:.2f} / {row['itl_p99_ms']:.2f} |"
        )
    write_results(args.json, results)
    return 0 if all(results[name]["errored"] == 0 for name in PROFILES) else 1


if __name__ == "__main__":
    sys.exit(main())
