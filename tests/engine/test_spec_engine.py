"""Speculative decoding at the engine's edges: which backends may speculate, and how."""

from __future__ import annotations

import pytest
from engine_core_mock import MockBackend

from engine_core._engine.core import EngineCore
from engine_core.abc import CachedRequestData, SpecSupport
from engine_core.config import EngineConfig, SpeculativeConfig


def _verifier(support: SpecSupport) -> type[MockBackend]:
    class Verifier(MockBackend):
        def spec_support(self) -> SpecSupport | None:
            return support

    return Verifier


def _config(**spec: object) -> EngineConfig:
    latency = {"latency": {"step_s": 0.001}}  # the mock would schedule asynchronously
    return EngineConfig(
        backend="mock",
        tokenizer="byte",
        backend_options=latency,
        speculative_config=SpeculativeConfig(**spec),  # type: ignore[arg-type]
    )


def test_a_backend_that_cannot_verify_is_refused_by_name() -> None:
    class NoSpec(MockBackend):
        def spec_support(self) -> SpecSupport | None:
            return None

    with pytest.raises(ValueError, match=r"the 'mock' backend \(NoSpec\) cannot verify drafts"):
        EngineCore(_config(), backend_cls=NoSpec)


def test_speculation_schedules_synchronously() -> None:
    core = EngineCore(_config(), backend_cls=_verifier(SpecSupport()))
    try:
        assert core.spec_support == SpecSupport()
        assert not core.async_scheduling and core.config.async_scheduling is False
    finally:
        core.close()


def test_a_method_the_backend_does_not_propose_is_refused() -> None:
    with pytest.raises(ValueError, match="'draft_model' is not offered .* it offers: ngram, mock"):
        EngineCore(
            _config(method="draft_model", model="/models/d"),
            backend_cls=_verifier(SpecSupport(proposers=["mock"])),
        )
    core = EngineCore(
        _config(method="mock"), backend_cls=_verifier(SpecSupport(proposers=["mock"]))
    )
    core.close()


def test_more_drafts_than_the_backend_verifies_are_refused() -> None:
    with pytest.raises(ValueError, match=r"num_speculative_tokens \(5\) exceeds .* \(4\)"):
        EngineCore(
            _config(num_speculative_tokens=5),
            backend_cls=_verifier(SpecSupport(max_num_draft_tokens=4)),
        )


def test_lookahead_is_proportional_to_the_drafts_asked_for() -> None:
    assert SpecSupport().lookahead_tokens(4) == 0
    assert SpecSupport(lookahead_per_draft=1).lookahead_tokens(4) == 4
    assert SpecSupport(lookahead_per_draft=1).lookahead_tokens(0) == 0


def test_cached_request_data_drafts_column() -> None:
    class State:
        def __init__(self, computed: int) -> None:
            self.num_computed_tokens = computed

    states = {"a": State(5), "b": State(7)}
    plain = CachedRequestData(["a", "b"], [None, None], [5, 7], [1, 1])
    assert plain.drafts_of(0) == plain.drafts_of(1) == []
    drafted = CachedRequestData(["a", "b"], [None, [3]], [5, 7], [3, 1], [[10, 11], []])
    assert drafted.drafts_of(0) == [10, 11] and drafted.drafts_of(1) == []
    assert [num for *_, num in drafted.diffs(states)] == [3, 1]
    ragged = CachedRequestData(["a", "b"], [None, None], [5, 7], [3, 1], [[10, 11]])
    with pytest.raises(RuntimeError, match="spec_token_ids has a different length"):
        list(ragged.diffs(states))
