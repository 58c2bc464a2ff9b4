"""The ``engine-core`` command line.

``engine-core backends`` lists installed backends; ``engine-core generate "PROMPT"`` streams a
completion to stdout; ``engine-core serve`` runs the OpenAI-compatible HTTP server;
``engine-core bench throughput|latency|serve`` run benchmarks (see ``_bench_cli``).
Every :class:`~engine_core.EngineConfig` field is a flag (``--max-num-seqs 64``); a numeric
field that may be None takes ``none`` (``--step-timeout-s none``).
"""

from __future__ import annotations

import argparse
import ast
import errno
import inspect
import itertools
import json
import os
import sys
import textwrap
import typing
from collections.abc import Sequence
from typing import Any

import msgspec

from engine_core._frontend.runtime import run_options
from engine_core.config import COMMAND_LINE_ENV, EngineConfig

__all__ = ["API_KEY_ENV", "add_engine_config_flags", "engine_config_from_args", "main"]

API_KEY_ENV = "ENGINE_CORE_API_KEY"
"""Environment variable holding the server's API key when ``--api-key`` is not given."""


_NONE = object()
"""What ``none`` parses to for an optional numeric flag: the field set to None."""


def _or_none(parse: Any) -> Any:
    def parse_or_none(text: str) -> Any:
        return _NONE if text.lower() == "none" else parse(text)

    parse_or_none.__name__ = parse.__name__  # argparse names it in its errors
    return parse_or_none


def _flag_type(annotation: Any) -> tuple[Any, dict[str, Any]]:
    """argparse ``type`` and extra kwargs for one EngineConfig field annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if len(args) == 1 else annotation
    optional = len(args) == 1 and type(None) in typing.get_args(annotation)
    if typing.get_origin(base) is typing.Literal:
        return str, {"choices": list(typing.get_args(base))}
    if base is bool or annotation is bool:
        return None, {"action": argparse.BooleanOptionalAction}
    if base in (int, float):
        return (_or_none(base), {"help": "or 'none'"}) if optional else (base, {})
    if typing.get_origin(base) is dict or base is dict:
        return json.loads, {"metavar": "JSON"}
    if isinstance(base, type) and issubclass(base, msgspec.Struct):
        return json.loads, {"metavar": "JSON"}  # a dict: EngineConfig converts it
    if typing.get_origin(base) is list:
        return _or_none(_comma_list), {"metavar": "A,B,..."}
    return str, {}


def _comma_list(text: str) -> list[str]:
    """``prefill,decode,decode`` -> ``["prefill", "decode", "decode"]``."""
    return [part.strip() for part in text.split(",")]


def _field_docs() -> dict[str, str]:
    """EngineConfig's field docstrings (the string under each field), read from its source;
    empty where the source is not installed."""
    try:
        source = inspect.getsource(EngineConfig)
    except (OSError, TypeError):
        return {}
    body = ast.parse(textwrap.dedent(source)).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for field, doc in itertools.pairwise(body.body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field.target.id] = " ".join(doc.value.value.replace("``", "").split())
    return docs


def _shown_default(name: str) -> str:
    """A field's default as it would be typed on the command line."""
    value = getattr(EngineConfig(), name)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"--{'' if value else 'no-'}{name.replace('_', '-')}"
    if isinstance(value, str):
        return value
    return msgspec.json.encode(value).decode()


def _field_help(doc: str | None, name: str, extra: dict[str, Any]) -> str:
    parts = [doc or name.replace("_", " "), f"(default: {_shown_default(name)})"]
    if "help" in extra:  # "or 'none'"
        parts.append(f"[{extra.pop('help')}]")
    return " ".join(parts).replace("%", "%%")


