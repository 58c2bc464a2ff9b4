#!/usr/bin/env python3
"""CPU serving on a shared machine: ``engine-core serve`` with the CUDA backend on the CPU (its
default threads, and ``OMP_NUM_THREADS=1``) vs transformers' ``generate`` (and vLLM-CPU where
it is installed), quiet and under a competing CPU load.

The model: a tiny random Llama written at start (float32; ``h512``: hidden 512, 8 layers, 8
heads of 64, 4 KV heads, the compute-bound one; ``h64``: hidden 64, 2 layers, heads of 32, the
overhead-bound one). Each request: ``--input-len`` random prompt tokens (as token ids), exactly
``--output-len`` output tokens (``ignore_eos``), greedy, streamed from ``/v1/completions`` by
``engine-core bench serve``'s client; ``--requests-per-slot`` × concurrency requests per run.
transformers runs ``generate`` offline on a batch of ``concurrency`` prompts (no HTTP: an upper
bound of what a server around it would do), on ``--hf-threads`` torch threads (the engine's
default: the cores less one). vLLM
(``--vllm-python``: the interpreter of a venv with ``vllm-cpu``) is served by
``python -m vllm.entrypoints.openai.api_server`` with a 1 GiB KV cache, and with the
``LD_PRELOAD`` of tcmalloc and Intel OpenMP its installation guide asks for, where they are
there (``--vllm-no-preload``: without).

``--load N`` starts N busy-loop processes for the ``load`` scenario (``--scenarios``). Each
round runs every scenario, every concurrency, every system, the systems' order rotated from
round to round; the table has the median output tok/s over the rounds and each system's ratio to
the reference system (vLLM when it runs, else transformers). ``--base-tree DIR`` adds
``base1``: the server run from another checkout (its ``engine_core`` and backends) with
``OMP_NUM_THREADS=1``, for a before/after of the backend's kernels at the same threads (``base``:
that checkout's default threads). The sampling micro-benchmark (``--no-sampling`` to skip)
times the seeded noise of 64 rows × a 128k vocabulary: the reference int64 tensors, the
chunked race the CPU samples with, and ``torch.exponential_``.

The default run takes minutes; the full one of the README:
``--rounds 3 --models h512,h64 --vllm-python /path/to/vllm-venv/bin/python``.

Usage: ``python bench/bench_cpu_serving.py [--models h512] [--concurrency 1,16,64]
[--systems default,omp1,hf] [--scenarios quiet,load] [--load 3] [--rounds 1]
[--input-len 128] [--output-len 64] [--requests-per-slot 1] [--base-tree DIR]
[--vllm-python PATH] [--vllm-no-preload] [--no-sampling] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backends" / "cuda" / "tests"))  # the tiny tokenizer

from engine_core._bench.client import random_token_prompts, run_load  # noqa: E402
from engine_core._bench.machine import machine_line, write_results  # noqa: E402
from engine_core._bench.server_process import server_process  # noqa: E402

MODELS: dict[str, dict[str, int]] = {
    "h512": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
             "num_attention_heads": 8, "num_key_value_heads": 4},
    "h64": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1},
}  # fmt: skip
MAX_MODEL_LEN = 512
SERVED_NAME = "tiny"


def build_model(name: str, directory: Path) -> Path:
    """The tiny random Llama ``name`` with the tests' trained BPE tokenizer, at ``directory``."""
    import torch
    import transformers
    from tiny_models import VOCAB_SIZE, write_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_MODEL_LEN * 2, rms_norm_eps=1e-6,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, **MODELS[name],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    write_tokenizer(directory)
    # Random weights' greedy output tends to repeat one token; when that token is special or a
    # piece of a UTF-8 character it decodes to no text, and the client counts a request that
    # streams no text as failed. Those tokens' output rows are zero: a logit of 0, which the
    # largest of the other (random) logits exceeds.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    silent = [i for i in range(VOCAB_SIZE)
              if i in (config.bos_token_id, config.eos_token_id)
              or not tokenizer.decode([i]).strip("\ufffd")]  # fmt: skip
    with torch.no_grad():
        model.lm_head.weight[silent] = 0.0
    model.save_pretrained(directory)
    return directory


def _busy() -> None:
    while True:
        pass


