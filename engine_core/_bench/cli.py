"""``engine-core bench``: offline throughput, offline latency, and load against a running server.

Every result is printed with the machine line and the configuration, as a two-column table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from engine_core._bench.client import percentile
from engine_core.config import EngineConfig

__all__ = ["add_bench_parsers"]

ConfigFromArgs = Callable[[argparse.Namespace], EngineConfig]
OfflineCommand = Callable[[argparse.Namespace, ConfigFromArgs], int]
ArgParser = argparse.ArgumentParser


class Progress:
    """A tqdm bar on stderr, or a plain counter line where tqdm is missing; ``update()`` per
    finished item."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self.total = total
        self.desc = desc
        self.enabled = enabled
        self.count = 0
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                self._bar = None
            else:
                self._bar = tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stderr)

    def update(self, count: int = 1) -> None:
        self.count += count
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(count)
        elif self.count == self.total or self.count % max(1, self.total // 20) == 0:
            print(f"{self.desc}: {self.count}/{self.total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def print_table(title: str, rows: Sequence[tuple[str, str]]) -> None:
    """``title`` then aligned ``key  value`` rows between rules."""
    width = max(len(k) for k, _ in rows)
    rule = "-" * (width + 16)
    print(title)
    print(rule)
    for key, value in rows:
        print(f"{key:<{width}}  {value:>14}")
    print(rule)


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        from engine_core._bench.machine import machine_line

        with open(path, "wb") as f:
            f.write(msgspec.json.encode(data | {"machine": machine_line()}))


def _random_prompts(vocab: int, num: int, length: int, seed: int) -> list[dict[str, list[int]]]:
    """Random token prompts; ids kept to printable bytes for the byte tokenizer's vocabulary."""
    rng = random.Random(seed)
    low, high = (32, 127) if vocab <= 300 else (3, vocab)
    return [
        {"prompt_token_ids": [rng.randrange(low, high) for _ in range(length)]} for _ in range(num)
    ]


# -- bench throughput ----------------------------------------------------------------------------


def cmd_throughput(args: argparse.Namespace, config_from_args: ConfigFromArgs) -> int:
    from engine_core import LLM, SamplingParams
    from engine_core._bench.machine import machine_line

    config = config_from_args(args)
    with LLM.from_config(config) as llm:
        backend = llm.info.backend
        prompts = _random_prompts(llm.vocab_size, args.num_prompts, args.input_len, config.seed)
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
    rows = [
        ("requests/s", f"{len(outputs) / elapsed:,.1f}"),
        ("output tokens/s", f"{out_tokens / elapsed:,.0f}"),
        ("total tokens/s", f"{(out_tokens + args.input_len * len(outputs)) / elapsed:,.0f}"),
        ("mean latency (s)", f"{statistics.fmean(latencies):.3f}" if latencies else "-"),
        ("p99 latency (s)", f"{percentile(latencies, 0.99):.3f}" if latencies else "-"),
        ("elapsed (s)", f"{elapsed:.2f}"),
    ]
    print_table(
        f"backend={backend} prompts={args.num_prompts} input_len={args.input_len} "
        f"output_len={args.output_len} max_num_seqs={config.max_num_seqs}",
        rows,
    )
    print(_in_words(backend, len(outputs), args.input_len, args.output_len, out_tokens, elapsed))
    _write_json(args.json, dict(rows))
    return 0


def _in_words(
    backend: str, num_prompts: int, input_len: int, output_len: int, tokens: int, elapsed: float
) -> str:
    """What a throughput run measured, said plainly."""
    text = (
        f"Generated {tokens:,} tokens ({num_prompts} requests x {output_len} output tokens, "
        f"{input_len}-token prompts) in {elapsed:.2f} s: {tokens / elapsed:,.0f} output tokens "
        "per second."
    )
    if backend == "mock":
        text += (
            " The mock backend does no model compute (its forward pass returns at once), so "
            "this is the engine's own overhead: scheduling, KV-cache bookkeeping, "
            "detokenization and output handling. It is the ceiling the engine allows on this "
            "machine; with a real model each step also waits for the model's forward pass."
        )
    return textwrap.fill(text, 100)


# -- bench latency -------------------------------------------------------------------------------


def cmd_latency(args: argparse.Namespace, config_from_args: ConfigFromArgs) -> int:
    """Time one batch end to end, ``--num-iters`` times after ``--num-iters-warmup``."""
    from engine_core import LLM, SamplingParams
    from engine_core._bench.machine import machine_line

    config = config_from_args(args)
    with LLM.from_config(config) as llm:
        prompts = _random_prompts(llm.vocab_size, args.batch_size, args.input_len, config.seed)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        progress = Progress(
            args.num_iters_warmup + args.num_iters, "iterations", not args.no_progress
        )
        latencies = []
        for i in range(args.num_iters_warmup + args.num_iters):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            if i >= args.num_iters_warmup:
                latencies.append(time.perf_counter() - start)
            progress.update()
        progress.close()
    print(machine_line())
    rows = [
        ("mean latency (s)", f"{statistics.fmean(latencies):.4f}"),
        ("p50 latency (s)", f"{percentile(latencies, 0.50):.4f}"),
        ("p90 latency (s)", f"{percentile(latencies, 0.90):.4f}"),
        ("p99 latency (s)", f"{percentile(latencies, 0.99):.4f}"),
        (
            "output tokens/s",
            f"{args.batch_size * args.output_len / statistics.fmean(latencies):,.0f}",
        ),
    ]
    print_table(
        f"backend={config.backend} batch_size={args.batch_size} input_len={args.input_len} "
        f"output_len={args.output_len} iterations={args.num_iters}",
        rows,
    )
    _write_json(args.json, dict(rows))
    return 0


# -- bench serve ---------------------------------------------------------------------------------


def serve_rows(summary: dict[str, float]) -> list[tuple[str, str]]:
    """The table rows of a :meth:`LoadResult.summary`."""
    rows = [
        ("successful requests", f"{summary['requests'] - summary['failed']:.0f}"),
        ("failed requests", f"{summary['failed']:.0f}"),
        ("elapsed (s)", f"{summary['elapsed_s']:.2f}"),
        ("requests/s", f"{summary['request_per_s']:,.1f}"),
        ("output tokens/s", f"{summary['output_tok_per_s']:,.0f}"),
    ]
    for name in ("ttft", "itl"):
        for q in (50, 90, 99):
            rows.append((f"{name.upper()} p{q} (ms)", f"{summary[f'{name}_p{q}_ms']:.2f}"))
    rows.append(("mean latency (ms)", f"{summary['mean_latency_ms']:.1f}"))
    return rows


def _input_description(args: argparse.Namespace) -> str:
    if args.random_input_len is not None:
        return f"{args.random_input_len} random tokens"
    return "the given prompt" if args.prompt is not None else f"{args.input_len} characters"


def _serve_prompts(args: argparse.Namespace) -> Any:
    """The prompt, or with ``--random-input-len`` one prompt of random tokens per request (ids
    for the completions endpoint, their text for chat)."""
    if args.random_input_len is None:
        return args.prompt if args.prompt is not None else "x" * args.input_len
    from engine_core._bench.client import random_token_prompts
    from engine_core._core.tokenizer import load_tokenizer

    if args.tokenizer is None:
        raise ValueError("--random-input-len needs --tokenizer (the served model's tokenizer)")
    tokenizer = load_tokenizer(args.tokenizer)
    special = tokenizer.all_special_ids
    vocabulary = [t for t in range(tokenizer.vocab_size) if t not in special]
    prompts = random_token_prompts(vocabulary, args.num_requests, args.random_input_len, args.seed)
    if args.endpoint == "chat":
        return [tokenizer.decode(ids) for ids in prompts]
    return prompts


def cmd_serve(args: argparse.Namespace) -> int:
    import functools

    import anyio

    from engine_core._bench.client import run_load
    from engine_core._bench.machine import machine_line

    prompt = _serve_prompts(args)
    progress = Progress(args.num_requests, "requests", not args.no_progress)
    run = functools.partial(
        run_load,
        args.url,
        endpoint=args.endpoint,
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        prompt=prompt,
        max_tokens=args.max_tokens,
        model=args.model,
        api_key=args.api_key,
        on_done=lambda _: progress.update(),
        ignore_eos=args.ignore_eos,
    )
    from engine_core._frontend.runtime import run_options

    result = anyio.run(run, **run_options("asyncio"))  # the load generator is asyncio-only
    progress.close()
    summary = result.summary()
    print(machine_line())
    print_table(
        f"{args.url} endpoint={args.endpoint} requests={args.num_requests} "
        f"concurrency={args.concurrency} max_tokens={args.max_tokens} "
        f"input={_input_description(args)} ignore_eos={args.ignore_eos}",
        serve_rows(summary),
    )
    errors = [r.error for r in result.results if r.error]
    if errors:
        print(f"first error: {errors[0]}", file=sys.stderr)
    _write_json(args.json, summary)
    return 0 if not errors else 1


_LENGTH_HELP = {
    "num_prompts": "prompts of random tokens",
    "batch_size": "prompts of random tokens in the batch",
    "input_len": "tokens per prompt",
    "output_len": "output tokens per prompt (the end-of-sequence token ignored)",
    "num_iters_warmup": "batches run before timing",
    "num_iters": "batches timed",
}


def add_bench_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    add_engine_flags: Callable[[argparse.ArgumentParser], None],
    config_from_args: ConfigFromArgs,
) -> None:
    """Add ``bench throughput|latency|serve`` under the ``bench`` command."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)

    def offline(name: str, help: str, command: OfflineCommand, **lengths: int) -> ArgParser:
        p = bench.add_parser(name, help=help)
        for flag, default in lengths.items():
            p.add_argument(
                f"--{flag.replace('_', '-')}",
                type=int,
                default=default,
                help=f"{_LENGTH_HELP[flag]} (default {default})",
            )
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.add_argument("--json", default=None, help="also write the results to this path")
        add_engine_flags(p)
        p.set_defaults(func=lambda a: command(a, config_from_args))
        return p

    offline(
        "throughput",
        "offline throughput with random prompts",
        cmd_throughput,
        num_prompts=1000,
        input_len=128,
        output_len=128,
    )
    offline(
        "latency",
        "offline latency of one batch, over iterations",
        cmd_latency,
        batch_size=8,
        input_len=32,
        output_len=128,
        num_iters_warmup=2,
        num_iters=10,
    )

    p = bench.add_parser("serve", help="streaming load against a running OpenAI-compatible server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default="chat",
        help="/v1/chat/completions or /v1/completions (default chat)",
    )
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    p.add_argument("--num-requests", type=int, default=256, help="requests in all (default 256)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--input-len", type=int, default=32, help="prompt length in characters")
    p.add_argument("--prompt", default=None, help="the prompt text (overrides --input-len)")
    p.add_argument(
        "--random-input-len",
        type=int,
        default=None,
        metavar="N",
        help="prompts of N random tokens, one per request, as vllm bench serve's random "
        "dataset (needs --tokenizer; the completions endpoint gets them as token ids, exactly "
        "N; chat as their text)",
    )
    p.add_argument(
        "--tokenizer", default=None, help="the served model's tokenizer directory (or 'byte')"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly --max-tokens output tokens, past the end-of-sequence token "
        "(default on; vllm bench serve's --ignore-eos)",
    )
    p.add_argument("--model", default=None, help="model name to ask for")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", default=None, help="also write the results to this path")
    p.set_defaults(func=cmd_serve)
