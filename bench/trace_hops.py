"""Count the hops of one plain request: the changes of source file while reading, in call order,
the project's own calls on its trip from ``AsyncLLM.generate`` to the mock backend and back.

What is counted:

- the request: ``AsyncLLM(backend="mock", tokenizer="byte")``, one ``generate("Hello",
  SamplingParams(temperature=0, max_tokens=N))`` (``--max-tokens``, default 3) with the default
  output kind, consumed to its end; a first request ("Hi") runs before it untraced, so imports
  and first-use caches are not counted;
- the path: the real one of ``AsyncLLM``, with the engine core behind a real ``MPClient``, its
  inbox, the wire's msgpack encoding and typed decoding both ways, real Unix stream pipes and a
  real :class:`~engine_core._engine.proc.EngineCoreProc` (its input, stepping and output tasks:
  the same ``EngineCore.schedule`` / ``launch_step`` / ``complete_step`` calls the engine process
  makes). Only the process boundary is left out: the engine core is served by a task in the
  front end's own event loop (started by a launcher of this script's, which does the engine
  process's ``Hello``/``Startup``/``Ready`` handshake), so the calls of both sides are read in
  the one order they run in. Heartbeats are off (``engine_heartbeat_timeout_s=inf``): a timer
  has no place in a request's trip;
- the calls: every Python-level call (``sys.setprofile``'s ``"call"`` events; a coroutine or
  generator resumed fires one too) into a file of ``engine_core/`` or
  ``backends/mock/engine_core_mock/``, from the first step of the traced ``generate`` to its
  end. Calls into the standard library, third-party code (anyio, msgspec) and this script are
  not recorded, but the project code they call is (msgspec decoding a ``SamplingParams`` runs
  its ``__post_init__``). A comprehension or generator expression is code of the function it
  is written in, not a call (what it calls is called from that function), on every Python;
- the hops: consecutive calls in the same file collapse into one visit; the hops are the
  changes of file between visits (visits - 1).

Three more figures read the same calls: the hops when each function counts at its first call
only (a reader who reads a function once); the hops of the calls a reader follows into another
function's body: calls (not resumptions) of functions that call further project functions
there, leaves such as properties and one-line helpers read where they are called; and the
distinct (caller's file, called file) pairs among calls from one project file into another
(the edges of the trip's file graph). The engine's tasks and the front end's share the one
event loop here, so their waits (a receive that finds nothing yet) interleave with the trip.

It prints the figures, the sequence of files visited and the files visited more than once
(``--json``: one JSON object). Run it from the repository root:
``python bench/trace_hops.py [--max-tokens N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple

import anyio
import anyio.abc
import engine_core_mock
import msgspec

import engine_core
from engine_core import AsyncLLM, SamplingParams
from engine_core._engine.core import EngineCore
from engine_core._engine.mp.launcher import ClientSockets
from engine_core._engine.pipes.pipes import Pipes
from engine_core._engine.proc import EngineCoreProc
from engine_core._engine.wire import EngineDead, Hello, Ready, startup_decoder

ROOTS = {
    os.path.dirname(os.path.abspath(engine_core.__file__)): "engine_core",
    os.path.dirname(os.path.abspath(engine_core_mock.__file__)): "backends/mock/engine_core_mock",
}
"""The project's files (absolute directory -> the name shown)."""

COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})
"""The names of the code objects of comprehensions and generator expressions. They are read as
code of the function they are written in: no call of their own, and what they call is called
from that function (Python 3.12 runs comprehensions inline, PEP 709, where 3.11 gives each a
frame; the figures do not depend on which one runs them)."""


def _shown(filename: str) -> str | None:
    """The file's name relative to the repository, or None for a file not the project's."""
    path = os.path.abspath(filename)
    for root, name in ROOTS.items():
        if path.startswith(root + os.sep):
            return name + path[len(root) :]
    return None


