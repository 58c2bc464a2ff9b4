#!/usr/bin/env python3
"""``lm-eval`` through the server against ``lm-eval`` on transformers: the same tiny random
Llama, the same local multiple-choice task, per-item loglikelihoods compared.

``engine-core serve`` runs the tiny Llama of the CUDA backend's tests (random weights, written
here) with the CUDA backend on the CPU; ``lm-eval --model local-completions`` scores a small
multiple-choice task (written here as a local JSON file, no download) through its
``/v1/completions`` (``echo`` with ``logprobs`` and ``max_tokens`` 1, as it asks vLLM), and
``lm-eval --model hf`` scores the same task on transformers. The script prints the largest
difference of a choice's loglikelihood between the two (the target is 1e-4), each side's
accuracy and wall time, and the machine line.

lm-eval is not a dependency of the project: install it where it does not disturb the test
environment, e.g. ``python -m venv /tmp/lm-eval && /tmp/lm-eval/bin/pip install 'lm-eval[hf]'``
(it needs torch and transformers too), and pass its command with ``--lm-eval``.

Usage: ``python bench/bench_lm_eval.py --lm-eval /tmp/lm-eval/bin/lm_eval [--items 40]
[--out DIR] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backends" / "cuda" / "tests"))  # the tiny checkpoints

from tiny_models import build  # noqa: E402

from engine_core._bench.machine import machine_line, write_results  # noqa: E402
from engine_core._bench.server_process import server_process  # noqa: E402

_WORDS = ["cache", "block", "token", "batch", "step", "kernel", "tensor", "layer", "queue"]
_STEMS = ["the engine", "a paged", "decode prefill", "the scheduler", "greedy sample"]

TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


def write_task(directory: Path, num_items: int) -> None:
    """A multiple-choice task of ``num_items`` questions over the tiny model's words."""
    rng = random.Random(0)
    rows = []
    for _ in range(num_items):
        choices = [" " + w for w in rng.sample(_WORDS, 4)]
        rows.append({"question": rng.choice(_STEMS), "choices": choices, "label": rng.randrange(4)})
    data = directory / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / "tiny_mc.yaml").write_text(TASK.format(data=data))


def run_lm_eval(lm_eval: str, model: str, model_args: str, tasks: Path, out: Path) -> float:
    """One ``lm-eval`` run; its wall time."""
    argv = [lm_eval, "run"] if _has_run_command(lm_eval) else [lm_eval]
    argv += ["--model", model, "--model_args", model_args, "--tasks", "tiny_mc"]
    argv += ["--include_path", str(tasks), "--log_samples", "--output_path", str(out)]
    argv += ["--batch_size", "4", "--device", "cpu"]
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _has_run_command(lm_eval: str) -> bool:
    usage = subprocess.run([lm_eval, "--help"], capture_output=True, text=True).stdout
    return "COMMAND" in usage


def read_samples(out: Path) -> tuple[list[list[float]], float]:
    """Per item, each choice's loglikelihood; and the accuracy."""
    (path,) = out.rglob("samples_tiny_mc_*.jsonl")
    items = [json.loads(line) for line in path.read_text().splitlines()]
    items.sort(key=lambda item: item["doc_id"])
    loglikelihoods = [[float(r[0][0]) for r in item["resps"]] for item in items]
    accuracy = sum(item["acc"] for item in items) / len(items)
    return loglikelihoods, accuracy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lm-eval", default="lm_eval", help="the lm-eval command")
    parser.add_argument("--items", type=int, default=40, help="questions in the task")
    parser.add_argument("--out", default=None, help="where lm-eval writes (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the results to this path")
    args = parser.parse_args()

    root = Path(args.out or tempfile.mkdtemp(prefix="bench-lm-eval-"))
    model_dir, tasks = root / "tiny-llama", root / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    build("llama", model_dir)
    write_task(tasks, args.items)

    flags = ["--port", "0", "--model", str(model_dir), "--served-model-name", "tiny"]
    flags += ["--backend", "cuda", "--backend-options", '{"device": "cpu"}']
    with server_process(flags, start_timeout_s=300) as (url, _):
        served_args = (
            f"model=tiny,base_url={url}/v1/completions,tokenizer={model_dir},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=4,max_retries=1"
        )
        served_s = run_lm_eval(
            args.lm_eval, "local-completions", served_args, tasks, root / "served"
        )
    hf_s = run_lm_eval(
        args.lm_eval, "hf", f"pretrained={model_dir},dtype=float32", tasks, root / "hf"
    )
    served, served_acc = read_samples(root / "served")
    hf, hf_acc = read_samples(root / "hf")
    diffs = [abs(a - b) for s, h in zip(served, hf, strict=True) for a, b in zip(s, h, strict=True)]
    results: dict[str, Any] = {
        "items": len(served),
        "choices": len(diffs),
        "max_abs_diff": max(diffs),
        "served_acc": served_acc,
        "hf_acc": hf_acc,
        "served_wall_s": served_s,
        "hf_wall_s": hf_s,
    }
    print(machine_line())
    print(f"load average: {os.getloadavg()[0]:.2f}")
    print(
        f"lm-eval tiny_mc, {results['items']} items x 4 choices: largest |loglikelihood "
        f"difference| served vs hf {results['max_abs_diff']:.2e} (target 1e-4); acc "
        f"{served_acc:.3f} vs {hf_acc:.3f}; wall {served_s:.1f} s vs {hf_s:.1f} s"
    )
    write_results(args.json, results)
    return 0 if results["max_abs_diff"] <= 1e-4 and served_acc == hf_acc else 1


if __name__ == "__main__":
    sys.exit(main())
