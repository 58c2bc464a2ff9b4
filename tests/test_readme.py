"""The README's examples work as printed: every ```python and ```bash block runs, on the mock,
each in a fresh process with a short timeout.

A block can be marked by an HTML comment on the line just before its fence:

- ``<!-- readme-test: not run: REASON -->``: the block is not run; its test is reported as
  skipped with REASON (so nothing is skipped silently);
- ``<!-- readme-test: server -->``: the block starts the HTTP server that other blocks talk to;
  it runs (on a free port instead of the README's) for as long as this module's tests need it.

Every fence must name its language, and only ``python`` and ``bash`` blocks count as examples;
any other marker, or a marker that is not followed by a fence, fails the test.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
EXAMPLE_LANGUAGES = ("python", "bash")
README_PORT = 8000
_TIMEOUT_S = 100.0
"""Per example: the longest one (``engine-core bench serve`` with 1024 requests) takes seconds;
this bounds a hang on a loaded machine, within pytest-timeout's 120 s."""
_MARKER = re.compile(r"^<!-- readme-test: (.*) -->$")
_NOT_RUN = "not run: "
_SERVER = "server"


@dataclass(frozen=True)
class Block:
    line: int
    """Line number of the opening fence."""
    language: str
    code: str
    marker: str | None

    @property
    def id(self) -> str:
        return f"line{self.line}-{self.language}"


def read_blocks(text: str) -> list[Block]:
    """The fenced blocks of ``text`` with the marker each carries."""
    blocks: list[Block] = []
    lines = text.splitlines()
    index = 0
    pending: tuple[int, str] | None = None  # a marker waiting for its fence
    while index < len(lines):
        line = lines[index]
        if (match := _MARKER.match(line.strip())) is not None:
            pending = (index + 1, match.group(1))
            index += 1
            continue
        if line.startswith("```"):
            language = line[3:].strip()
            end = index + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            if end == len(lines):
                raise AssertionError(f"README.md:{index + 1}: the fence is never closed")
            marker = None
            if pending is not None:
                assert pending[0] == index, f"README.md:{pending[0]}: a marker must precede a fence"
                marker = pending[1]
            pending = None
            blocks.append(Block(index + 1, language, "\n".join(lines[index + 1 : end]), marker))
            index = end + 1
            continue
        if pending is not None and line.strip():
            raise AssertionError(f"README.md:{pending[0]}: a marker must precede a fence")
        index += 1
    return blocks


BLOCKS = read_blocks(README.read_text())
EXAMPLES = [b for b in BLOCKS if b.language in EXAMPLE_LANGUAGES]


def test_every_block_names_its_language_and_markers_are_known() -> None:
    for block in BLOCKS:
        assert block.language, f"README.md:{block.line}: a fence without a language"
        marker = block.marker
        if marker is None:
            continue
        assert block.language in EXAMPLE_LANGUAGES, f"README.md:{block.line}: marks a non-example"
        assert marker == _SERVER or (
            marker.startswith(_NOT_RUN) and marker.removeprefix(_NOT_RUN).strip()
        ), f"README.md:{block.line}: unknown marker {marker!r} (a reason is required)"
    assert sum(b.marker == _SERVER for b in BLOCKS) <= 1
    assert sum(b.marker is None for b in EXAMPLES) >= 5  # most examples do run


def test_the_parser_finds_markers_and_refuses_strays() -> None:
    text = "a\n<!-- readme-test: not run: why -->\n```bash\nx\n```\n```python\ny\n```\n"
    assert read_blocks(text) == [
        Block(3, "bash", "x", "not run: why"),
        Block(6, "python", "y", None),
    ]
    with pytest.raises(AssertionError, match="a marker must precede a fence"):
        read_blocks("<!-- readme-test: server -->\ntext\n```bash\nx\n```\n")
    with pytest.raises(AssertionError, match="never closed"):
        read_blocks("```bash\nx\n")


def _env() -> dict[str, str]:
    """This interpreter's scripts (``engine-core``) first on the PATH."""
    scripts = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": os.pathsep.join([scripts, os.environ.get("PATH", "")])}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _on_port(code: str, port: int) -> str:
    """``code`` talking to the test's server instead of the README's port."""
    return code.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{port}").replace(
        f"--port {README_PORT}", f"--port {port}"
    )


def _command(block: Block) -> list[str]:
    if block.language == "python":
        return [sys.executable, "-c", block.code]
    return ["bash", "-e", "-o", "pipefail", "-c", block.code]


@dataclass(frozen=True)
class Server:
    port: int
    log: list[str]


def _wait_for_serving(process: subprocess.Popen[str], log: list[str]) -> None:
    assert process.stderr is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stderr], [], [], deadline - time.monotonic())
        if not ready:
            break
        line = process.stderr.readline()
        if not line:
            raise AssertionError(f"the README's server exited: {''.join(log)}")
        log.append(line)
        if "serving on " in line:
            return
    raise AssertionError(f"the README's server did not start in 60 s: {''.join(log)}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The README's server block, running on a free port."""
    (block,) = [b for b in BLOCKS if b.marker == _SERVER]
    port = _free_port()
    log: list[str] = []
    process = subprocess.Popen(
        _command(Block(block.line, block.language, _on_port(block.code, port), block.marker)),
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=tmp_path_factory.mktemp("server"),
        start_new_session=True,  # its own process group: the shell and the server stop together
    )
    try:
        _wait_for_serving(process, log)
        yield Server(port, log)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        assert process.stderr is not None
        process.stderr.close()


@pytest.mark.parametrize("block", EXAMPLES, ids=[b.id for b in EXAMPLES])
def test_readme_example(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if block.marker is not None and block.marker.startswith(_NOT_RUN):
        pytest.skip(f"README.md:{block.line}: {block.marker.removeprefix(_NOT_RUN)}")
    if block.marker == _SERVER:
        server: Server = request.getfixturevalue("server")
        assert any(f"127.0.0.1:{server.port}" in line for line in server.log)
        return
    code = block.code
    if f"127.0.0.1:{README_PORT}" in code:
        code = _on_port(code, request.getfixturevalue("server").port)
    done = subprocess.run(
        _command(Block(block.line, block.language, code, block.marker)),
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
        timeout=_TIMEOUT_S,
    )
    assert done.returncode == 0, f"README.md:{block.line}:\n{done.stdout}\n{done.stderr}"