class Call(NamedTuple):
    """One project call: the file and function called, and the project file it was called
    from (None: resumed or called by the event loop, no project frame below it); the index of
    the project call it was made from (None: no project frame below it), and whether it is a
    coroutine or generator resumed rather than called."""

    file: str
    function: str
    caller: str | None
    parent: int | None = None
    resumed: bool = False


class _Tracer:
    """Records each project call made on this thread while on."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._before: Any = None
        self._names: dict[str, str | None] = {}
        self._frames: dict[FrameType, int] = {}
        """Each project frame seen -> the index of its first call (held: no id is reused)."""

    def _name(self, filename: str) -> str | None:
        try:
            return self._names[filename]
        except KeyError:
            name = self._names[filename] = _shown(filename)
            return name

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_name in COMPREHENSIONS:
            return
        name = self._name(code.co_filename)
        if name is None:
            return
        caller = None
        below = frame.f_back
        while below is not None and below.f_code.co_name in COMPREHENSIONS:
            below = below.f_back  # its calls are those of the function it is written in
        while below is not None:
            caller = self._name(below.f_code.co_filename)
            if caller is not None:
                break
            below = below.f_back
        parent = None if below is None else self._frames.get(below)
        resumed = frame in self._frames
        if not resumed:
            self._frames[frame] = len(self.calls)
        function = f"{code.co_qualname}:{code.co_firstlineno}"
        self.calls.append(Call(name, function, caller, parent, resumed))

    def on(self) -> None:
        self._before = sys.getprofile()
        sys.setprofile(self._profile)

    def off(self) -> None:
        sys.setprofile(self._before)


class _TaskEngine:
    """The handle of an engine core served by a task of this event loop (see the docstring)."""

    pid = None

    def __init__(self) -> None:
        self.done = threading.Event()

    def kill(self) -> None:
        pass

    def stop(self) -> None:
        self.done.wait(5.0)

    async def stop_async(self) -> None:
        with anyio.move_on_after(5.0):
            while not self.done.is_set():
                await anyio.sleep(0.001)

    def wait_watch(self, timeout: float | None = None) -> None:
        self.done.wait(timeout)

    async def wait_watch_async(self, timeout: float | None = None) -> None:
        await self.stop_async()

    def close(self) -> None:
        pass


class _TaskLauncher:
    """Launches the engine core as a task of ``task_group`` instead of a process: the task does
    what the engine process does (``main._Server``: Hello, Startup, build, Ready, serve)."""

    def __init__(self, task_group: anyio.abc.TaskGroup) -> None:
        self._task_group = task_group
        self._sockets: ClientSockets | None = None

    def open_sockets(self) -> ClientSockets:
        self._sockets = ClientSockets("ipc", "127.0.0.1")
        return self._sockets

    def start(
        self, on_exit: Callable[[int], None], look: Callable[[], float | None]
    ) -> _TaskEngine:
        assert self._sockets is not None
        handle = _TaskEngine()
        self._task_group.start_soon(self._serve, self._sockets, handle, on_exit)
        return handle

    @staticmethod
    async def _serve(
        sockets: ClientSockets, handle: _TaskEngine, on_exit: Callable[[int], None]
    ) -> None:
        encoder = msgspec.msgpack.Encoder()
        pipes = Pipes()
        try:
            output = pipes.sender(sockets.output_endpoint)
            input_ = pipes.receiver(sockets.addresses.input)
            output.send_nowait(encoder.encode(Hello(input_.endpoint)))
            config = startup_decoder().decode(await input_.recv()).config
            core = EngineCore(config)
            output.send_nowait(encoder.encode(Ready(core.info, input_.endpoint)))
            proc = EngineCoreProc(core, input_, output)
            await proc.run()
            core.close()
            output.send_nowait(encoder.encode(EngineDead(reason="shut down")))
        finally:
            pipes.close()
            handle.done.set()
            on_exit(0)


async def trace(max_tokens: int) -> tuple[list[Call], str]:
    """The project calls made by one plain request, in call order, and its text."""
    from engine_core._engine.mp.client import MPClient

    tracer = _Tracer()
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    text = ""
    async with anyio.create_task_group() as task_group:
        launcher = _TaskLauncher(task_group)
        engine = AsyncLLM(
            backend="mock",
            tokenizer="byte",
            engine_heartbeat_timeout_s=math.inf,
        )
        start_async = MPClient.start_async

        async def start_in_task(config: Any, **kwargs: Any) -> MPClient:
            return await start_async(config, launcher=launcher)

        MPClient.start_async = start_in_task  # type: ignore[method-assign]
        try:
            async with engine:
                # A first request warms every path up (imports, caches, the first step).
                async for _ in engine.generate("Hi", params):
                    pass
                stream = engine.generate("Hello", params, request_id="traced")
                tracer.on()
                try:
                    async for out in stream:
                        text = out.outputs[0].text
                finally:
                    tracer.off()
        finally:
            MPClient.start_async = start_async  # type: ignore[method-assign]
    return tracer.calls, text


def visits(files: list[str]) -> list[str]:
    """``files`` with consecutive repeats collapsed."""
    out: list[str] = []
    for name in files:
        if not out or out[-1] != name:
            out.append(name)
    return out


def first_calls(calls: list[Call]) -> list[str]:
    """The files of ``calls``, each function kept at its first call only."""
    seen: set[tuple[str, str]] = set()
    files = []
    for call in calls:
        if (call.file, call.function) not in seen:
            seen.add((call.file, call.function))
            files.append(call.file)
    return files


def reader_calls(calls: list[Call]) -> list[str]:
    """The files of the calls a reader follows: calls, not resumptions, of a function that calls
    further project functions there (leaves, such as properties and small helpers, are read
    where they are called)."""
    parents = {c.parent for c in calls if c.parent is not None}
    return [c.file for i, c in enumerate(calls) if i in parents and not c.resumed]


def file_edges(calls: list[Call]) -> set[tuple[str, str]]:
    """The distinct (caller's file, called file) pairs of the calls from one project file
    into another."""
    return {(c.caller, c.file) for c in calls if c.caller is not None and c.caller != c.file}


def count(calls: list[Call]) -> dict[str, Any]:
    """The figures printed (see the module docstring)."""
    seq = visits([call.file for call in calls])
    tour = visits(first_calls(calls))
    counts = Counter(seq)
    return {
        "hops": len(seq) - 1,
        "files": len(counts),
        "calls": len(calls),
        "sequence": seq,
        "revisited": {name: n for name, n in counts.most_common() if n > 1},
        "first_call_hops": len(tour) - 1,
        "reader_hops": max(0, len(visits(reader_calls(calls))) - 1),
        "file_edges": len(file_edges(calls)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    calls, text = anyio.run(trace, args.max_tokens)
    figures = count(calls)
    if args.json:
        print(json.dumps(figures | {"text": text}))
        return
    seq, revisited = figures["sequence"], figures["revisited"]
    print(f"request: {args.max_tokens} greedy tokens on the mock backend, text {text!r}")
    print(
        f"hops: {figures['hops']} ({len(seq)} visits to {figures['files']} files, "
        f"{figures['calls']} calls)"
    )
    print(f"hops, each function at its first call only: {figures['first_call_hops']}")
    print(
        f"hops of the calls a reader follows (no leaves, no resumptions): {figures['reader_hops']}"
    )
    print(f"distinct file-to-file call edges: {figures['file_edges']}")
    print("sequence:")
    for i, name in enumerate(seq):
        print(f"  {i:3d} {name}")
    print(f"revisited ({sum(n - 1 for n in revisited.values())} returns to a file already open):")
    for name, n in revisited.items():
        print(f"  {n}x {name}")


if __name__ == "__main__":
    main()
