"""A conformance suite that any backend runs against itself.

::

    from engine_core.testing import check_backend

    def test_conformance() -> None:
        check_backend(MyBackend, EngineConfig(model="/models/tiny"))

Every ``check_*`` function takes a factory ``make_backend(config) -> Backend`` (usually the
backend class) and an optional :class:`~engine_core.EngineConfig`; it builds its own backend,
drives it the way the engine core does (through the real scheduler, so every
:class:`~engine_core.abc.SchedulerOutput` is one the engine could send), closes it, and raises
``AssertionError`` with a message saying what went wrong. :data:`BACKEND_CHECKS` lists them for
parametrized tests; :func:`check_backend` runs them all.

The checks assume nothing about which tokens a model produces, only that greedy decoding is
deterministic: a sequence gets the same next token alone or in a batch, whether its prompt was
chunked, its prefix came from the prefix cache, or it was preempted and resumed.
"""

from __future__ import annotations

from engine_core.testing.conformance import (
    BACKEND_CHECKS,
    BackendFactory,
    check_abort,
    check_async_scheduling,
    check_backend,
    check_close,
    check_decode,
    check_greedy_determinism,
    check_logprobs,
    check_mixed_batch,
    check_preemption,
    check_prefill_chunks,
    check_prefix_caching,
    check_spec_decode,
    check_startup,
)

__all__ = [
    "BACKEND_CHECKS",
    "BackendFactory",
    "check_abort",
    "check_async_scheduling",
    "check_backend",
    "check_close",
    "check_decode",
    "check_greedy_determinism",
    "check_logprobs",
    "check_mixed_batch",
    "check_preemption",
    "check_prefill_chunks",
    "check_prefix_caching",
    "check_spec_decode",
    "check_startup",
]
