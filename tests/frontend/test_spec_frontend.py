"""Speculative decoding through the front end: stop strings among accepted tokens, n > 1,
per-request counts in ``RequestOutput.metrics`` and the engine's stats."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.spec_backend import ScriptedSpecBackend

from engine_core import LLM, SamplingParams
from engine_core._engine import core as engine_core_module
from engine_core._plugins import BackendInfo


@pytest.fixture(autouse=True)
def scripted_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """``backend="scripted"`` runs :class:`ScriptedSpecBackend` in process."""

    def resolve(config: Any) -> tuple[BackendInfo, Any]:
        return BackendInfo(config.backend, True, "scripted", "", None), config

    monkeypatch.setattr(engine_core_module, "resolve_config", resolve)
    monkeypatch.setattr(engine_core_module, "load_backend", lambda *_: ScriptedSpecBackend)


# The model copies its prompt: n-gram drafts are right, so whole runs of tokens are accepted.
PROMPT = "one two three four five six seven eight nine ten "


def generate(spec: dict[str, Any] | None, params: SamplingParams) -> list[Any]:
    llm = LLM(
        backend="scripted",
        tokenizer="byte",
        backend_options={"copy": True},
        speculative_config=spec,
    )
    try:
        outputs = llm.generate([PROMPT, PROMPT[4:]], params, use_tqdm=False)
        if spec is not None:
            stats = llm.get_stats()
            assert stats.spec_num_speculative_tokens == 4
            assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
            assert sum(stats.spec_steps_by_k.values()) == stats.num_steps
        return outputs
    finally:
        llm.close()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=60, stop=["seven"]),
        SamplingParams(
            temperature=0, max_tokens=60, stop=["seven"], include_stop_str_in_output=True
        ),
        SamplingParams(temperature=0, max_tokens=37, logprobs=1),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ord("x")], min_tokens=3),
        SamplingParams(temperature=0.8, seed=5, max_tokens=30, n=3),
    ],
    ids=["stop-string", "stop-string-included", "max-tokens-logprobs", "stop-token", "n3"],
)
def test_outputs_with_speculation_are_those_without(params: SamplingParams) -> None:
    spec = {"method": "ngram", "dynamic": False}
    on, off = generate(spec, params), generate(None, params)
    for with_spec, without in zip(on, off, strict=True):
        assert [
            (c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs)
            for c in with_spec.outputs
        ] == [
            (c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs)
            for c in without.outputs
        ]
    if params.stop:
        assert (
            on[0]
            .outputs[0]
            .text.endswith("six " + ("seven" if params.include_stop_str_in_output else ""))
        )


def test_per_request_counts_reach_request_output_metrics() -> None:
    params = SamplingParams(temperature=0, max_tokens=40)
    outputs = generate({"method": "ngram", "dynamic": False}, params)
    metrics = outputs[0].metrics
    assert metrics is not None
    assert 0 < metrics.spec_num_accepted_tokens <= metrics.spec_num_draft_tokens
    assert metrics.spec_num_drafts > 0
    length = metrics.spec_mean_acceptance_length
    assert length is not None and 1.0 < length <= 5.0
    # A verifying step brings its accepted drafts + 1 tokens: all but the first (sampled after
    # the prompt) and the last (no room for drafts) came from such steps here.
    assert metrics.spec_num_accepted_tokens + metrics.spec_num_drafts == 38
    off = generate(None, params)[0].metrics
    assert off is not None and off.spec_mean_acceptance_length is None
