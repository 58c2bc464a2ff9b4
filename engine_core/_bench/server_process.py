"""``engine-core serve`` in a subprocess, for the benchmark scripts and the tests that need the
real process (its signals, its exit status)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["server_process"]


@contextlib.contextmanager
def server_process(
    flags: Sequence[str],
    *,
    start_timeout_s: float = 120.0,
    stop_grace_s: float | None = 30.0,
    env: Mapping[str, str] | None = None,
    preexec_fn: Callable[[], Any] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``engine-core serve`` with ``flags`` (this Python's ``-m engine_core``, its stderr piped);
    yields the URL of its ``serving on`` line, and the process. Raises RuntimeError when the
    server exits first or reports no URL within ``start_timeout_s``.

    After the block a server still running gets SIGTERM and ``stop_grace_s`` to exit, then
    SIGKILL (at once with ``stop_grace_s=None``); its stderr is closed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "engine_core", "serve", *flags],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=preexec_fn,
    )
    assert process.stderr is not None
    try:
        yield _served_url(process, start_timeout_s), process
    finally:
        if process.poll() is None and stop_grace_s is not None:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=stop_grace_s)
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        process.stderr.close()


def _served_url(process: subprocess.Popen[str], timeout_s: float) -> str:
    """The URL of the server's ``serving on URL`` line; the lines before it are dropped, the
    ones after it left to read."""
    assert process.stderr is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            raise RuntimeError(f"the server exited with status {process.wait()}")
        if "serving on " in line:
            return line.split("serving on ", 1)[1].split()[0]
    raise RuntimeError(f"the server did not start within {timeout_s:g} s")
