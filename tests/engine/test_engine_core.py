"""EngineCore: sizing the KV cache, validation of requests, stepping."""

from __future__ import annotations

import pytest

from engine_core._core.engine_io import EngineCoreRequest, PauseMode
from engine_core._engine.core import EngineCore
from engine_core._engine.inproc_client import InprocClient
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams


def test_max_model_len_left_unset_is_lowered_to_the_kv_capacity() -> None:
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte", num_kv_blocks=10))
    assert core.max_model_len == 160
    assert core.num_kv_blocks == 10


def test_explicit_max_model_len_that_does_not_fit_the_override_raises() -> None:
    with pytest.raises(ValueError, match="holds 10 blocks .160 tokens. but one request of "):
        EngineCore(
            EngineConfig(backend="mock", tokenizer="byte", num_kv_blocks=10, max_model_len=200)
        )


def test_bad_requests_fail_alone() -> None:
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte", max_model_len=64))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    core.add_request(EngineCoreRequest("long", list(range(64)), params))
    core.add_request(EngineCoreRequest("oov", [1, 999], params))
    core.add_request(EngineCoreRequest("empty", [], params))
    core.add_request(EngineCoreRequest("ok", [1, 2], params))
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    while core.has_unfinished_requests():
        out = core.step()
        for rid, new in zip(out.req_ids, out.new_token_ids, strict=True):
            tokens.setdefault(rid, []).extend(new)
        for f in out.finished:
            if f.error:
                errors[f.req_id] = f.error
    assert tokens == {"ok": [3, 4, 5]}
    assert errors == {
        "long": "the prompt has 64 tokens but max_model_len is 64 "
        "(at least one token must be generated)",
        "oov": "token ids [999] are outside the vocabulary (size 258)",
        "empty": "the prompt is empty",
    }
    with pytest.raises(TypeError, match="request_id must be a str"):
        core.add_request(EngineCoreRequest(7, [1], params))  # type: ignore[arg-type]


def test_sleep_forgets_the_prefix_cache_and_is_refused_while_requests_run() -> None:
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte", max_model_len=128))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = list(range(40))
    core.add_request(EngineCoreRequest("a", prompt, params))
    core.step()
    with pytest.raises(RuntimeError, match="cannot sleep while requests are in flight"):
        core.sleep()
    while core.has_unfinished_requests():
        core.step()
    assert core.scheduler.kv.pool.cached  # the prompt's full blocks are cached
    core.sleep()
    assert core.scheduler.kv.pool.cached == {}
    core.wake_up()
    core.add_request(EngineCoreRequest("b", prompt, params))
    while core.has_unfinished_requests():
        core.step()
    assert core.get_stats().prefix_cache_hits == 0


def test_in_process_data_parallelism_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="data_parallel_size=2 .* multiprocess=True"):
        InprocClient(EngineConfig(backend="mock", tokenizer="byte", data_parallel_size=2))


def test_pause_modes_are_strings_or_members() -> None:
    core = EngineCore(EngineConfig(backend="mock", tokenizer="byte", max_model_len=64))
    core.pause_generation("keep")
    assert core.pause_mode is PauseMode.KEEP
    core.pause_generation(PauseMode.WAIT)
    assert core.pause_mode == "wait"
    with pytest.raises(ValueError, match="^mode must be one of abort, wait, keep, got 'soon'$"):
        core.pause_generation("soon")
    assert core.pause_mode is PauseMode.WAIT  # a refused mode changes nothing
    core.resume_generation()
    assert not core.is_paused()
