"""Mistral with its sliding window, Gemma 2, Gemma 3 and gpt-oss (window layers with attention
sinks; :mod:`test_cuda_gpt_oss` has the rest of it) through ``LLM(backend="cuda")`` on the
CPU against transformers (float32): greedy tokens identical and logprobs (sampled and prompt)
within 1e-4, on prompts longer than the window, with chunked prefill across the window's edge,
prefix-cache hits longer than the window, preemption and the Triton kernels, through the engine
core's KV-cache groups (window layers' blocks behind the window are released). Each model feature is also shown to matter: without it the outputs part from
transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import PROMPTS, greedy, log_softmax
from tiny_models import WINDOW, TinyModel, edited_copy

from engine_core import SamplingParams
from engine_core.outputs import RequestOutput

WINDOWED = ["mistral", "gemma2", "gemma3", "gpt_oss"]
LOGPROB_TOL = 1e-4


def _params(max_tokens: int = 10, prompt_logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1,
                          prompt_logprobs=prompt_logprobs)  # fmt: skip


def _worst_logprob_error(model: TinyModel, out: RequestOutput) -> float:
    """The largest difference between the engine's logprobs (each sampled token's, and the
    prompt's when asked) and transformers' log-softmax over the whole sequence."""
    completion = out.outputs[0]
    prompt = out.prompt_token_ids
    tokens = [*prompt, *completion.token_ids]
    expected = log_softmax(model.hf, tokens)
    worst = 0.0
    assert completion.logprobs is not None
    for i, entry in enumerate(completion.logprobs):
        token = completion.token_ids[i]
        worst = max(worst, abs(entry[token].logprob - float(expected[len(prompt) - 1 + i, token])))
    for position, entry in enumerate(out.prompt_logprobs or []):
        if entry is None:
            continue  # the first prompt token has no logprob
        token = prompt[position]
        worst = max(worst, abs(entry[token].logprob - float(expected[position - 1, token])))
    return worst


def _check(model: TinyModel, outputs: list[RequestOutput]) -> None:
    for out in outputs:
        completion = out.outputs[0]
        expected = greedy(model.hf, out.prompt_token_ids, len(completion.token_ids))
        assert completion.token_ids == expected, f"prompt {out.prompt!r}"
        assert _worst_logprob_error(model, out) < LOGPROB_TOL, f"prompt {out.prompt!r}"


@pytest.mark.parametrize("kind", WINDOWED)
def test_batched_greedy_and_logprobs_equal_transformers(
    tiny: dict[str, TinyModel], kind: str
) -> None:
    model = tiny[kind]
    with model.llm() as llm:
        outputs = llm.generate(PROMPTS, _params(prompt_logprobs=1), use_tqdm=False)
    assert sum(len(o.prompt_token_ids) > 2 * WINDOW for o in outputs) >= 2
    assert all(o.prompt_logprobs for o in outputs)
    _check(model, outputs)


@pytest.mark.parametrize("kind", WINDOWED)
def test_chunked_prefill_across_the_window_edge(tiny: dict[str, TinyModel], kind: str) -> None:
    """Chunks of 6 tokens over blocks of 4 and a window of 8: chunks start inside the window of
    the one before and inside blocks."""
    model = tiny[kind]
    with model.llm(block_size=4, max_num_batched_tokens=6, max_num_seqs=2) as llm:
        outputs = llm.generate(PROMPTS[1::2], _params(prompt_logprobs=1), use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outputs) > 4 * 6  # chunked over 5+ steps
    _check(model, outputs)


def test_prefix_hits_longer_than_the_window(tiny: dict[str, TinyModel]) -> None:
    model = tiny["gemma3"]
    shared = PROMPTS[3]
    with model.llm(block_size=4) as llm:
        first = llm.generate([shared + " table"], _params(), use_tqdm=False)
        second = llm.generate([shared + " queue", shared + " slot head"], _params(),
                              use_tqdm=False)  # fmt: skip
    assert all(o.num_cached_tokens > 3 * WINDOW for o in second), [
        o.num_cached_tokens for o in second
    ]
    _check(model, first + second)


def test_preemption_equals_transformers(tiny: dict[str, TinyModel]) -> None:
    model = tiny["gemma2"]
    with model.llm(
        # Pages of one layer (3 groups): 32 for a request's full group of 128 tokens and 7 per
        # window group at 16 tokens a step fit; five requests do not.
        block_size=4,
        num_kv_blocks=50,
        max_model_len=128,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        enable_prefix_caching=False,
    ) as llm:
        outputs = llm.generate(PROMPTS, _params(max_tokens=20), use_tqdm=False)
        stats = llm.get_stats()
    assert stats.num_preemptions > 0
    _check(model, outputs)


def test_triton_kernels_end_to_end(tiny: dict[str, TinyModel]) -> None:
    """The interpreted Triton kernels (windowed and soft-capped attention, Gemma's norm and
    gelu-tanh) in mixed batches of prefill chunks and decodes."""
    model = tiny["gemma2"]
    with model.llm(block_size=4, max_num_batched_tokens=12, max_num_seqs=2,
                   backend_options={"kernels": "triton"}) as llm:  # fmt: skip
        assert llm._client.engine_core.backend.runner.ops.impl == "triton"
        outputs = llm.generate([PROMPTS[0], PROMPTS[4]], _params(max_tokens=5), use_tqdm=False)
    _check(model, outputs)


def test_mistral_serves_past_its_window(tiny: dict[str, TinyModel]) -> None:
    from engine_core_cuda._hf_config import load_model_config

    config = load_model_config(tiny["mistral"].path)
    assert config.sliding_window == WINDOW and config.max_model_len == 512  # no cap at the window
    assert config.layer_types == ("sliding_attention",) * 2


def _edited(model: TinyModel, tmp_path: Path, changes: dict[str, object]) -> TinyModel:
    """The same checkpoint (and transformers model) with ``config.json`` fields replaced (None
    removes one)."""
    target = edited_copy(model.path, tmp_path / model.kind, changes)
    edited = TinyModel.__new__(TinyModel)
    edited.kind, edited.path, edited.hf = model.kind, target, model.hf
    return edited


@pytest.mark.parametrize(
    ("kind", "changes"),
    [
        ("mistral", {"sliding_window": None}),
        ("gemma2", {"layer_types": ["full_attention"] * 3}),
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma2", {"final_logit_softcapping": None}),
        ("gemma2", {"query_pre_attn_scalar": 16}),
        ("gemma3", {"rope_local_base_freq": 100000.0}),
        ("gemma3", {"sliding_window_pattern": 2}),
        ("gpt_oss", {"layer_types": ["full_attention"] * 4}),
        ("gpt_oss", {"rope_scaling": None}),
    ],
    ids=lambda value: value if isinstance(value, str) else ",".join(value),
)
def test_without_each_feature_the_outputs_part_from_transformers(
    tiny: dict[str, TinyModel], tmp_path: Path, kind: str, changes: dict[str, object]
) -> None:
    model = _edited(tiny[kind], tmp_path, changes)
    with model.llm() as llm:
        outputs = llm.generate(PROMPTS[3:4], _params(prompt_logprobs=1), use_tqdm=False)
    assert _worst_logprob_error(model, outputs[0]) > 100 * LOGPROB_TOL


def test_the_embedding_scale_and_tied_head(tiny: dict[str, TinyModel]) -> None:
    model = tiny["gemma2"]
    with model.llm() as llm:
        lm = llm._client.engine_core.backend.runner.model
        assert lm.lm_head is None and lm.lm_head_weight is lm.model.embed_tokens.weight
        assert lm.model.embed_scale is not None
        assert float(lm.model.embed_scale) == pytest.approx(64**0.5)
        hf_scale = model.hf.model.embed_tokens.embed_scale.to(torch.float32)
        assert torch.equal(lm.model.embed_scale, hf_scale)
