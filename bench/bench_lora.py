#!/usr/bin/env python3
"""Multi-LoRA serving on the mock backend: what adapters cost the engine.

1. ``throughput``: 256 streams (32-token prompts, 64 greedy output tokens each) over 16
   adapters, with ``max_loras`` 4, 8 and 16, against the same load without adapters (LoRA
   off). The engine runs in process (``AsyncLLM(multiprocess=False)``) with no latency model,
   so its tok/s is the engine's own ceiling and every microsecond of LoRA bookkeeping shows.
   The configurations run in interleaved rounds (the machine is noisy); each ratio is the
   median of the rounds' own ratios (to LoRA off, or to the same batch). With ``max_loras``
   16 the cap never binds: that ratio is the scheduling overhead. With 4 and 8 requests of
   other adapters wait for a slot (by design), so steps are smaller and tok/s lower: their
   overhead is measured against LoRA off with the same batch (``max_num_seqs`` =
   ``max_loras`` x the streams per adapter, 64 and 128), run in the same rounds. The streams
   take the adapters in turn, so a bound cap's batch is four (eight) of every sixteen requests
   in arrival order; ``max_loras 4 grouped`` gives neighbouring streams the same adapter, so
   its batch is requests that arrived together, as the control's is. After each run the most
   adapters any step had is checked against ``max_loras`` (asserted).
2. ``churn``: the ``max_loras`` 8 load while a task loads a new adapter, runs requests with
   it, removes it, and removes adapters that running requests use (they finish; the next
   request of that adapter loads it again), over and over. Failed requests are counted
   (asserted 0).
3. ``step_cpu``: ``bench_scheduler``'s W1 (256 requests x 128 prompt tokens, 128 output
   tokens), the scheduler alone, LoRA off against LoRA on (16 adapters, ``max_loras`` 16, and
   ``max_loras`` 4 for the binding cap), interleaved, median of the rounds: the per-step CPU
   cost ratio (target <= 1.05 where the cap does not bind).

4. ``instructions`` (not in ``all``; needs ``valgrind``): the ``throughput`` loads counted in
   CPU instructions instead of seconds, which a busy machine does not move: each configuration
   runs in its own process under callgrind, one warm-up load and then ``--runs`` counted ones
   (callgrind's counters zeroed before them and dumped after, through its client requests; a
   small C helper built at the start). The ratios (``max_loras`` 16 to LoRA off, 8 and 4 to
   LoRA off with the same batch) are the engine's CPU cost of LoRA as such, for the whole
   stack in one process. About 3 minutes on 2 cores.

Usage: ``python bench/bench_lora.py [--part throughput|churn|step_cpu|all|instructions]
[--rounds 5] [--runs 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import gc
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from engine_core import AsyncLLM, LoRARequest, RequestOutputKind, SamplingParams
from engine_core._bench.machine import machine_line, write_results
from engine_core._core.request import Request
from engine_core._core.scheduler import Scheduler, SchedulerConfig
from engine_core.abc import ModelRunnerOutput
from engine_core.config import EngineConfig

NUM_STREAMS = 256
NUM_ADAPTERS = 16
PROMPT_LEN = 32
MAX_TOKENS = 64


# The throughput part's configurations: (max_loras or None for LoRA off, max_num_seqs).
LOADS: dict[str, tuple[int | None, int]] = {
    "lora off": (None, NUM_STREAMS),
    "max_loras 16": (16, NUM_STREAMS),
    "max_loras 8": (8, NUM_STREAMS),
    "off 128 seqs": (None, 8 * NUM_STREAMS // NUM_ADAPTERS),
    "max_loras 4": (4, NUM_STREAMS),
    "off 64 seqs": (None, 4 * NUM_STREAMS // NUM_ADAPTERS),
    "max_loras 4 grouped": (4, NUM_STREAMS),
}
GROUPED = {"max_loras 4 grouped"}
"""Loads whose streams of one adapter are neighbours (stream i runs adapter i // 16; the others
take the adapters in turn): a bound cap's batch is then requests that arrived together, as the
control's is, rather than four of every sixteen."""
# Each LoRA configuration's control: LoRA off with the same batch (where the cap binds).
CONTROLS = {
    "max_loras 16": "lora off",
    "max_loras 8": "off 128 seqs",
    "max_loras 4": "off 64 seqs",
    "max_loras 4 grouped": "off 64 seqs",
}


