"""The public import paths (``engine_core``, ``engine_core.abc``, ``engine_core.testing``,
``engine_core.spec``) keep working across the modules' moves: a moved name stays importable from
where users import it, as the same object."""

from __future__ import annotations

import engine_core
import engine_core.abc
import engine_core.ngram
import engine_core.spec
import engine_core.testing
import engine_core.testing.conformance
import engine_core.testing.lora
import engine_core.testing.tp


def test_spec_is_an_alias_of_ngram() -> None:
    assert engine_core.spec.NgramProposer is engine_core.ngram.NgramProposer
    assert engine_core.spec.NgramIndex is engine_core.ngram.NgramIndex
    assert engine_core.spec.__all__ == engine_core.ngram.__all__


def test_testing_exports_every_check_of_the_conformance_suite() -> None:
    conformance = engine_core.testing.conformance
    assert engine_core.testing.__all__ == [
        *conformance.__all__,
        "check_kv_connector_scheduler",
        "check_kv_connector_worker",
        "check_lora",
        "check_worker_death",
    ]
    assert engine_core.testing.check_lora is engine_core.testing.lora.check_lora
    for name in conformance.__all__:
        assert getattr(engine_core.testing, name) is getattr(conformance, name), name
    assert engine_core.testing.check_worker_death is engine_core.testing.tp.check_worker_death
    connector_checks = engine_core.testing.kv_connector
    for name in connector_checks.__all__:
        assert getattr(engine_core.testing, name) is getattr(connector_checks, name), name
    assert {c.__name__ for c in engine_core.testing.BACKEND_CHECKS} <= set(conformance.__all__)


def test_package_and_abc_surfaces_import() -> None:
    for module in (engine_core, engine_core.abc):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert missing == [], module.__name__
