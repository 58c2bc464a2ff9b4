"""The event loop a front end runs on (the same rule as the engine-core process's)."""

from engine_core._engine.runtime import NO_UVLOOP_ENV, run_options

__all__ = ["NO_UVLOOP_ENV", "run_options"]
