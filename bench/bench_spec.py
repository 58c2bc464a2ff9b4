#!/usr/bin/env python3
"""Speculative decoding on the mock: speculation off against static k and dynamic k.

A real in-process ``EngineCore`` drives the mock, whose every step lasts ``5 ms + 50 us x
scheduled tokens`` (drafts are scheduled tokens). Closed batches of ``B`` requests, 32-token
prompts, 256 output tokens each, greedy, ``ignore_eos``:

- **simulated time**: the mock's latency model runs on a clock that only its waits move, so a
  run's time is the sum of its modelled steps (exact, no host overhead, seconds to run);
- **real time**: the mock sleeps; the host's own work counts (median of ``--rounds``
  interleaved rounds).

Workloads:

- the mock drafter, right with probability ``p`` per draft, ``p`` in {0.5, 0.7, 0.9}, at
  ``B`` in {1, 8, 32, 64, 128, 256}: off, static ``k = 4``, dynamic (``k <= 4`` and ``k <= 8``).
  The model column is the expected ratio of static ``k = 4`` and the model's best ``k``:
  ``E(k) x (a + b B) / (a + b B (1 + k))`` with ``E(k) = (1 - p**(k + 1)) / (1 - p)``;
- n-gram (prompt lookup) drafts on outputs that copy 75 % of their tokens from a 512-token
  prompt (``copy_prompt``), at ``B`` = 1 and 64, plus the proposer's own cost per request at 2k
  tokens of context.

Every run's outputs are checked to be the same tokens as with speculation off.

Usage: ``python bench/bench_spec.py [--rounds 5] [--batches 1,8,32,64,128,256] [--p 0.5,0.7,0.9]
[--no-real] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from engine_core_mock import MockBackend

from engine_core._bench.machine import machine_line, write_results
from engine_core._core.engine_io import EngineCoreRequest
from engine_core._engine.core import EngineCore
from engine_core.abc import Backend
from engine_core.config import EngineConfig, SpeculativeConfig
from engine_core.sampling_params import SamplingParams

STEP_S = 0.005
PER_TOKEN_S = 50e-6
OUTPUT_TOKENS = 256
PROMPT_TOKENS = 32
VOCAB = 32000
COPY = {"fraction": 0.75, "period": 64}
COPY_PROMPT_TOKENS = 512


# -- the model ------------------------------------------------------------------------------------


def acceptance_length(p: float, k: int) -> float:
    """Mean tokens per step with ``k`` drafts each right with probability ``p``."""
    return float(k + 1) if p == 1 else (1 - p ** (k + 1)) / (1 - p)


def model_ratio(p: float, k: int, batch: int, a: float = STEP_S, b: float = PER_TOKEN_S) -> float:
    """Expected tokens/s with ``k`` drafts per request over tokens/s without speculation."""
    return acceptance_length(p, k) * (a + b * batch) / (a + b * batch * (1 + k))


def model_best(p: float, k_max: int, batch: int) -> tuple[float, int]:
    """The model's best ratio over ``k`` in 0..k_max, and that ``k``."""
    return max((model_ratio(p, k, batch), k) for k in range(k_max + 1))


# -- running the engine ---------------------------------------------------------------------------


class SimClock:
    """Simulated time: reading it costs nothing, sleeping moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)


def _backend_on(sim: SimClock) -> type[Backend]:
    class SimulatedMock(MockBackend):
        def __init__(self, config: EngineConfig) -> None:
            super().__init__(config, sleep=sim.sleep, clock=sim.clock)

    return SimulatedMock


def engine_config(
    batch: int, options: dict[str, Any], spec: dict[str, Any] | None, **extra: Any
) -> EngineConfig:
    return EngineConfig(
        backend="mock",
        tokenizer="byte",
        max_num_seqs=batch,
        max_model_len=COPY_PROMPT_TOKENS + OUTPUT_TOKENS + 64,
        backend_options={
            "vocab_size": VOCAB,
            "latency": {"step_s": STEP_S, "per_token_s": PER_TOKEN_S},
            **options,
        },
        speculative_config=None if spec is None else SpeculativeConfig(**spec),
        **extra,
    )


def run(
    config: EngineConfig, prompts: list[list[int]], simulated: bool, tag: str = "r"
) -> tuple[float, int, dict[str, list[int]]]:
    """One closed batch to completion: (seconds, steps, output tokens per request). Request
    ids are ``tag`` + index: the mock drafter's guesses hash them."""
    sim = SimClock() if simulated else None
    if sim is not None:
        core = EngineCore(config, backend_cls=_backend_on(sim), clock=sim.clock)
        clock: Callable[[], float] = sim.clock
    else:
        core = EngineCore(config)
        clock = time.perf_counter
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    try:
        gc.collect()
        start = clock()
        for i, prompt in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"{tag}{i}", prompt, params))
        while core.has_unfinished_requests():
            out = core.step()
            for req_id, new in zip(out.req_ids, out.new_token_ids, strict=True):
                tokens.setdefault(req_id, []).extend(new)
        seconds = clock() - start
        steps = core.num_steps
        if core.scheduler.kv.num_free_blocks != core.num_kv_blocks:
            raise RuntimeError("KV blocks leaked")
    finally:
        core.close()
    if any(len(t) != OUTPUT_TOKENS for t in tokens.values()) or len(tokens) != len(prompts):
        raise RuntimeError("a request did not produce its tokens")
    return seconds, steps, tokens


