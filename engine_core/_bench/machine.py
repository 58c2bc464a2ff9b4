"""A one-line description of the machine, printed with every benchmark result and written with
its JSON."""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any

__all__ = ["machine_line", "write_results"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """CPU model, core count, OS and Python version."""
    return (
        f"machine: {_cpu_model()}, {os.cpu_count()} cores, {platform.system()} "
        f"{platform.release()}, Python {sys.version.split()[0]}"
    )


def write_results(path: str | None, results: dict[str, Any]) -> None:
    """Write ``results`` with the machine line to ``path`` as JSON (nothing when None)."""
    if path is None:
        return
    with open(path, "w") as f:
        json.dump({"machine": machine_line(), **results}, f, indent=2)
    print("wrote", path)
