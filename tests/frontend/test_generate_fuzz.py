"""Hypothesis over ``SamplingParams`` and ``AsyncLLM.generate`` arguments, against one engine
process per runtime: whatever a caller passes, the params refuse it at construction, or
``generate()`` refuses it at once with ``ValueError``/``TypeError``, or the request ends (an
error output included); afterwards the engine holds no request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from helpers.strategies import HOSTILE, SAMPLING_FIELDS
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine_core import AsyncLLM, EngineError, SamplingParams
from engine_core.sampling_params import StructuredOutputsParams

_ENDS_WITHIN_S = 10.0

FIELDS = {
    **SAMPLING_FIELDS,
    # Most requests valid, and short, on the engine below (max_n=3, max_model_len=64).
    "n": st.integers(1, 3),
    "temperature": st.sampled_from([0.7, 1.0]),  # greedy refuses n > 1
    "max_tokens": st.integers(3, 8),
    "min_tokens": st.integers(0, 3),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3),  # some stop a request
    "logprobs": st.integers(0, 5),
    "prompt_logprobs": st.integers(0, 2),
    "detokenize": st.just(True),  # stop strings need it
    "structured_outputs": st.builds(
        StructuredOutputsParams, choice=st.lists(st.text(min_size=1, max_size=3), min_size=1)
    ),
}


VALID_FIELDS = st.fixed_dictionaries({}, optional=FIELDS)
ODD_FIELD = st.tuples(st.sampled_from(sorted(FIELDS)), HOSTILE)


def mostly(valid: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` four times in five, else ``odd``: enough requests get through to the engine."""
    return st.integers(0, 4).flatmap(lambda pick: odd if pick == 0 else valid)


PROMPTS = mostly(
    st.one_of(
        st.text(min_size=1, max_size=6),
        st.fixed_dictionaries(
            {"prompt_token_ids": st.lists(st.integers(0, 257), min_size=1, max_size=4)}
        ),
    ),
    st.one_of(
        st.just(""),
        st.fixed_dictionaries({"prompt_token_ids": st.lists(HOSTILE, max_size=3)}),
        st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(250, 300), max_size=3)}),
        HOSTILE,
    ),
)
ARGUMENTS = st.fixed_dictionaries(
    {},
    optional={
        "priority": mostly(st.integers(-5, 5), HOSTILE),
        "cache_salt": mostly(st.text(max_size=4), HOSTILE),
    },
)


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[BlockingPortal, AsyncLLM]]:
    """One engine process for all the examples of a runtime; once they ran, it holds no
    request (checked here, after the last example)."""
    with start_blocking_portal(request.param) as portal:
        llm = AsyncLLM(backend="mock", tokenizer="byte", max_model_len=64, max_n=3)
        with portal.wrap_async_context_manager(llm):
            yield portal, llm
            stats = portal.call(llm.get_stats)
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            assert llm._processor is not None and not llm._processor.has_unfinished_requests()


async def _run(llm: AsyncLLM, prompt: Any, params: Any, extra: dict[str, Any]) -> str:
    """How one generate() call ended: refused at once, or ended (the last output finished, or
    an engine error raised for the request)."""
    stream = llm.generate(prompt, params, **extra)
    try:
        with anyio.fail_after(_ENDS_WITHIN_S):
            try:
                outputs = [out async for out in stream]
            except (ValueError, TypeError):
                return "refused by generate()"
            except EngineError:
                return "ended with an engine error"
    finally:
        await stream.aclose()
    assert outputs and outputs[-1].finished
    return f"ended: {outputs[-1].outputs[0].finish_reason}"


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    fields=VALID_FIELDS,
    odd=mostly(st.none(), ODD_FIELD),
    assigned=mostly(st.none(), ODD_FIELD),
    prompt=PROMPTS,
    arguments=ARGUMENTS,
)
def test_every_call_is_refused_at_once_or_ends(
    engine: tuple[BlockingPortal, AsyncLLM],
    fields: dict[str, Any],
    odd: tuple[str, Any] | None,
    assigned: tuple[str, Any] | None,
    prompt: Any,
    arguments: dict[str, Any],
) -> None:
    """``odd``: a field passed an odd value; ``assigned``: one assigned after construction."""
    portal, llm = engine
    if odd is not None:
        fields[odd[0]] = odd[1]
    try:
        params = SamplingParams(**fields)
    except (ValueError, TypeError):
        event("refused by SamplingParams")
        return
    if assigned is not None:
        setattr(params, *assigned)
    event(portal.call(_run, llm, prompt, params, arguments))