def prompts_for(batch: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(batch)]


# -- the modes ------------------------------------------------------------------------------------

Mode = tuple[str, dict[str, Any] | None, dict[str, Any]]
"""(name, speculative_config fields or None for off, extra EngineConfig fields)."""

OFF: Mode = ("off", None, {"async_scheduling": False})
OFF_ASYNC: Mode = ("off async", None, {})


def mock_modes() -> list[Mode]:
    return [
        OFF,
        ("k=4", {"method": "mock", "num_speculative_tokens": 4, "dynamic": False}, {}),
        ("dyn<=4", {"method": "mock", "num_speculative_tokens": 4}, {}),
        ("dyn<=8", {"method": "mock", "num_speculative_tokens": 8}, {}),
    ]


def ngram_modes() -> list[Mode]:
    return [
        OFF,
        ("k=4", {"method": "ngram", "num_speculative_tokens": 4, "dynamic": False}, {}),
        ("dyn<=8", {"method": "ngram", "num_speculative_tokens": 8}, {}),
    ]


def config_for(batch: int, options: dict[str, Any], mode: Mode) -> EngineConfig:
    _, spec, extra = mode
    return engine_config(batch, options, spec, **extra)


def time_modes(
    batch: int,
    options: dict[str, Any],
    modes: list[Mode],
    prompts: list[list[int]],
    simulated: bool,
    rounds: int,
) -> dict[str, dict[str, float]]:
    """Each mode's median seconds and steps over ``rounds`` interleaved rounds (every mode
    once per round), and its ratio of tokens/s to the first mode's, as a median of the
    per-round ratios. Each round names its requests anew (other draws of the mock drafter).
    Every mode's outputs must equal the first's."""
    seconds: dict[str, list[float]] = {m[0]: [] for m in modes}
    steps: dict[str, int] = {}
    for round_index in range(rounds):
        reference: dict[str, list[int]] | None = None
        for mode in modes:
            config = config_for(batch, options, mode)
            s, n, tokens = run(config, prompts, simulated, f"round{round_index}-")
            if reference is None:
                reference = tokens
            elif tokens != reference:
                raise RuntimeError(f"{mode[0]} at batch {batch}: outputs differ from {modes[0][0]}")
            seconds[mode[0]].append(s)
            steps[mode[0]] = n
    base = seconds[modes[0][0]]
    return {
        name: {
            "seconds": statistics.median(values),
            "steps": steps[name],
            "ratio": statistics.median(b / v for b, v in zip(base, values, strict=True)),
            "ratios": [b / v for b, v in zip(base, values, strict=True)],
        }
        for name, values in seconds.items()
    }


def ngram_proposer_us(context: int = 2048, k: int = 4, num: int = 2000) -> dict[str, float]:
    """Microseconds per proposal of the core's n-gram proposer at ``context`` tokens, as in
    decoding (one token appended per call), on copy-workload text: a hit and a miss each."""
    from engine_core.ngram import NgramIndex, NgramProposer

    proposer = NgramProposer()
    rng = random.Random(5)
    results = {}
    for case in ("hit", "miss"):
        base = [rng.randrange(3, VOCAB) for _ in range(context)]
        index = NgramIndex()
        tokens = list(base)
        proposer.propose(tokens, k, index)
        times = []
        for i in range(num):
            # A hit: the sequence ends with a span copied from its start; a miss: fresh tokens.
            tokens.append(base[i % 512] if case == "hit" else rng.randrange(3, VOCAB))
            start = time.perf_counter()
            proposer.propose(tokens, k, index)
            times.append(time.perf_counter() - start)
        results[case] = statistics.median(times) * 1e6
    return results


# -- output ---------------------------------------------------------------------------------------


def _fmt(row: dict[str, dict[str, float]], names: list[str]) -> str:
    return " ".join(f"{row[n]['ratio']:>7.3f}x" for n in names)