def adapters_for(name: str, adapters: list[LoRARequest]) -> list[LoRARequest] | None:
    """What ``run_load`` gives load ``name``'s streams (stream i takes entry i mod its
    length): None for LoRA off."""
    if LOADS[name][0] is None:
        return None
    if name in GROUPED:
        return [adapters[i * len(adapters) // NUM_STREAMS] for i in range(NUM_STREAMS)]
    return adapters


def make_adapters(root: Path, n: int, first_id: int = 1) -> list[LoRARequest]:
    adapters = []
    for i in range(first_id, first_id + n):
        path = root / f"adapter-{i}"
        path.mkdir(exist_ok=True)
        (path / "adapter_config.json").write_text(
            json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj", "v_proj"]})
        )
        (path / "mock.json").write_text(json.dumps({"offset": i % 5}))
        adapters.append(LoRARequest(f"adapter-{i}", i, str(path)))
    return adapters


def engine_for(max_loras: int | None, max_num_seqs: int = NUM_STREAMS) -> AsyncLLM:
    lora: dict[str, Any] = (
        {}
        if max_loras is None
        else {"enable_lora": True, "max_loras": max_loras, "max_cpu_loras": NUM_ADAPTERS + 4}
    )
    return AsyncLLM(
        backend="mock", tokenizer="byte", multiprocess=False, max_num_seqs=max_num_seqs, **lora
    )


async def run_load(
    engine: AsyncLLM, adapters: list[LoRARequest] | None, seed: int
) -> tuple[int, float, int]:
    """256 streams; returns (output tokens, seconds, failed requests)."""
    rng = random.Random(seed)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    tokens = failed = 0

    async def one(i: int) -> None:
        nonlocal tokens, failed
        prompt = [rng.randrange(3, 250) for _ in range(PROMPT_LEN)]
        lora = adapters[i % len(adapters)] if adapters else None
        async for out in engine.generate(
            {"prompt_token_ids": prompt}, params, request_id=f"s{seed}-{i}", lora_request=lora
        ):
            if out.finished:
                if out.outputs[0].finish_reason == "error":
                    failed += 1
                tokens += len(out.outputs[0].token_ids)

    gc.collect()  # each run starts from the same heap (the engines share this process)
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(NUM_STREAMS):
            tg.start_soon(one, i)
    return tokens, time.perf_counter() - start, failed


def _backend(engine: AsyncLLM) -> Any:
    return engine._client.engine_core.backend  # type: ignore[union-attr]


async def throughput(rounds: int, root: Path) -> dict[str, Any]:
    adapters = make_adapters(root, NUM_ADAPTERS)
    configs = {name: max_loras for name, (max_loras, _) in LOADS.items()}
    controls = {name: control for name, control in CONTROLS.items() if control != "lora off"}
    engines = {name: engine_for(*load) for name, load in LOADS.items()}
    results: dict[str, list[float]] = {name: [] for name in configs}
    async with contextlib.AsyncExitStack() as stack:
        for engine in engines.values():
            await stack.enter_async_context(engine)
        for name, engine in engines.items():  # warm up (adapters loaded, caches filled)
            await run_load(engine, adapters_for(name, adapters), seed=-1)
        for r in range(rounds):
            order = list(configs)
            random.Random(r).shuffle(order)
            for name in order:
                engine = engines[name]
                tokens, seconds, failed = await run_load(
                    engine, adapters_for(name, adapters), seed=r
                )
                assert failed == 0, f"{name}: {failed} requests failed"
                assert tokens == NUM_STREAMS * MAX_TOKENS
                results[name].append(tokens / seconds)
        per_step = {
            name: _backend(engines[name]).max_loras_in_step for name in configs if configs[name]
        }
        for name, most in per_step.items():
            assert most <= configs[name], f"{name}: a step had {most} adapters"

    def ratio(name: str, control: str) -> float:
        """The median of the rounds' own ratios (the machine's speed drifts between rounds)."""
        return statistics.median(
            x / y for x, y in zip(results[name], results[control], strict=True)
        )

    rows = {
        name: {
            "tok_s_median": statistics.median(v),
            "tok_s_rounds": v,
            "ratio_to_lora_off": ratio(name, "lora off"),
            "most_adapters_in_a_step": per_step.get(name, 0),
        }
        for name, v in results.items()
    }
    for name, control in controls.items():
        rows[name]["ratio_to_same_batch"] = ratio(name, control)
    print(f"throughput: {NUM_STREAMS} streams over {NUM_ADAPTERS} adapters, median of {rounds}")
    for name, row in rows.items():
        print(
            f"  {name:<19} {row['tok_s_median']:>9.0f} tok/s  x{row['ratio_to_lora_off']:.3f}"
            f"  most adapters in a step {row['most_adapters_in_a_step']}"
            + (
                f"  x{row['ratio_to_same_batch']:.3f} vs {controls[name]}"
                if name in controls
                else ""
            )
        )
    return rows


async def churn(root: Path) -> dict[str, Any]:
    adapters = make_adapters(root, NUM_ADAPTERS)
    extra = make_adapters(root, 8, first_id=100)
    counts = {"loads": 0, "removes_in_use": 0, "churn_requests": 0, "churn_failed": 0}
    async with engine_for(8) as engine:
        done = anyio.Event()

        async def churner() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            i = 0
            while not done.is_set():
                new = extra[i % len(extra)]
                await engine.add_lora(new)
                counts["loads"] += 1
                async for out in engine.generate(
                    {"prompt_token_ids": [5, 6, 7]}, params, request_id=f"c{i}", lora_request=new
                ):
                    if out.finished:
                        counts["churn_requests"] += 1
                        counts["churn_failed"] += out.outputs[0].finish_reason == "error"
                await engine.remove_lora(new.lora_int_id)
                victim = adapters[i % len(adapters)]
                if await engine.remove_lora(victim.lora_int_id):  # in use by the load
                    counts["removes_in_use"] += 1
                i += 1
                await anyio.sleep(0.005)

        tokens = seconds = failed = 0.0
        async with anyio.create_task_group() as tg:
            tg.start_soon(churner)
            for r in range(3):
                t, s, f = await run_load(engine, adapters, seed=100 + r)
                tokens, seconds, failed = tokens + t, seconds + s, failed + f
            done.set()
        most = _backend(engine).max_loras_in_step
    assert failed == 0 and counts["churn_failed"] == 0, (failed, counts)
    assert most <= 8
    result = {
        **counts,
        "load_failed": int(failed),
        "tok_s": tokens / seconds,
        "most_adapters_in_a_step": most,
    }
    print(
        f"churn (max_loras 8): {counts['loads']} loads, {counts['removes_in_use']} removals of "
        f"adapters in use, {int(failed)} + {counts['churn_failed']} failed requests, "
        f"{result['tok_s']:.0f} tok/s, most adapters in a step {most}"
    )
    return result


def step_cpu_once(max_loras: int | None, prompts: list[list[int]]) -> tuple[float, float]:
    """Mean microseconds of schedule() + update_from_output() per step, and per output token
    (W1)."""
    config = EngineConfig(
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=8192,
        enable_prefix_caching=True,
        enable_lora=max_loras is not None,
        max_loras=max_loras or 1,
    ).resolved(model_max_len=None)
    scheduler = Scheduler(SchedulerConfig.from_engine_config(config), 8192)
    loras = [LoRARequest(f"a{i}", i, f"/a/{i}") for i in range(1, NUM_ADAPTERS + 1)]
    scheduler.lora_ready = {a.lora_int_id for a in loras}
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    for i, p in enumerate(prompts):
        scheduler.add_request(
            Request(
                f"r{i}",
                p,
                params,
                block_size=16,
                arrival_time=float(i),
                lora_request=loras[i % NUM_ADAPTERS] if max_loras else None,
            )
        )
    total = 0.0
    steps = 0
    while scheduler.has_unfinished_requests():
        a = time.perf_counter()
        out = scheduler.schedule()
        sampled = [
            [7] if r.num_computed_tokens >= len(r.all_token_ids) else []
            for r in scheduler.scheduled
        ]
        b = time.perf_counter()
        runner = ModelRunnerOutput(out.req_ids, sampled)
        c = time.perf_counter()
        scheduler.update_from_output(out, runner)
        d = time.perf_counter()
        total += (b - a) + (d - c)
        steps += 1
    return total / steps * 1e6, total / (len(prompts) * 128) * 1e6


def step_cpu(rounds: int) -> dict[str, Any]:
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, 32000) for _ in range(128)] for _ in range(256)]
    configs: dict[str, int | None] = {"lora off": None, "max_loras 16": 16, "max_loras 4": 4}
    times: dict[str, list[float]] = {name: [] for name in configs}
    per_token: dict[str, list[float]] = {name: [] for name in configs}
    step_cpu_once(None, prompts)  # warm up
    for r in range(rounds):
        order = list(configs)
        random.Random(r).shuffle(order)
        for name in order:
            step_us, token_us = step_cpu_once(configs[name], prompts)
            times[name].append(step_us)
            per_token[name].append(token_us)
    # Each round's ratio to its own "lora off" (the machine's load moves between rounds).
    off = times["lora off"]
    rows = {
        name: {
            "step_us_median": statistics.median(v),
            "step_ratio": statistics.median(x / y for x, y in zip(v, off, strict=True)),
            "token_us_median": statistics.median(per_token[name]),
            "token_ratio": statistics.median(
                x / y for x, y in zip(per_token[name], per_token["lora off"], strict=True)
            ),
        }
        for name, v in times.items()
    }
    print(f"step_cpu (W1, scheduler alone), median of {rounds} interleaved rounds")
    for name, row in rows.items():
        print(
            f"  {name:<19} {row['step_us_median']:>7.0f} us/step x{row['step_ratio']:.3f}  "
            f"{row['token_us_median']:>6.2f} us/token x{row['token_ratio']:.3f}"
        )
    return rows