@contextlib.contextmanager
def cpu_load(n: int) -> Iterator[None]:
    """``n`` busy-loop processes while the block runs."""
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_busy, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        time.sleep(0.5 if n else 0.0)
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(timeout=10)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- systems ---------------------------------------------------------------------------------------


def _engine_flags(model: Path) -> list[str]:
    return ["--port", "0", "--model", str(model), "--served-model-name", SERVED_NAME,
            "--backend", "cuda", "--backend-options", '{"device": "cpu"}',
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64"]  # fmt: skip


def _env(omp: str | None, tree: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    if tree is not None:
        paths = [str(tree), str(tree / "backends" / "cuda"), str(tree / "backends" / "mock")]
        env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(":")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_preloads(python: str) -> list[str]:
    """The libraries vLLM-CPU's installation guide has preloaded (``LD_PRELOAD``): tcmalloc
    (Debian's ``libgoogle-perftools4``) and the Intel OpenMP runtime of its venv (the
    ``intel-openmp`` wheel), those that are there."""
    found = []
    for pattern in ("/usr/lib/*/libtcmalloc_minimal.so.4", "/usr/lib/*/libtcmalloc.so.4"):
        paths = sorted(Path("/").glob(pattern.lstrip("/")))
        if paths:
            found.append(str(paths[0]))
            break
    iomp = Path(python).resolve().parents[1] / "lib" / "libiomp5.so"
    if not iomp.exists():  # the venv's python is a link: its lib/ is beside its bin/
        iomp = Path(python).parents[1] / "lib" / "libiomp5.so"
    if iomp.exists():
        found.append(str(iomp))
    return found


@contextlib.contextmanager
def vllm_server(
    python: str, model: Path, preload: bool = True, timeout_s: float = 900.0
) -> Iterator[str]:
    """vLLM-CPU's OpenAI server on ``model`` (its ``vllm`` command needs the distribution to
    be named ``vllm``; the module runs under ``vllm-cpu``'s name too), with
    :func:`vllm_preloads` unless ``preload`` is False."""
    port = _free_port()
    env = {**_env(None), "VLLM_CPU_KVCACHE_SPACE": "1"}
    preloads = vllm_preloads(python) if preload else []
    if preloads:
        env["LD_PRELOAD"] = ":".join(preloads)
    print(f"vllm: LD_PRELOAD={env.get('LD_PRELOAD', '')!r}")
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (kept for the reader after the run)
        "w+", prefix="vllm-", suffix=".log", delete=False
    )
    process = subprocess.Popen(
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--served-model-name", SERVED_NAME, "--dtype", "float32",
         "--max-model-len", str(MAX_MODEL_LEN), "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with status {process.returncode}; see {log.name}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url + "/v1/models", timeout=5).read()
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start within {timeout_s:g} s; see {log.name}")
            time.sleep(2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def served_rate(url: str, prompts: list[list[int]], concurrency: int, output_len: int) -> float:
    import anyio

    from engine_core._frontend.runtime import run_options

    async def go() -> float:
        result = await run_load(
            url, endpoint="completions", num_requests=len(prompts), concurrency=concurrency,
            prompt=prompts, max_tokens=output_len, model=SERVED_NAME, ignore_eos=True,
        )  # fmt: skip
        errors = [r.error for r in result.results if r.error]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, the first: {errors[0]}")
        expected = len(prompts) * output_len
        if result.output_tokens != expected:
            raise RuntimeError(f"{result.output_tokens} output tokens, expected {expected}")
        return result.output_tokens / result.elapsed

    return float(anyio.run(go, **run_options("asyncio")))


class HFGenerate:
    """transformers' ``generate`` on a batch of prompts, offline, greedy, exactly
    ``output_len`` tokens."""

    def __init__(self, model: Path, threads: int) -> None:
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        self.model.eval()

    def rate(self, prompts: list[list[int]], concurrency: int, output_len: int) -> float:
        torch = self.torch
        config = self.model.generation_config
        config.update(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
                      eos_token_id=None, pad_token_id=0)  # fmt: skip
        produced, started = 0, time.perf_counter()
        for i in range(0, len(prompts), concurrency):
            ids = torch.tensor(prompts[i : i + concurrency])
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                          generation_config=config)  # fmt: skip
            produced += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        elapsed = time.perf_counter() - started
        if produced != len(prompts) * output_len:
            raise RuntimeError(f"transformers produced {produced} tokens")
        return produced / elapsed


# -- the sampling micro-benchmark --------------------------------------------------------------


def sampling_rows(rows: int = 64, vocab: int = 128_256, repeats: int = 3) -> dict[str, float]:
    """Milliseconds (best of ``repeats``) to draw one token per row with seeded noise."""
    sys.path.insert(0, str(ROOT / "backends" / "cuda"))
    import torch
    from engine_core_cuda._device import resolve_cpu_threads
    from engine_core_cuda._random import exponential_noise, exponential_race

    torch.set_num_threads(resolve_cpu_threads(None).threads)  # the engine's threads
    generator = torch.Generator().manual_seed(0)
    probs = torch.randn(rows, vocab, generator=generator).softmax(dim=-1)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=generator)
    positions = torch.randint(0, 4096, (rows,), generator=generator)
    cases: dict[str, Callable[[], torch.Tensor]] = {
        "reference int64 noise": lambda: (
            probs / exponential_noise(seeds, positions, vocab)
        ).argmax(dim=-1),
        "chunked race (the CPU's)": lambda: exponential_race(probs, seeds, positions),
        "torch.exponential_ (unseeded)": lambda: (
            probs / torch.empty_like(probs).exponential_()
        ).argmax(dim=-1),
    }
    times = {}
    for name, fn in cases.items():
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - started)
        times[name] = best * 1e3
    same = torch.equal(cases["reference int64 noise"](), cases["chunked race (the CPU's)"]())
    print(f"sampling noise, {rows} rows x {vocab} vocabulary, {torch.get_num_threads()} torch "
          f"thread(s), best of {repeats} (load {load_average()}); same tokens: {same}")  # fmt: skip
    for name, ms in times.items():
        print(f"  {name:32s} {ms:9.1f} ms")
    return times


