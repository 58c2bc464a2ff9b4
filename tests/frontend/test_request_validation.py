"""``generate()`` refuses hostile arguments at once, before it sends anything or does any work
for the request (AsyncLLM under asyncio and trio, and LLM, in and out of process); a request
that reaches an engine process undecodable ends with an error instead of hanging."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import pytest

from engine_core import LLM, AsyncLLM, InvalidRequestError, SamplingParams
from engine_core._frontend import async_llm, request_checks
from engine_core.config import EngineConfig

pytestmark = pytest.mark.anyio

T = TypeVar("T")
GREEDY: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}


def _mutated(**changes: Any) -> SamplingParams:
    """Valid params whose fields were assigned to afterwards."""
    params = SamplingParams(max_tokens=2)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


# (prompt, params, generate() keyword arguments, exception, message)
HOSTILE: dict[str, tuple[Any, Any, dict[str, Any], type[Exception], str]] = {
    "priority-str": ("ab", None, {"priority": "high"}, TypeError, "^priority must be an int"),
    "priority-float": ("ab", None, {"priority": 1.5}, TypeError, "^priority must be an int"),
    "priority-bool": ("ab", None, {"priority": True}, TypeError, "^priority must be an int"),
    "priority-huge": ("ab", None, {"priority": 2**64}, ValueError, "^priority must be between"),
    "cache-salt-int": ("ab", None, {"cache_salt": 5}, TypeError, "^cache_salt must be a str"),
    "cache-salt-surrogate": ("ab", None, {"cache_salt": "\ud800"}, ValueError, "^cache_salt"),
    "params-type": ("ab", {"n": 2}, {}, TypeError, "^sampling_params must be SamplingParams"),
    "mutated-bool": ("ab", _mutated(ignore_eos="no"), {}, TypeError, "^ignore_eos must be a bool"),
    "mutated-kind": ("ab", _mutated(output_kind=7), {}, ValueError, "^output_kind must be one"),
    "mutated-huge": ("ab", _mutated(max_tokens=2**64), {}, ValueError, "^max_tokens must be"),
    "n-over-max": ("ab", SamplingParams(n=129), {}, ValueError, r"^n must be at most 128 \(max_n"),
    "n-billion": ("ab", SamplingParams(n=10**9), {}, ValueError, r"^n must be at most 128"),
    "stops": ("ab", SamplingParams(stop=["x"] * 65), {}, ValueError, "^stop must hold at most 64"),
    "stop-len": ("ab", SamplingParams(stop=["x" * 1025]), {}, ValueError, "^stop strings must be"),
    "prompt-ids": ({"prompt_token_ids": [1, 2**64]}, None, {}, ValueError, "'prompt_token_ids'"),
    "prompt-text": ("\udc00", None, {}, ValueError, "^prompt must be valid Unicode"),
}


def _engine(multiprocess: bool, **config: Any) -> AsyncLLM:
    return AsyncLLM(backend="mock", tokenizer="byte", multiprocess=multiprocess, **config)


async def _generate(engine: AsyncLLM, prompt: Any, params: Any, **kwargs: Any) -> list[Any]:
    with anyio.fail_after(10):
        return [out async for out in engine.generate(prompt, params, **kwargs)]


async def _assert_clean(engine: AsyncLLM) -> None:
    """Nothing is left of the refused requests, and the engine still serves."""
    assert engine._processor is not None and not engine._processor.has_unfinished_requests()
    outs = await _generate(engine, "abc", SamplingParams(max_tokens=3, **GREEDY))
    assert outs[-1].outputs[0].text == "def"
    with anyio.fail_after(10):
        stats = await engine.get_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)


@pytest.mark.parametrize("multiprocess", [True, False], ids=["mp", "inproc"])
async def test_async_generate_refuses_hostile_arguments_at_once(multiprocess: bool) -> None:
    # A full queue would answer with a retryable error: a limit that can never be met must not.
    async with _engine(multiprocess, max_num_seqs=1, max_queued_requests=1) as engine:
        for name, (prompt, params, kwargs, error, message) in HOSTILE.items():
            # The refusal happens in this thread: its CPU time is the work, however loaded the
            # machine is.
            started = time.thread_time()
            with anyio.fail_after(10), pytest.raises(error, match=message):
                await _generate(engine, prompt, params, **kwargs)
            assert time.thread_time() - started < 1.0, name  # no work per child of n=10**9
        await _assert_clean(engine)


async def test_the_engine_process_answers_requests_it_cannot_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without the front end's checks, the engine's decoding is the last line: each request
    # ends with an error naming the field, and nothing hangs.
    def params_only(config: Any, params: Any, **_: Any) -> SamplingParams:
        assert isinstance(params, SamplingParams)
        return params

    monkeypatch.setattr(async_llm, "check_request", params_only)
    cases = [
        (_mutated(ignore_eos="no"), {}, "at `$.sampling_params.ignore_eos`"),
        (_mutated(output_kind=7), {}, "sampling_params.output_kind"),
        (None, {"priority": "high"}, "at `$.priority`"),
        (None, {"cache_salt": 5}, "at `$.cache_salt`"),
    ]
    async with _engine(True) as engine:
        for params, kwargs, where in cases:
            with pytest.raises(InvalidRequestError, match="could not decode the request") as info:
                await _generate(engine, "ab", params, **kwargs)
            assert where in str(info.value)
        with anyio.fail_after(10):
            assert (await engine.get_stats()).num_malformed_messages == len(cases)
        await _assert_clean(engine)


def _bounded(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, failing the test instead of hanging."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args, **kwargs).result(timeout=30)


@pytest.mark.parametrize("multiprocess", [True, False], ids=["mp", "inproc"])
def test_llm_generate_refuses_hostile_params_at_once(multiprocess: bool) -> None:
    cases: list[tuple[Any, Any, type[Exception], str]] = [
        ("ab", _mutated(detokenize=1), TypeError, "^detokenize must be a bool"),
        ("ab", _mutated(skip_special_tokens=None), TypeError, "^skip_special_tokens must be"),
        ("ab", _mutated(top_k=2**64), ValueError, "^top_k must be between"),
        ("ab", SamplingParams(n=10**9), ValueError, r"^n must be at most 4 \(max_n\)"),
        (["ab", "cd"], [SamplingParams(), SamplingParams(stop=["x"] * 65)], ValueError, "^stop"),
        ({"prompt_token_ids": [2**63]}, None, ValueError, "'prompt_token_ids' must be ints"),
    ]
    with LLM(backend="mock", tokenizer="byte", multiprocess=multiprocess, max_n=4) as llm:
        for prompts, params, error, message in cases:
            with pytest.raises(error, match=message):
                _bounded(llm.generate, prompts, params, use_tqdm=False)
        with pytest.raises(ValueError, match=r"^n must be at most 4 \(max_n\)"):
            _bounded(llm.generate, "ab", SamplingParams(n=5), use_tqdm=False)
        assert llm._processor.num_unfinished_requests == 0
        out = _bounded(llm.generate, "abc", SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
        assert out[0].outputs[0].text == "de"
        stats = _bounded(llm.get_stats)
        assert (stats.num_running, stats.num_waiting, stats.num_malformed_messages) == (0, 0, 0)


def test_check_params_list_looks_at_each_distinct_params_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shared, other = SamplingParams(), SamplingParams()
    checked: list[int] = []
    monkeypatch.setattr(SamplingParams, "validate", lambda self: checked.append(id(self)))
    request_checks.check_params_list(EngineConfig(), [shared] * 1000 + [other, shared])
    assert checked == [id(shared), id(other)]
