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

A backend that serves LoRA adapters also runs :func:`check_lora` with adapters of its own.

A backend with tensor parallelism also runs :func:`check_worker_death` (async: the engine in
its own process, a worker killed while a request decodes), at the engine's level.
"""

from __future__ import annotations

from engine_core.testing import conformance as _conformance
from engine_core.testing.conformance import BACKEND_CHECKS as BACKEND_CHECKS
from engine_core.testing.conformance import BackendFactory as BackendFactory
from engine_core.testing.conformance import check_abort as check_abort
from engine_core.testing.conformance import check_async_scheduling as check_async_scheduling
from engine_core.testing.conformance import check_backend as check_backend
from engine_core.testing.conformance import check_close as check_close
from engine_core.testing.conformance import check_decode as check_decode
from engine_core.testing.conformance import check_greedy_determinism as check_greedy_determinism
from engine_core.testing.conformance import check_kv_groups as check_kv_groups
from engine_core.testing.conformance import check_logprobs as check_logprobs
from engine_core.testing.conformance import check_mixed_batch as check_mixed_batch
from engine_core.testing.conformance import check_preemption as check_preemption
from engine_core.testing.conformance import check_prefill_chunks as check_prefill_chunks
from engine_core.testing.conformance import check_prefix_caching as check_prefix_caching
from engine_core.testing.conformance import check_spec_decode as check_spec_decode
from engine_core.testing.conformance import check_startup as check_startup
from engine_core.testing.kv_connector import (
    check_kv_connector_scheduler as check_kv_connector_scheduler,
)
from engine_core.testing.kv_connector import check_kv_connector_worker as check_kv_connector_worker
from engine_core.testing.lora import check_lora as check_lora
from engine_core.testing.tp import check_worker_death as check_worker_death

__all__ = [
    "check_lora",
    *_conformance.__all__,
    "check_kv_connector_scheduler",
    "check_kv_connector_worker",
    "check_worker_death",
]