# -- main --------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="h512", help="comma-separated: h512, h64")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--systems", default="default,omp1,hf",
                   help="comma-separated: default, omp1, hf, base and base1 (the --base-tree "
                        "checkout's default and OMP_NUM_THREADS=1), vllm (needs --vllm-python)")  # fmt: skip
    p.add_argument("--scenarios", default="quiet,load", help="comma-separated: quiet, load")
    p.add_argument("--load", type=int, default=3, help="busy-loop processes of the load scenario")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--requests-per-slot", type=int, default=1,
                   help="requests per run: this many times the concurrency (at least 4)")  # fmt: skip
    p.add_argument("--base-tree", type=Path, default=None,
                   help="another checkout whose engine runs as the 'base' system")  # fmt: skip
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    p.add_argument("--vllm-no-preload", action="store_true",
                   help="run vLLM without the LD_PRELOAD of tcmalloc and Intel OpenMP its "
                        "installation guide asks for")  # fmt: skip
    p.add_argument("--hf-threads", type=int, default=max(1, (os.cpu_count() or 1) - 1),
                   help="torch threads of transformers (default: the cores less one, as the "
                        "engine's default)")  # fmt: skip
    p.add_argument("--no-sampling", action="store_true", help="skip the sampling micro-benchmark")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    systems = args.systems.split(",")
    if args.vllm_python and "vllm" not in systems:
        systems.append("vllm")
    if args.base_tree is not None and not any(s.startswith("base") for s in systems):
        systems.append("base1")
    concurrencies = _ints(args.concurrency)
    scenarios = args.scenarios.split(",")
    print(machine_line())
    print(" ".join(os.uname()), f"nproc {len(os.sched_getaffinity(0))}")
    print(f"load at start: {load_average()}")
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if not args.no_sampling:
        results["sampling_ms"] = sampling_rows()
    with tempfile.TemporaryDirectory(prefix="bench-cpu-serving-") as tmp:
        for model_name in args.models.split(","):
            model = build_model(model_name, Path(tmp) / model_name)
            results[model_name] = run_model(args, model_name, model, systems, concurrencies,
                                            scenarios)  # fmt: skip
    write_results(args.json, results)