def mock_table(args: argparse.Namespace, results: dict[str, Any]) -> None:
    modes = mock_modes()
    names = [m[0] for m in modes[1:]] + ["k=best"]
    print(
        f"\nmock drafter, simulated time: tokens/s over off (model: static k=4 / best k); "
        f"'k=best': static at the model's best k; median of max({args.sim_rounds}, 32 / B) "
        "rounds\n"
        f"{'p':>4} {'B':>4} " + " ".join(f"{n:>8}" for n in names) + "   model k=4 / best (k)"
    )
    rows = []
    for p in args.p:
        options = {"spec": {"acceptance_rate": p}}
        for batch in args.batches:
            prompts = prompts_for(batch, PROMPT_TOKENS, batch)
            best, best_k = model_best(p, 8, batch)
            static_best: Mode = (
                "k=best",
                {"method": "mock", "num_speculative_tokens": best_k, "dynamic": False},
                {},
            )
            with_best = modes + ([static_best] if best_k else [])
            # One request's acceptance varies from run to run (±5 % at B = 1): more rounds
            # (other request ids) where they are cheap.
            rounds = max(args.sim_rounds, 32 // batch)
            row = time_modes(batch, options, with_best, prompts, True, rounds)
            if not best_k:
                row["k=best"] = row["off"]
            print(
                f"{p:>4} {batch:>4} {_fmt(row, names)}   {model_ratio(p, 4, batch):.3f}x / "
                f"{best:.3f}x (k={best_k})",
                flush=True,
            )
            rows.append(
                {
                    "p": p,
                    "batch": batch,
                    "modes": row,
                    "model_k4": model_ratio(p, 4, batch),
                    "model_best": best,
                    "model_best_k": best_k,
                }
            )
    results["mock_simulated"] = rows


def real_targets(args: argparse.Namespace, results: dict[str, Any]) -> None:
    print(f"\nreal time, p = 0.7, median of {args.rounds} interleaved rounds (ratio to off)")
    options = {"spec": {"acceptance_rate": 0.7}}
    cases = [
        (1, [OFF, mock_modes()[1], mock_modes()[3]], "B=1: k=4 >= 2.5x"),
        (64, [OFF, mock_modes()[2], OFF_ASYNC], "B=64: dynamic >= 1.15x"),
        (256, [OFF, mock_modes()[2], OFF_ASYNC], "B=256: dynamic >= 0.95x"),
    ]
    rows = []
    for batch, modes, target in cases:
        if batch not in args.batches:
            continue
        prompts = prompts_for(batch, PROMPT_TOKENS, batch)
        row = time_modes(batch, options, modes, prompts, simulated=False, rounds=args.rounds)
        print(
            f"B={batch:<4} "
            + ", ".join(
                f"{name} {r['ratio']:.3f}x ({r['seconds']:.2f} s, {r['steps']} steps; rounds "
                + " ".join(f"{x:.3f}" for x in r["ratios"])
                + ")"
                for name, r in row.items()
                if name != "off"
            )
            + f"   target {target}",
            flush=True,
        )
        rows.append({"batch": batch, "modes": row})
    results["mock_real"] = rows


def ngram_table(args: argparse.Namespace, results: dict[str, Any]) -> None:
    modes = ngram_modes()
    names = [m[0] for m in modes[1:]]
    options = {"copy_prompt": COPY}
    print(
        f"\nn-gram on outputs copying {COPY['fraction']:.0%} of their tokens from a "
        f"{COPY_PROMPT_TOKENS}-token prompt (ratio to off; real: median of {args.rounds})\n"
        f"{'B':>4} {'clock':<6} " + " ".join(f"{n:>8}" for n in names)
    )
    rows = []
    for batch in [b for b in args.batches if b in (1, 64, 256)]:
        prompts = prompts_for(batch, COPY_PROMPT_TOKENS, 1000 + batch)
        for simulated in (True, False):
            if not simulated and args.no_real:
                continue
            rounds = args.sim_rounds if simulated else args.rounds
            row = time_modes(batch, options, modes, prompts, simulated, rounds)
            clock = "sim" if simulated else "real"
            print(f"{batch:>4} {clock:<6} {_fmt(row, names)}", flush=True)
            rows.append({"batch": batch, "clock": clock, "modes": row})
    cost = ngram_proposer_us()
    print(
        f"n-gram proposer at 2048 tokens of context, k=4: {cost['hit']:.1f} us per proposal "
        f"with a match, {cost['miss']:.1f} us without (target <= 20 us)"
    )
    results["ngram"] = {"rows": rows, "proposer_us": cost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="real-time rounds")
    parser.add_argument("--sim-rounds", type=int, default=3, help="simulated-time rounds")
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--p", default="0.5,0.7,0.9")
    parser.add_argument("--no-real", action="store_true", help="simulated time only")
    parser.add_argument("--only", default="mock,real,ngram", help="mock, real, ngram")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.p = [float(p) for p in args.p.split(",")]
    only = set(args.only.split(","))
    print(machine_line(), flush=True)
    print(
        f"mock step {STEP_S * 1e3:g} ms + {PER_TOKEN_S * 1e6:g} us per scheduled token; "
        f"{OUTPUT_TOKENS} output tokens, greedy; off schedules synchronously as speculation does "
        "('off async': async scheduling)"
    )
    results: dict[str, Any] = {}
    if "mock" in only:
        mock_table(args, results)
    if "real" in only and not args.no_real:
        real_targets(args, results)
    if "ngram" in only:
        ngram_table(args, results)
    write_results(args.json, results)


if __name__ == "__main__":
    main()
