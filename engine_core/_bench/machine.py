"""A one-line description of the machine, printed with every benchmark result."""

from __future__ import annotations

import os
import platform
import sys

__all__ = ["machine_line"]


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
