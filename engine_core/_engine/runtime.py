"""The event loop a front end or the engine-core process runs on: asyncio (on uvloop where
installed) or trio."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["NO_UVLOOP_ENV", "run_options"]

NO_UVLOOP_ENV = "ENGINE_CORE_NO_UVLOOP"
"""Set (non-empty) to run asyncio on its own event loop even where uvloop is installed."""


def run_options(runtime: str) -> dict[str, Any]:
    """``anyio.run`` keyword arguments for ``runtime``: asyncio runs on uvloop where it is
    installed (the ``server`` extra brings it on Linux and macOS) unless
    ``ENGINE_CORE_NO_UVLOOP`` is set."""
    if runtime == "asyncio" and not os.environ.get(NO_UVLOOP_ENV):
        try:
            import uvloop  # noqa: F401
        except ImportError:
            pass
        else:
            return {"backend": "asyncio", "backend_options": {"use_uvloop": True}}
    return {"backend": runtime}