_COUNTER_SOURCE = """
#include <valgrind/callgrind.h>
void counted_start(void) { CALLGRIND_ZERO_STATS; }
void counted_end(void) { CALLGRIND_DUMP_STATS_AT("counted loads"); }
"""
COUNTER_ENV = "BENCH_LORA_COUNTER"
"""The instructions part's helper library (callgrind's client requests), for ``_loads``."""


async def run_loads(name: str, runs: int) -> None:
    """One warm-up load, then ``runs`` counted ones of configuration ``name`` (``--part
    _loads``): under callgrind, the counters are zeroed before them and dumped after, every
    thread's included, so the warm-up (adapter loads, first-use caches) is not counted."""
    max_loras, seqs = LOADS[name]
    counter = ctypes.CDLL(os.environ[COUNTER_ENV])
    with tempfile.TemporaryDirectory() as tmp:
        adapters = adapters_for(name, make_adapters(Path(tmp), NUM_ADAPTERS))
        async with engine_for(max_loras, seqs) as engine:
            await run_load(engine, adapters, seed=-1)
            gc.collect()
            counter.counted_start()
            for seed in range(runs):
                _, _, failed = await run_load(engine, adapters, seed=seed)
                assert failed == 0
            counter.counted_end()


def instructions(runs: int) -> dict[str, Any]:
    valgrind, cc = shutil.which("valgrind"), shutil.which("cc") or shutil.which("gcc")
    if valgrind is None or cc is None:
        raise SystemExit("--part instructions needs valgrind and a C compiler")
    with tempfile.TemporaryDirectory() as tmp:
        source, library = Path(tmp, "counter.c"), Path(tmp, "counter.so")
        source.write_text(_COUNTER_SOURCE)
        built = subprocess.run([cc, "-shared", "-fPIC", "-o", library, source], check=False)
        if built.returncode != 0:
            raise SystemExit("could not build the callgrind helper (is valgrind's header there?)")
        # One hash seed: set and dict orders, and so the work, are the same in every process.
        env = {**os.environ, "PYTHONHASHSEED": "0", COUNTER_ENV: str(library)}

        def count(name: str) -> int:
            out = Path(tmp, name.replace(" ", "_") + ".out")
            command = [valgrind, "--tool=callgrind", f"--callgrind-out-file={out}"]
            command += [sys.executable, __file__, "--part", "_loads", "--config", name]
            command += ["--runs", str(runs)]
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            dump = Path(f"{out}.1")  # the dump of the counted loads
            found = re.search(r"^totals: (\d+)", dump.read_text(), re.M) if dump.exists() else None
            if done.returncode != 0 or found is None:
                raise RuntimeError(f"{name}: callgrind run failed:\n{done.stderr[-2000:]}")
            return int(found.group(1))

        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            totals = dict(zip(LOADS, pool.map(count, LOADS), strict=True))
    per_load = {name: total / runs for name, total in totals.items()}
    rows: dict[str, Any] = {name: {"instructions_per_load": n} for name, n in per_load.items()}
    print(f"instructions per load ({NUM_STREAMS} streams x {MAX_TOKENS} tokens), callgrind")
    for name, n in per_load.items():
        line = f"  {name:<19} {n / 1e6:>8.1f} M"
        if name in CONTROLS:
            ratio = n / per_load[CONTROLS[name]]
            rows[name]["ratio_to_control"] = ratio
            line += f"  x{ratio:.4f} of {CONTROLS[name]}"
        print(line)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parts = ["throughput", "churn", "step_cpu", "all", "instructions", "_loads"]
    parser.add_argument("--part", default="all", choices=parts)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3, help="loads counted (instructions)")
    parser.add_argument("--config", default="lora off", choices=list(LOADS), help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.part == "_loads":  # one configuration's loads, run under callgrind
        anyio.run(run_loads, args.config, args.runs)
        return
    print(machine_line(), f"load average {os.getloadavg()[0]:.2f}", flush=True)
    if args.part == "instructions":
        write_results(args.json, {"instructions": instructions(args.runs)})
        return
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.part in ("throughput", "all"):
            results["throughput"] = anyio.run(throughput, args.rounds, root)
        if args.part in ("churn", "all"):
            results["churn"] = anyio.run(churn, root)
        if args.part in ("step_cpu", "all"):
            results["step_cpu"] = step_cpu(args.rounds)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    write_results(args.json, results)


if __name__ == "__main__":
    main()
