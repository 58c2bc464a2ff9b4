"""Speculative decoding through the engine with the CUDA backend (on the CPU, float32): the
outputs of prompt-lookup speculation equal those without it for the tiny Llama and Qwen models,
greedy and seeded, with penalties, stop tokens, logprobs, chunked prefill, prefix hits and
forced preemption."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hf_reference import greedy
from tiny_models import TinyModel

from engine_core import SamplingParams, StructuredOutputsParams

KINDS = ["llama", "qwen2", "qwen3", "gemma2"]  # gemma2: verification across its window
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "dynamic": False}
# Few blocks (preemption) and a small token budget (chunked prefill).
SMALL = {
    "block_size": 4,
    "num_kv_blocks": 20,
    "max_model_len": 80,
    "max_num_batched_tokens": 16,
    "max_num_seqs": 4,
}


def _prompts() -> list[dict[str, list[int]]]:
    """Prompts that repeat a phrase, so prompt lookup finds continuations."""
    phrases = [[11, 12, 13, 14, 15], [40, 41, 42], [70, 71, 72, 73, 74, 75, 76], [90, 91]]
    return [{"prompt_token_ids": (p * 4)[: 9 + 2 * i]} for i, p in enumerate(phrases)]


def _outputs(outputs: list[Any]) -> list[tuple[Any, ...]]:
    """Per request: tokens, finish reason, and the logprobs (candidates with rank and value)."""
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].finish_reason,
            [{t: (lp.rank, lp.logprob) for t, lp in e.items()} for e in o.outputs[0].logprobs]
            if o.outputs[0].logprobs is not None
            else None,
        )
        for o in outputs
    ]


def _assert_same(got: list[tuple[Any, ...]], expected: list[tuple[Any, ...]]) -> None:
    """The same tokens, reasons, candidates and ranks; logprobs within float32 rounding of
    batches computed in different shapes."""
    assert [g[:2] for g in got] == [e[:2] for e in expected]
    for g, e in zip(got, expected, strict=True):
        if e[2] is None:
            assert g[2] is None
            continue
        for at_g, at_e in zip(g[2], e[2], strict=True):
            assert {t: r for t, (r, _) in at_g.items()} == {t: r for t, (r, _) in at_e.items()}
            for t, (_, value) in at_e.items():
                assert at_g[t][1] == pytest.approx(value, abs=1e-3)


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, logprobs=2),
    SamplingParams(
        temperature=0.0, max_tokens=20, frequency_penalty=0.5, presence_penalty=0.2, ignore_eos=True
    ),  # fmt: skip
    SamplingParams(
        temperature=1.0, top_k=40, min_p=0.02, seed=9, max_tokens=20, ignore_eos=True
    ),  # fmt: skip
]


def _stats(llm: Any) -> Any:
    return llm._client.engine_core.scheduler.draft_planner.stats


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_ngram_speculation_gives_the_tokens_of_plain_decoding(
    tiny: dict[str, TinyModel], kind: str
) -> None:
    model = tiny[kind]
    prompts = _prompts()
    with model.llm() as llm:
        plain = llm.generate(prompts, PARAMS, use_tqdm=False)
        # Stop tokens taken from the first run: each request stops at a different point.
        stops = [
            p.clone(stop_token_ids=[o.outputs[0].token_ids[6 + i]], ignore_eos=False)
            for i, (p, o) in enumerate(zip(PARAMS, plain, strict=True))
        ]
        plain_stopped = llm.generate(prompts, stops, use_tqdm=False)
    with model.llm(speculative_config=NGRAM) as llm:
        spec = llm.generate(prompts, PARAMS, use_tqdm=False)
        spec_stopped = llm.generate(prompts, stops, use_tqdm=False)
        stats = _stats(llm)
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    _assert_same(_outputs(spec), _outputs(plain))
    _assert_same(_outputs(spec_stopped), _outputs(plain_stopped))
    assert all(o.outputs[0].finish_reason == "stop" for o in spec_stopped)
    expected = greedy(model.hf, prompts[0]["prompt_token_ids"], 20)
    assert spec[0].outputs[0].token_ids == expected


def test_speculation_with_chunked_prefill_prefix_hits_and_preemption(
    tiny: dict[str, TinyModel],
) -> None:
    model = tiny["llama"]
    prompts = _prompts()
    prompts += [{"prompt_token_ids": prompts[2]["prompt_token_ids"] + [5, 6, 7, 8]}]  # a hit
    params = [*PARAMS, PARAMS[0].clone(max_tokens=30)]
    results = {}
    for spec in (None, NGRAM):
        with model.llm(speculative_config=spec, **SMALL) as llm:
            results[spec is None] = _outputs(llm.generate(prompts, params, use_tqdm=False))
            stats = llm.get_stats()
            assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
            if spec is not None:
                assert _stats(llm).num_accepted_tokens > 0
    _assert_same(results[True], results[False])


def test_speculation_under_a_grammar(tiny: dict[str, TinyModel]) -> None:
    """Constrained requests verify drafts with one bitmask row per position."""
    model = tiny["qwen3"]
    words = "(engine|decode|prefill|batch|step|chunk)"
    regex = f"{words}( {words}){{11}}"
    prompts = [{"prompt_token_ids": p["prompt_token_ids"]} for p in _prompts()[:3]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30,
                       structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=0.9, seed=4, max_tokens=30,
                       structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]  # fmt: skip
    results = {}
    for spec in (None, NGRAM):
        with model.llm(speculative_config=spec) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            results[spec is None] = [(o.outputs[0].token_ids, o.outputs[0].text) for o in outputs]
            if spec is not None:
                assert _stats(llm).num_accepted_tokens > 0
    assert results[True] == results[False]
    for _, text in results[True][:2]:
        assert re.fullmatch(regex, text)


def test_prompt_logprobs_when_the_last_prefill_chunk_is_drafted(
    tiny: dict[str, TinyModel],
) -> None:
    """A 17-token prompt under a 16-token budget leaves one prompt token for the second step,
    which the scheduler may draft (prompt lookup over the prompt): its prompt logprob still comes
    back, and the drafted positions are not taken for prompt positions."""
    model = tiny["llama"]
    prompt = {"prompt_token_ids": ([21, 22, 23, 24] * 5)[:17]}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    results = {}
    for spec in (None, NGRAM):
        with model.llm(speculative_config=spec, **SMALL) as llm:
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            results[spec is None] = out
            if spec is not None:
                assert _stats(llm).num_accepted_tokens > 0
    spec_out, plain = results[False], results[True]
    assert spec_out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert plain.prompt_logprobs is not None and spec_out.prompt_logprobs is not None
    assert len(spec_out.prompt_logprobs) == len(plain.prompt_logprobs) == 17
    for got, expected in zip(spec_out.prompt_logprobs, plain.prompt_logprobs, strict=True):
        if expected is None:
            assert got is None
            continue
        assert got is not None and got.keys() == expected.keys()
        for token, lp in expected.items():
            assert got[token].logprob == pytest.approx(lp.logprob, abs=1e-3)


@pytest.mark.timeout(300)
def test_ngram_speculation_under_tensor_parallelism(tiny: dict[str, TinyModel]) -> None:
    """TP=2 over gloo: rank 0 verifies the drafts and broadcasts the outcome, rank 1 writes the
    same tokens into its batch; greedy and seeded outputs (and logprobs) equal TP=2 without
    speculation, with chunked prefill and preemption in the way."""
    model = tiny["qwen3"]
    prompts = _prompts()
    tp = {"tensor_parallel_size": 2, "multiprocess": False, **SMALL}
    with model.llm(**tp) as llm:
        plain = _outputs(llm.generate(prompts, PARAMS, use_tqdm=False))
    with model.llm(speculative_config=NGRAM, **tp) as llm:
        spec = _outputs(llm.generate(prompts, PARAMS, use_tqdm=False))
        stats = _stats(llm)
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        assert llm.get_stats().num_preemptions > 0
    _assert_same(spec, plain)


@pytest.mark.timeout(300)
def test_a_draft_model_under_tensor_parallelism(tiny: dict[str, TinyModel]) -> None:
    """TP=2 over gloo with a draft model (another tiny model), which runs whole on rank 0: the
    outputs equal TP=2's without speculation."""
    model = tiny["qwen3"]
    draft = {"method": "draft_model", "model": str(tiny["qwen2"].path),
             "num_speculative_tokens": 3, "dynamic": False}  # fmt: skip
    prompts = _prompts()
    tp = {"tensor_parallel_size": 2, "multiprocess": False, **SMALL}
    with model.llm(**tp) as llm:
        plain = _outputs(llm.generate(prompts, PARAMS, use_tqdm=False))
    with model.llm(speculative_config=draft, **tp) as llm:
        runner = llm._client.engine_core.backend.runner
        assert runner.drafter is not None and runner.parallel.rank == 0
        spec = _outputs(llm.generate(prompts, PARAMS, use_tqdm=False))
        stats = _stats(llm)
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    _assert_same(spec, plain)