def run_model(
    args: argparse.Namespace,
    model_name: str,
    model: Path,
    systems: list[str],
    concurrencies: list[int],
    scenarios: list[str],
) -> dict[str, Any]:
    from tiny_models import VOCAB_SIZE

    vocabulary = list(range(2, VOCAB_SIZE))
    prompts = {
        c: random_token_prompts(
            vocabulary, max(4, c * args.requests_per_slot), args.input_len, seed=c
        )  # fmt: skip
        for c in concurrencies
    }
    rates: dict[tuple[str, int, str], list[float]] = {}
    loads: dict[str, list[str]] = {s: [] for s in scenarios}
    with contextlib.ExitStack() as stack:
        runners: dict[str, Callable[[list[list[int]], int], float]] = {}
        started = time.perf_counter()
        for system in systems:
            t0 = time.perf_counter()
            if system in ("default", "omp1", "base", "base1"):
                env = _env("1" if system in ("omp1", "base1") else None,
                           args.base_tree if system.startswith("base") else None)  # fmt: skip
                url, _ = stack.enter_context(
                    server_process(_engine_flags(model), start_timeout_s=600, env=env)
                )
                runners[system] = lambda ps, c, url=url: served_rate(url, ps, c, args.output_len)
            elif system == "vllm":
                try:
                    url = stack.enter_context(
                        vllm_server(args.vllm_python, model, not args.vllm_no_preload)
                    )
                except RuntimeError as exc:
                    print(f"vllm: not run ({exc})")
                    continue
                runners[system] = lambda ps, c, url=url: served_rate(url, ps, c, args.output_len)
            elif system == "hf":
                hf = HFGenerate(model, args.hf_threads)
                runners[system] = lambda ps, c, hf=hf: hf.rate(ps, c, args.output_len)
            else:
                raise SystemExit(f"unknown system {system!r}")
            print(f"{model_name}: {system} ready in {time.perf_counter() - t0:.1f} s")
        for runner in runners.values():  # warm up: one short request each
            runner(prompts[concurrencies[0]][:1], 1)
        names = list(runners)
        print(f"{model_name}: systems ready in {time.perf_counter() - started:.0f} s")
        for round_index in range(args.rounds):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for scenario in scenarios:
                with cpu_load(args.load if scenario == "load" else 0):
                    loads[scenario].append(load_average())
                    for c in concurrencies:
                        for system in order:
                            rate = runners[system](prompts[c], c)
                            rates.setdefault((scenario, c, system), []).append(rate)
                            print(f"  round {round_index + 1} {scenario} c={c} {system}: "
                                  f"{rate:.1f} tok/s (load {load_average()})", flush=True)  # fmt: skip
                    loads[scenario].append(load_average())
        names_run = names
    return _report(model_name, names_run, concurrencies, scenarios, rates, loads, args)


def _report(
    model_name: str,
    names: list[str],
    concurrencies: list[int],
    scenarios: list[str],
    rates: dict[tuple[str, int, str], list[float]],
    loads: dict[str, list[str]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    reference = "vllm" if "vllm" in names else ("hf" if "hf" in names else names[0])
    print(f"\n{machine_line()}")
    print(f"{model_name}: {args.input_len}-in/{args.output_len}-out random tokens, output tok/s "
          f"(median of {args.rounds} round(s)); ratio to {reference} (and the median of the "
          f"rounds' own ratios, each round's systems run back to back)")  # fmt: skip
    out: dict[str, Any] = {"reference": reference, "loads": loads, "rows": []}
    for scenario in scenarios:
        label = f"load {args.load}" if scenario == "load" else "quiet"
        print(f"  {label} (load average during the runs: {' → '.join(loads[scenario])})")
        for c in concurrencies:
            ref_rounds = rates[(scenario, c, reference)]
            ref = statistics.median(ref_rounds)
            cells = []
            for system in names:
                rounds = rates[(scenario, c, system)]
                median = statistics.median(rounds)
                per_round = statistics.median(
                    a / b for a, b in zip(rounds, ref_rounds, strict=True)
                )
                cells.append(f"{system} {median:7.1f} ({median / ref:4.2f}x; {per_round:4.2f}x)")
                out["rows"].append({
                    "scenario": scenario, "concurrency": c, "system": system,
                    "median_tok_s": median, "ratio": median / ref,
                    "ratio_per_round": per_round, "rounds": rounds,
                })  # fmt: skip
            print(f"    c={c:<3d} " + "  ".join(cells))
    print(json.dumps({"loads": loads}))
    return out


if __name__ == "__main__":
    main()
