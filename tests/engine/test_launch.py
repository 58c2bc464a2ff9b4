"""The engine-core process is a fresh interpreter: whatever way the caller's program was started
(a script without a ``__main__`` guard, standard input, ``python -c``, an interactive session),
starting the engine never imports the caller's ``__main__`` and works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Both front ends that start an engine process, at module level and without a guard. The
# counter shows whether this code ran more than once (spawn re-imported the main module).
_PROGRAM = """\
import anyio
from engine_core import LLM, AsyncLLM, SamplingParams
import builtins
builtins.runs = getattr(builtins, "runs", 0) + 1
params = SamplingParams(temperature=0, max_tokens=5)
llm = LLM(backend="mock", tokenizer="byte", multiprocess=True)
print("LLM", llm.generate("abc", params, use_tqdm=False)[0].outputs[0].text)
llm.close()

async def stream():
    async with AsyncLLM(backend="mock", tokenizer="byte") as engine:
        async for out in engine.generate("abc", params, request_id="r"):
            pass
        print("AsyncLLM", out.outputs[0].text)

anyio.run(stream)
print("runs", builtins.runs)
"""
_EXPECTED = ["LLM defgh", "AsyncLLM defgh", "runs 1"]
_TIMEOUT_S = 60


def _run(
    args: list[str], cwd: Path, stdin: str | None = None, env: dict[str, str] | None = None
) -> list[str]:
    """The lines ``python ARGS`` prints (prompts of the REPL removed); ``env``: the whole
    environment (None: this one)."""
    done = subprocess.run(
        [sys.executable, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    return [line.removeprefix(">>> ").removeprefix("... ") for line in done.stdout.splitlines()]


def test_script_without_main_guard(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(_PROGRAM)
    assert _run([str(script)], tmp_path) == _EXPECTED


def test_script_on_standard_input(tmp_path: Path) -> None:
    assert _run(["-"], tmp_path, stdin=_PROGRAM) == _EXPECTED


def test_python_dash_c(tmp_path: Path) -> None:
    assert _run(["-c", _PROGRAM], tmp_path) == _EXPECTED


def test_interactive_session(tmp_path: Path) -> None:
    # The REPL reads standard input line by line; a blank line ends the compound statement.
    lines = [line for line in _PROGRAM.splitlines() if line.strip()]
    session = "\n".join(lines).replace("\nanyio.run", "\n\nanyio.run") + "\n"
    out = _run(["-i", "-q"], tmp_path, stdin=session)
    assert [line for line in out if line] == _EXPECTED


def test_the_working_directory_does_not_shadow_the_engines_imports(tmp_path: Path) -> None:
    # The working directory holds a module named like one the engine imports: a script run
    # from elsewhere does not import it, and neither does the engine process.
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "zmq.py").write_text("raise ImportError('the local zmq.py')\n")
    (tmp_path / "script.py").write_text(_PROGRAM)
    assert _run([str(tmp_path / "script.py")], tmp_path / "cwd") == _EXPECTED


def test_the_engine_sees_the_callers_sys_path(tmp_path: Path) -> None:
    # A path added at run time (as a notebook or a test runner does) reaches the engine: the
    # caller's engine_core is imported from a copy outside PYTHONPATH.
    program = f"import sys\nsys.path.insert(0, {str(Path(__file__).parents[2])!r})\n" + _PROGRAM
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    mock = str(Path(__file__).parents[2] / "backends" / "mock")
    program = program.replace("import anyio\n", f"sys.path.insert(0, {mock!r})\nimport anyio\n", 1)
    assert _run(["-c", program], tmp_path, env=env) == _EXPECTED


def test_entry_point_refuses_a_bad_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "engine_core._engine", "ipc://x"],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("usage: python -m engine_core._engine ")


def test_an_engine_left_open_ends_with_the_interpreter(tmp_path: Path) -> None:
    # Never closed: at exit the client shuts its engine down and removes its sockets, and the
    # engine has no parent death to report.
    program = (
        "from engine_core import LLM\n"
        "llm = LLM(backend='mock', tokenizer='byte', multiprocess=True)\n"
        "print(llm._client.pid, llm._client._sockets.addresses.directory, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    pid, directory = done.stdout.split()
    assert not os.path.exists(directory)
    assert "parent process is gone" not in done.stderr
    # The engine was reaped by its parent before it exited.
    assert not os.path.exists(f"/proc/{pid}") or _not_the_engine(int(pid))


def _not_the_engine(pid: int) -> bool:
    """Whether ``pid`` now names another process (its number reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"engine_core._engine" not in f.read()
    except FileNotFoundError:
        return True


def test_engine_starts_and_stops_with_descriptors_past_1024(tmp_path: Path) -> None:
    # A server holding many connections: the process watch's descriptor is past select()'s
    # limit.
    program = (
        "import os, resource\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]\n"
        "from engine_core import LLM, SamplingParams\n"
        "llm = LLM(backend='mock', tokenizer='byte', multiprocess=True)\n"
        "params = SamplingParams(temperature=0, max_tokens=5)\n"
        "print(llm.generate('abc', params, use_tqdm=False)[0].outputs[0].text)\n"
        "llm.close()\n"
    )
    assert _run(["-c", program], tmp_path) == ["defgh"]
