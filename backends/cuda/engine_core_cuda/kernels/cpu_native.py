"""The C kernels of the CPU path: each family (:mod:`~engine_core_cuda.kernels.cpu_attention`,
:mod:`~engine_core_cuda.kernels.cpu_ops`) is one small C source, compiled once per machine with
the system's C compiler and loaded with ``ctypes``, once per process.

The shared objects live in ``$XDG_CACHE_HOME/engine_core_cuda`` (default ``~/.cache``), named by
a hash of the source, the compiler, the flags and the CPU (``-march=native``), so a changed
source or another CPU builds anew and concurrent builders agree (the file is renamed into place).
Without a C compiler, or when the compile fails, :func:`load` returns None and the family's
torch path runs; it logs why once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

__all__ = ["FLAGS", "cache_dir", "compiler", "load"]

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11"]

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _cpu_key() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags."""
    lines = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    lines.append(line)
                if len(lines) >= 2:
                    break
    except OSError:
        pass
    return platform.machine() + "".join(lines)


def compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc`` or ``gcc`` on the path; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    """Where the shared objects are kept."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = os.path.expanduser("~")
        # No home directory (an unset HOME in a service): the temporary directory.
        base = os.path.join(home, ".cache") if home != "~" else tempfile.gettempdir()
    return Path(base) / "engine_core_cuda"


def _build(
    name: str, source: str, signatures: dict[str, tuple[list[Any], Any]], flags: list[str]
) -> ctypes.CDLL:
    """Compile (unless cached) and load; raises RuntimeError with the compiler's words."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler")
    digest = hashlib.sha256("\0".join([source, cc, *flags, _cpu_key()]).encode()).hexdigest()[:16]
    directory = cache_dir()
    path = directory / f"{name}-{digest}.so"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            c_file = Path(tmp) / f"{name}.c"
            c_file.write_text(source)
            target = Path(tmp) / f"{name}.so"
            done = subprocess.run(
                [cc, *flags, str(c_file), "-o", str(target)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if done.returncode != 0:
                raise RuntimeError(f"compile failed: {done.stderr.strip()[-500:]}")
            os.replace(target, path)  # atomic: concurrent builders agree
    library = ctypes.CDLL(str(path))
    for function_name, (argtypes, restype) in signatures.items():
        function = getattr(library, function_name)
        function.argtypes = argtypes
        function.restype = restype
    return library


def load(
    name: str,
    source: str,
    signatures: dict[str, tuple[list[Any], Any]],
    extra_flags: tuple[str, ...] = (),
) -> ctypes.CDLL | None:
    """The library ``name`` built from ``source`` (with :data:`FLAGS` and ``extra_flags``) with
    its functions' ``(argtypes, restype)`` set, or None (logged once) where it cannot be built.
    Built or loaded once per process."""
    try:
        return _loaded[name]
    except KeyError:
        pass
    with _lock:
        if name not in _loaded:
            try:
                _loaded[name] = _build(name, source, signatures, [*FLAGS, *extra_flags])
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                logger.warning("CPU kernels %r unavailable (%s): the torch path runs", name, exc)
                _loaded[name] = None
        return _loaded[name]
