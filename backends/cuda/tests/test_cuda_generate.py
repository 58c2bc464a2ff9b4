"""Greedy generation through ``LLM(backend="cuda")`` on the CPU equals transformers' greedy
``generate()``: batched prompts of different lengths, chunked prefill, prefix-cache hits,
preemption, and the Triton kernels in interpreter mode."""

from __future__ import annotations

import pytest
from hf_reference import PROMPTS, greedy
from tiny_models import TinyModel

from engine_core import SamplingParams
from engine_core.outputs import RequestOutput

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _check_against_transformers(model: TinyModel, outputs: list[RequestOutput]) -> None:
    for out in outputs:
        expected = greedy(model.hf, out.prompt_token_ids, len(out.outputs[0].token_ids))
        assert out.outputs[0].token_ids == expected, f"prompt {out.prompt!r}"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_batched_greedy_equals_transformers(tiny: dict[str, TinyModel], kind: str) -> None:
    model = tiny[kind]
    with model.llm() as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [MAX_TOKENS] * len(PROMPTS)
    assert len({len(o.prompt_token_ids) for o in outputs}) == len(PROMPTS)
    _check_against_transformers(model, outputs)


def test_chunked_prefill_equals_transformers(tiny: dict[str, TinyModel]) -> None:
    model = tiny["qwen2"]
    with model.llm(block_size=8, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outputs) > 3 * 8  # chunked over 4+ steps
    _check_against_transformers(model, outputs)


def test_prefix_cache_hits_equal_transformers(tiny: dict[str, TinyModel]) -> None:
    model = tiny["llama"]
    shared = PROMPTS[3]
    with model.llm(block_size=8) as llm:
        first = llm.generate([shared + " table", shared + " slot"], GREEDY, use_tqdm=False)
        second = llm.generate(
            [shared + " queue", shared + " table", shared + " slot head"], GREEDY, use_tqdm=False
        )
        stats = llm.get_stats()
    assert all(o.num_cached_tokens >= 3 * 8 for o in second), [o.num_cached_tokens for o in second]
    assert stats.prefix_cache_hits > 0
    _check_against_transformers(model, first + second)


def test_preemption_equals_transformers(tiny: dict[str, TinyModel]) -> None:
    model = tiny["qwen3"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with model.llm(
        block_size=4, num_kv_blocks=40, max_model_len=128, enable_prefix_caching=False
    ) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.get_stats()
    assert stats.num_preemptions > 0
    _check_against_transformers(model, outputs)


def test_triton_kernels_end_to_end(tiny: dict[str, TinyModel]) -> None:
    """The Triton kernels (interpreted) in a mixed batch with chunked prefill and decodes."""
    model = tiny["qwen3"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    options = {"kernels": "triton"}
    with model.llm(
        block_size=8, max_num_batched_tokens=16, max_num_seqs=4, backend_options=options
    ) as llm:
        assert llm._client.engine_core.backend.runner.ops.impl == "triton"
        outputs = llm.generate([PROMPTS[0], PROMPTS[3]], params, use_tqdm=False)
    _check_against_transformers(model, outputs)
