"""A clock that tests move by hand, for the front end's ``clock=`` arguments."""

from __future__ import annotations


class Clock:
    """Reads ``now``, which moves only when a test sets it, or by ``step`` at every reading."""

    def __init__(self, now: float = 0.0, *, step: float = 0.0) -> None:
        self.now = now
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def unpaced() -> Clock:
    """A clock a second later at every reading: no CUMULATIVE output is held back (holds are
    nanoseconds per item copied), as tests that read right after a put need."""
    return Clock(step=1.0)
