"""The ``engine-core`` command line.

``engine-core backends`` lists installed backends; ``engine-core generate "PROMPT"`` streams a
completion; ``engine-core bench throughput`` runs an offline throughput benchmark.
Every :class:`~engine_core.EngineConfig` field is a flag (``--max-num-seqs 64``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import typing
from collections.abc import Sequence
from typing import Any

import msgspec

from engine_core.config import EngineConfig

__all__ = ["add_engine_config_flags", "engine_config_from_args", "main"]


def _flag_type(annotation: Any) -> tuple[Any, dict[str, Any]]:
    """argparse ``type`` and extra kwargs for one EngineConfig field annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if len(args) == 1 else annotation
    if typing.get_origin(base) is typing.Literal:
        return str, {"choices": list(typing.get_args(base))}
    if base is bool or annotation is bool:
        return None, {"action": argparse.BooleanOptionalAction}
    if base is int:
        return int, {}
    if base is float:
        return float, {}
    if typing.get_origin(base) is dict or base is dict:
        return json.loads, {"metavar": "JSON"}
    return str, {}


def add_engine_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per EngineConfig field (defaults left to EngineConfig)."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine configuration")
    for name in EngineConfig.__struct_fields__:
        flag_type, extra = _flag_type(hints[name])
        kwargs: dict[str, Any] = {"default": None, "dest": f"cfg_{name}", **extra}
        if flag_type is not None:
            kwargs["type"] = flag_type
            kwargs.setdefault("metavar", name.upper())
        group.add_argument("--" + name.replace("_", "-"), **kwargs)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig the flags describe (flags not given keep EngineConfig's defaults)."""
    fields = {
        name: getattr(args, f"cfg_{name}")
        for name in EngineConfig.__struct_fields__
        if getattr(args, f"cfg_{name}", None) is not None
    }
    fields.update(overrides)
    return EngineConfig(**fields)


# -- commands ------------------------------------------------------------------------------------


def cmd_backends(args: argparse.Namespace) -> int:
    from engine_core._backends import list_backends

    found = list_backends()
    if not found:
        print("no backend installed; pip install engine-core-mock (or engine-core-cuda)")
        return 1
    width = max(len(n) for n in found)
    for info in found.values():
        state = "usable" if info.usable else "unusable"
        hint = f"  ({info.install_hint})" if not info.usable and info.install_hint else ""
        print(f"{info.name:<{width}}  {state:<8}  {info.detail}{hint}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from engine_core import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=args.stop or None,
    )
    with LLM.from_config(engine_config_from_args(args)) as llm:
        output = llm.generate(args.prompt, params, use_tqdm=False)[0]
    completion = output.outputs[0]
    if completion.finish_reason == "error":
        print(f"error: {output.error}", file=sys.stderr)
        return 1
    print(completion.text)
    return 0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from engine_core import LLM, SamplingParams
    from engine_core._machine import machine_line

    config = engine_config_from_args(args)
    rng = random.Random(args.cfg_seed or 0)
    with LLM.from_config(config) as llm:
        vocab = llm.vocab_size
        low = 3 if vocab > 300 else 0
        high = min(vocab, 256) if vocab <= 300 else vocab
        prompts = [
            {"prompt_token_ids": [rng.randrange(low, high) for _ in range(args.input_len)]}
            for _ in range(args.num_prompts)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
        elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    latencies = [
        o.metrics.finished_time - o.metrics.arrival_time
        for o in outputs
        if o.metrics is not None and o.metrics.finished_time is not None
    ]
    print(machine_line())
    print(
        f"backend={config.backend} prompts={args.num_prompts} input_len={args.input_len} "
        f"output_len={args.output_len} max_num_seqs={config.max_num_seqs}"
    )
    rows = [
        ("requests/s", f"{len(outputs) / elapsed:,.1f}"),
        ("output tokens/s", f"{out_tokens / elapsed:,.0f}"),
        ("total tokens/s", f"{(out_tokens + args.input_len * len(outputs)) / elapsed:,.0f}"),
        ("mean latency (s)", f"{statistics.fmean(latencies):.3f}" if latencies else "-"),
        ("p99 latency (s)", f"{_percentile(latencies, 0.99):.3f}" if latencies else "-"),
        ("elapsed (s)", f"{elapsed:.2f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("-" * (width + 16))
    for key, value in rows:
        print(f"{key:<{width}}  {value:>14}")
    print("-" * (width + 16))
    if args.json:
        with open(args.json, "w") as f:
            f.write(msgspec.json.encode(dict(rows) | {"machine": machine_line()}).decode())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine-core", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list installed backends and whether each is usable")
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--sampling-seed", dest="seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    add_engine_config_flags(p)
    p.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("throughput", help="offline throughput with random prompts")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", default=None, help="also write the results to this path")
    add_engine_config_flags(p)
    p.set_defaults(func=cmd_bench_throughput)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, TypeError, LookupError) as exc:
        print(f"engine-core: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
