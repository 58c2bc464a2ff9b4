"""Speculative decoding against decoding without it, on the mock: token-identical outputs.

The same requests run through an ``EngineCore`` with speculation off and on, over chunked
prefill, forced preemption, priority scheduling, prefix caching on and off, greedy, seeded and
unseeded sampling, ``min_tokens`` with stop ids, EOS, ``max_tokens``, logprobs and prompt
logprobs, and aborts that land while a step runs; with the mock's drafter (always right, never
right, right with p = 0.7) and the core's n-gram proposer, static and dynamic. Every token and
logprob must match, and no KV block may stay allocated. Through ``LLM``: stop strings, n > 1
and structured outputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from helpers.differential import ENGINE, prompts, sampling_params, summary
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core import LLM, SamplingParams
from engine_core._core.engine_io import EngineCoreRequest
from engine_core._engine.core import EngineCore
from engine_core.config import EngineConfig, SpeculativeConfig

EOS = 257
LATENCY = {"latency": {"step_s": 1e-4, "per_token_s": 1e-6}}
"""A step cost the mock reports to the dynamic policy (which otherwise fits one to measured
step times, and so would decide differently from run to run)."""
_BASE: dict[str, Any] = {
    "backend": "mock",
    "tokenizer": "byte",
    "block_size": 8,
    "max_model_len": 256,
    "max_num_seqs": 8,
}
ENGINES: dict[str, dict[str, Any]] = {
    "chunked": {"max_num_batched_tokens": 24},
    "preempted": {"num_kv_blocks": 16, "max_model_len": 128, "max_num_batched_tokens": 64},
    "priority": {"scheduling_policy": "priority", "num_kv_blocks": 20, "max_model_len": 160},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "roomy": {},
}
DRAFTERS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (speculative_config fields, backend_options)
    "mock p=0.7 k=3": (
        {"method": "mock", "num_speculative_tokens": 3, "dynamic": False},
        {"spec": {"acceptance_rate": 0.7}},
    ),
    "mock p=1 dynamic": ({"method": "mock"}, {"spec": {"acceptance_rate": 1.0}}),
    "mock p=0 k=2": (
        {"method": "mock", "num_speculative_tokens": 2, "dynamic": False},
        {"spec": {"acceptance_rate": 0.0}},
    ),
    "ngram k=4": (
        {"method": "ngram", "num_speculative_tokens": 4, "dynamic": False},
        {"copy_prompt": {"fraction": 0.5, "period": 16}},
    ),
    "ngram dynamic": ({"method": "ngram"}, {"copy_prompt": {"fraction": 0.5, "period": 16}}),
}


def _requests() -> list[tuple[int, EngineCoreRequest]]:
    """(the step it arrives before, the request): a mix of what sampling can ask for."""
    shared = list(range(40, 90))  # a long prompt prefix (chunked, cached, shared)
    run = list(range(1, 31))  # an ascending run: greedy outputs continue it, n-grams find it

    def req(rid: str, prompt: list[int], priority: int = 0, **params: Any) -> EngineCoreRequest:
        eos = params.pop("eos", ())
        return EngineCoreRequest(
            rid,
            prompt,
            SamplingParams(**{"temperature": 0.0, "max_tokens": 40, **params}),
            eos_token_ids=list(eos),
            priority=priority,
        )

    return [
        (0, req("greedy", run + [5, 6], priority=1)),
        (0, req("seeded", shared + [7], temperature=0.8, seed=3, max_tokens=30)),
        (0, req("unseeded", [9, 9, 9], temperature=1.0, max_tokens=25, priority=2)),
        (0, req("min-tokens", run + [50], min_tokens=10, stop_token_ids=[55, 65])),
        (1, req("eos", [238, 239, 240], eos=[EOS], max_tokens=60, priority=-1)),
        (1, req("logprobs", shared + [1, 2], temperature=0.7, seed=1, logprobs=2)),
        (2, req("prompt-logprobs", shared, prompt_logprobs=1, logprobs=0, max_tokens=12)),
        (3, req("shares-prefix", shared + [200, 201], max_tokens=50, priority=3)),
        (4, req("aborted", run + [100], max_tokens=60)),
        (5, req("short", [3], max_tokens=1)),
        (6, req("penalized", run, temperature=0.9, seed=8, presence_penalty=1.0)),
    ]


ABORT_AFTER = {"aborted": 9}
"""Abort these requests while the step after their N-th token runs."""


@dataclass
class Result:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Any]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Any]] = field(default_factory=dict)
    finished: dict[str, tuple[str | None, Any]] = field(default_factory=dict)
    num_preemptions: int = 0
    prefix_cache_hits: int = 0
    multi_token_steps: int = 0
    """Request-steps that returned more than one token (drafts accepted)."""


def drive(config: EngineConfig) -> Result:
    core = EngineCore(config)
    result = Result()
    arrivals = _requests()
    step = 0
    try:
        while arrivals or core.has_unfinished_requests():
            while arrivals and arrivals[0][0] <= step:
                core.add_request(arrivals.pop(0)[1])
            step += 1
            assert step < 2000, "runaway"
            done = core.launch_step(core.schedule())
            if done is not None:
                for rid, after in ABORT_AFTER.items():
                    if len(result.tokens.get(rid, ())) >= after and rid not in result.finished:
                        core.defer_abort(rid)  # lands before the step's outputs are applied
            outputs = core.complete_step(done)
            for rid, new in zip(outputs.req_ids, outputs.new_token_ids, strict=True):
                result.tokens.setdefault(rid, []).extend(new)
                result.multi_token_steps += len(new) > 1
            for rid, entries in outputs.logprobs.items():
                result.logprobs.setdefault(rid, []).extend(entries)
            for rid, entries in outputs.prompt_logprobs.items():
                result.prompt_logprobs.setdefault(rid, []).extend(entries)
            for f in outputs.finished:
                result.finished[f.req_id] = (f.finish_reason, f.stop_reason)
        stats = core.get_stats()
        result.num_preemptions = stats.num_preemptions
        result.prefix_cache_hits = stats.prefix_cache_hits
        kv = core.scheduler.kv
        assert kv.num_free_blocks == core.num_kv_blocks, "KV blocks leaked"
        assert not core.scheduler.requests
    finally:
        core.close()
    return result


def _config(engine: str, spec: dict[str, Any] | None, options: dict[str, Any]) -> EngineConfig:
    return EngineConfig(
        **{**_BASE, **ENGINES[engine]},
        backend_options={**options, **LATENCY},
        async_scheduling=False,
        speculative_config=None if spec is None else SpeculativeConfig(**spec),
    )


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, str], Result]:
    """Speculation off, per engine and backend options (computed on first use)."""
    return {}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_outputs_are_token_identical(
    engine: str, drafter: str, references: dict[tuple[str, str], Result]
) -> None:
    spec, options = DRAFTERS[drafter]
    key = (engine, repr(options))
    if key not in references:
        references[key] = drive(_config(engine, None, options))
    expected = references[key]
    got = drive(_config(engine, spec, options))
    aborted = set(ABORT_AFTER)
    for rid, tokens in expected.tokens.items():
        if rid in aborted:
            continue
        assert got.tokens[rid] == tokens, rid
    assert {r: t for r, t in got.logprobs.items() if r not in aborted} == {
        r: t for r, t in expected.logprobs.items() if r not in aborted
    }
    assert got.prompt_logprobs == expected.prompt_logprobs
    assert got.finished == expected.finished
    if "copy_prompt" not in options:  # the rules these requests were written for
        assert expected.finished["min-tokens"] == ("stop", 65)
        assert expected.finished["eos"] == ("stop", None)
    for rid in aborted:
        # Aborted mid-step after the same token count (an abort the engine was asked for is
        # not reported back): both cut the same sequence.
        assert rid not in expected.finished and rid not in got.finished
        shorter = min(len(got.tokens[rid]), len(expected.tokens[rid]))
        assert got.tokens[rid][:shorter] == expected.tokens[rid][:shorter]
        assert shorter >= ABORT_AFTER[rid]
    if engine in ("preempted", "priority"):
        assert expected.num_preemptions > 0 and got.num_preemptions > 0
    if engine == "roomy":
        assert expected.prefix_cache_hits > 0 and got.prefix_cache_hits > 0
    if drafter.startswith(("mock p=1", "mock p=0.7", "ngram")):
        assert got.multi_token_steps > 0  # speculation did happen
    if drafter.startswith("mock p=0 "):
        assert got.multi_token_steps == 0
    assert expected.multi_token_steps == 0


# -- through the front end: stop strings, n > 1, structured outputs -------------------------------


@pytest.fixture(scope="module")
def llms() -> Iterator[tuple[LLM, LLM, LLM]]:
    pytest.importorskip("llguidance")
    spec_mock = SpeculativeConfig(method="mock", num_speculative_tokens=3)
    spec_ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, dynamic=False)
    # Outputs copy from their prompts half the time: the n-gram proposer finds matches.
    options = {
        "spec": {"acceptance_rate": 0.8},
        "copy_prompt": {"fraction": 0.5, "period": 8},
        **LATENCY,
    }
    with (
        LLM(**ENGINE, backend_options=options, async_scheduling=False) as off,
        LLM(**ENGINE, backend_options=options, speculative_config=spec_mock) as mock,
        LLM(**ENGINE, backend_options=options, speculative_config=spec_ngram) as ngram,
    ):
        yield off, mock, ngram


PROMPTS = prompts(["", "a shared prompt prefix ", "abcdefgh"])


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(prompts=PROMPTS, params=st.lists(sampling_params(min_tokens=True), min_size=6, max_size=6))
def test_llm_outputs_are_those_without_speculation(
    llms: tuple[LLM, LLM, LLM], prompts: list[tuple[str, str]], params: list[SamplingParams]
) -> None:
    texts = [(prefix + body) or "x" for prefix, body in prompts]
    per_prompt = params[: len(texts)]
    off, mock, ngram = llms
    # Whether a request failed, not its message: with n > 1 the message is that of the child
    # that failed last, and speculation changes which child ends first (each child's tokens
    # and finish reason are compared).
    expected = summary(off.generate(texts, per_prompt, use_tqdm=False), error_text=False)
    assert summary(mock.generate(texts, per_prompt, use_tqdm=False), error_text=False) == expected
    assert summary(ngram.generate(texts, per_prompt, use_tqdm=False), error_text=False) == expected
    for llm in llms:
        stats = llm.get_stats()
        assert stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks


def test_the_llms_speculated(llms: tuple[LLM, LLM, LLM]) -> None:
    off, mock, ngram = llms
    params = SamplingParams(temperature=0.0, max_tokens=40)
    prompts = ["abcdefgh abcdefgh abcdefgh", "xyz"]
    expected = summary(off.generate(prompts, params, use_tqdm=False), error_text=False)
    for llm in (mock, ngram):
        before = llm.get_stats().spec_num_accepted_tokens
        assert summary(llm.generate(prompts, params, use_tqdm=False), error_text=False) == expected
        assert llm.get_stats().spec_num_accepted_tokens > before
    assert off.get_stats().spec_num_drafts == 0
