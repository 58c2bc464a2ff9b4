"""Async scheduling with the CUDA backend (on the CPU): the same greedy tokens as synchronous
scheduling for the tiny Llama and Qwen models, with chunked prefill, prefix hits, forced
preemption, aborts and stop strings."""

from __future__ import annotations

from typing import Any

import pytest
from hf_reference import PROMPTS
from tiny_models import TinyModel

from engine_core import SamplingParams
from engine_core._core.engine_io import EngineCoreRequest
from engine_core._engine.core import EngineCore
from engine_core.config import EngineConfig

KINDS = ["llama", "qwen3"]
# Few blocks (preemption) and a small token budget (chunked prefill).
SMALL = {
    "block_size": 4,
    "num_kv_blocks": 32,
    "max_model_len": 128,
    "max_num_batched_tokens": 16,
    "max_num_seqs": 4,
}


def _texts(outputs: list[Any]) -> list[tuple[Any, ...]]:
    return [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_async_scheduling_gives_the_greedy_tokens_of_sync(
    tiny: dict[str, TinyModel], kind: str
) -> None:
    model = tiny[kind]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    shared = PROMPTS[3]
    prompts = [*PROMPTS, shared + " again", shared + " and more"]  # prefix hits
    results = {}
    for async_scheduling in (False, True):
        with model.llm(async_scheduling=async_scheduling, **SMALL) as llm:
            core = llm._client.engine_core  # type: ignore[attr-defined]
            assert core.async_scheduling is async_scheduling
            first = llm.generate(prompts, params, use_tqdm=False)
            # Stop strings taken from the first run's texts: the front end aborts those
            # requests in the engine once it sees them.
            stops = [o.outputs[0].text[8:11] for o in first]
            stopped = llm.generate(
                prompts,
                [
                    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[s])
                    for s in stops
                ],
                use_tqdm=False,
            )
            stats = llm.get_stats()
            assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
            results[async_scheduling] = (_texts(first), _texts(stopped))
    assert results[True] == results[False]
    assert any(reason == "stop" for _, _, reason in results[True][1])


@pytest.mark.parametrize("kind", KINDS)
def test_an_abort_with_a_token_in_flight_discards_it(tiny: dict[str, TinyModel], kind: str) -> None:
    tokens: dict[bool, dict[str, list[int]]] = {}
    for async_scheduling in (False, True):
        config = EngineConfig(
            model=str(tiny[kind].path),
            backend="cuda",
            backend_options={"device": "cpu", "kernels": "torch"},
            async_scheduling=async_scheduling,
            **SMALL,
        )
        core = EngineCore(config)
        got: dict[str, list[int]] = {"a": [], "b": []}
        try:
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            core.add_request(EngineCoreRequest("a", [5, 6, 7, 8], params))
            core.add_request(EngineCoreRequest("b", [9, 10, 11], params))
            while core.has_unfinished_requests():
                out = core.step()
                for rid, new in zip(out.req_ids, out.new_token_ids, strict=True):
                    got[rid] += new
                if len(got["a"]) >= 5 and "a" in core.scheduler.requests:
                    core.abort_requests(["a"])
            assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks
        finally:
            core.close()
        tokens[async_scheduling] = got
    assert tokens[True] == tokens[False]
    assert len(tokens[True]["a"]) == 5 and len(tokens[True]["b"]) == 12