def add_engine_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per EngineConfig field (defaults left to EngineConfig), its help
    text the field's docstring."""
    hints = typing.get_type_hints(EngineConfig)
    docs = _field_docs()
    group = parser.add_argument_group("engine configuration")
    for name in EngineConfig.__struct_fields__:
        flag_type, extra = _flag_type(hints[name])
        extra["help"] = _field_help(docs.get(name), name, extra)
        kwargs: dict[str, Any] = {"default": None, "dest": f"cfg_{name}", **extra}
        if flag_type is not None:
            kwargs["type"] = flag_type
            kwargs.setdefault("metavar", name.upper())
        group.add_argument("--" + name.replace("_", "-"), **kwargs)


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig the flags describe (flags not given keep EngineConfig's defaults)."""
    fields: dict[str, Any] = {
        name: None if value is _NONE else value
        for name in EngineConfig.__struct_fields__
        if (value := getattr(args, f"cfg_{name}", None)) is not None
    }
    fields.update(overrides)
    return EngineConfig(**fields)


# -- commands ------------------------------------------------------------------------------------


def cmd_backends(args: argparse.Namespace) -> int:
    from engine_core._plugins import list_backends

    found = list_backends()
    if not found:
        print("no backend installed; pip install engine-core-mock (or engine-core-cuda)")
        return 1
    width = max(len(n) for n in found)
    for info in found.values():
        # "installed": usable with other backend_options, which the detail names.
        state = "usable" if info.usable else "installed" if info.usable_with else "unusable"
        hint = f"  ({info.install_hint})" if state == "unusable" and info.install_hint else ""
        print(f"{info.name:<{width}}  {state:<9}  {info.detail}{hint}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream one completion to stdout as it is generated."""
    import anyio

    from engine_core import AsyncLLM, RequestOutputKind, SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=args.stop or None,
        output_kind=RequestOutputKind.DELTA,
    )
    # One prompt needs no process boundary unless asked for one.
    overrides = {} if args.cfg_multiprocess is not None else {"multiprocess": False}
    config = engine_config_from_args(args, **overrides)

    async def run() -> None:
        async with AsyncLLM.from_config(config) as engine:
            async for output in engine.generate(args.prompt, params):
                sys.stdout.write(output.outputs[0].text)
                sys.stdout.flush()
        sys.stdout.write("\n")

    anyio.run(run, **run_options(args.runtime))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the OpenAI-compatible server until SIGINT or SIGTERM (exit status 0), or until the
    engine dies (exit status ``ENGINE_DEAD_EXIT_CODE``, 3)."""
    import functools
    import logging

    import anyio

    from engine_core.errors import EngineDeadError

    try:
        from engine_core.server import ENGINE_DEAD_EXIT_CODE, ServerSettings, run_server
        from engine_core.server._lora import parse_lora_module
    except ImportError as exc:
        print(
            f"engine-core serve needs the server extra ({exc.name} is missing): "
            "pip install 'engine-core[server]'",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:
        lora_modules = tuple(parse_lora_module(m) for m in args.lora_modules or ())
    except ValueError as exc:
        print(f"engine-core: error: {exc}", file=sys.stderr)
        return 2
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=api_key,
        served_model_names=tuple(args.served_model_name or ()),
        chat_template=args.chat_template,
        max_request_body_bytes=args.max_request_body_bytes,
        keep_alive_timeout_s=args.keep_alive_timeout,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
        shutdown_timeout_s=args.shutdown_timeout,
        disable_any_whitespace=args.disable_any_whitespace,
        access_log=args.access_log,
        log_requests=args.enable_log_requests,
        http_server=args.http_server,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        strict_request_fields=args.strict_request_fields,
        lora_modules=lora_modules,
        enable_lora_runtime_updates=args.enable_lora_runtime_updates,
        **(
            {"max_forced_reasoning_chars": args.max_forced_reasoning_chars}
            if args.max_forced_reasoning_chars is not None
            else {}
        ),
    )
    config = engine_config_from_args(args)
    started = False

    async def run() -> None:
        nonlocal started
        print(f"engine-core: starting the engine (backend {config.backend})...", file=sys.stderr)
        async with anyio.create_task_group() as task_group:
            url = await task_group.start(functools.partial(run_server, config, settings))
            started = True
            print(f"engine-core: serving on {url} (Ctrl+C to stop)", file=sys.stderr, flush=True)

    died: list[BaseException] = []
    failed: list[BaseException] = []
    try:
        anyio.run(run, **run_options(args.runtime))
    except* EngineDeadError as group:
        died.extend(group.exceptions)
    except* _STARTUP_ERRORS as group:
        if started:
            raise
        failed.append(_first(group))
    if failed:
        # A configuration that cannot serve (a bad backend or model, a port in use): the
        # message says it all, as `generate` says it, without the traceback.
        error = failed[0]
        hint = ""
        if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
            hint = " (another process listens there: choose another --port, or --port 0)"
        print(f"engine-core: error: {error}{hint}", file=sys.stderr)
        return 2
    if died:
        print(f"engine-core: the engine died: {died[0]}", file=sys.stderr)
        return ENGINE_DEAD_EXIT_CODE
    return 0


_STARTUP_ERRORS = (ValueError, TypeError, LookupError, OSError)
"""What a configuration that cannot start raises (BackendError is a LookupError)."""


def _first(group: BaseExceptionGroup[Exception]) -> BaseException:
    """The first exception of ``group``, out of the nested groups task groups make."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


_RUNTIME_HELP = "event loop of this process: asyncio or trio (default asyncio)"
_SERVE_EPILOG = """\
stopping and failing:
  SIGTERM or Ctrl+C  the listening socket closes at once: a new connection (a health probe's
                     too) is refused while the responses in flight finish for up to
                     --shutdown-timeout, then end with a 503 error; the process exits 0.
                     Take the server out of a load balancer on the signal, not on /health.
                     A second signal ends the responses at once.
  a hung step        a step whose model call never returns (the process still alive and
                     answering) is cut after --step-timeout-s, 300 s by default: the engine
                     is dead, responses end with 503 engine_dead and the process exits 3
                     for a supervisor to restart it. Lower it where steps are short
                     (--step-timeout-s 30); a frozen process (stopped, deadlocked) is
                     declared dead sooner, after --engine-heartbeat-timeout-s (10 s).
"""


def build_parser() -> argparse.ArgumentParser:
    from engine_core._bench.cli import add_bench_parsers

    parser = argparse.ArgumentParser(prog="engine-core", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list installed backends and whether each is usable")
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("generate", help="stream a completion of one prompt to stdout")
    p.add_argument("prompt", help="the text to complete")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="most tokens to generate (default 64)"
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)"
    )
    p.add_argument(
        "--sampling-seed", dest="seed", type=int, default=None, help="seed of this sampling"
    )
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--runtime", choices=["asyncio", "trio"], default="asyncio", help=_RUNTIME_HELP)
    add_engine_config_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Run the OpenAI-compatible HTTP server over an engine.",
        epilog=_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    p.add_argument("--runtime", choices=["asyncio", "trio"], default="asyncio", help=_RUNTIME_HELP)
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use (default: --model as given, else the backend's name, "
        "e.g. 'mock')",
    )
    p.add_argument("--chat-template", default=None, help="chat template file or text")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help='LoRA adapters to serve, as name=path or JSON {"name": ..., "path": ...}; '
        "a request's model picks one (needs --enable-lora)",
    )
    p.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=16 << 20,
        metavar="N",
        help="answer 413 to a request body larger than this (default 16 MiB)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=65.0,
        metavar="S",
        help="close a connection that waits this long for its next request (default 65: longer "
        "than clients' and load balancers' idle expiry; before its first request the "
        "header timeout applies if shorter)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="close a connection whose request headers take longer than this (default 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="answer 408 to a request whose body takes longer than this (default 30)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="connections held at once; past it the longest-idle one is closed, else 503 "
        "(default: from the open-file limit)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM/Ctrl+C the listener closes at once (new connections are refused); "
        "how long responses in flight may then take to finish (default 30)",
    )
    p.add_argument(
        "--disable-any-whitespace",
        action="store_true",
        help="compact JSON (no whitespace between tokens) for every JSON-constrained request",
    )
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log one line per completion request: its id, prompt and output token counts, "
        "finish reason and latency",
    )
    p.add_argument(
        "--http-server",
        choices=["auto", "uvicorn", "hypercorn"],
        default="auto",
        help="auto: uvicorn under asyncio where installed, else hypercorn (trio: hypercorn)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "mistral", "openai"],
        default=None,
        help="the format the model writes tool calls in, read for tool_choice 'auto'",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="serve tool_choice 'auto' (needs --tool-call-parser)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=["qwen3", "deepseek_r1", "gpt_oss"],
        default=None,
        help="put the model's thinking (<think>...</think>; gpt_oss: its analysis channel) in "
        "reasoning_content",
    )
    p.add_argument(
        "--max-forced-reasoning-chars",
        type=int,
        default=None,
        metavar="N",
        help="with --reasoning-parser, the most characters a forced tool call (tool_choice "
        "'required' or a named function) thinks before the grammar closes the thinking and "
        "the call follows; 0: no thinking first (default 1000, about 250 tokens; at most 2000)",
    )
    p.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="answer 400 to a request body with a field the server does not know (default: "
        "ignore it, with one warning per request naming it)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="least severe log messages shown (default info)",
    )
    add_engine_config_flags(p)
    p.set_defaults(func=cmd_serve)

    add_bench_parsers(sub, add_engine_config_flags, engine_config_from_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Hints in errors show flags, here and in the engine process (which inherits it).
    previous = os.environ.get(COMMAND_LINE_ENV)
    os.environ[COMMAND_LINE_ENV] = "1"
    try:
        return int(args.func(args))
    except (ValueError, TypeError, LookupError) as exc:
        print(f"engine-core: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if previous is None:
            del os.environ[COMMAND_LINE_ENV]
        else:
            os.environ[COMMAND_LINE_ENV] = previous


if __name__ == "__main__":
    sys.exit(main())
