"""Sampling through the engine: seeds independent of the batch, logprobs equal to transformers',
penalties, stop tokens below ``min_tokens`` and the grammar bitmask."""

from __future__ import annotations

import numpy as np
import torch
from engine_core_cuda import CudaBackend
from hf_reference import PROMPTS, greedy, log_softmax
from tiny_models import TinyModel
from transformers import GenerationConfig

from engine_core import SamplingParams
from engine_core.abc import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core.config import EngineConfig
from engine_core.sampling_params import StructuredOutputsParams

SEEDED = SamplingParams(
    temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=1234, max_tokens=12, ignore_eos=True
)


def test_the_same_seed_gives_the_same_tokens_alone_and_in_a_batch(
    tiny: dict[str, TinyModel],
) -> None:
    model = tiny["llama"]
    prompt = PROMPTS[1]
    with model.llm() as llm:
        alone = llm.generate(prompt, SEEDED, use_tqdm=False)[0].outputs[0].token_ids
        others = [
            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True),
            SEEDED.clone(seed=99),
        ]
        batch = llm.generate(
            [PROMPTS[3], prompt, PROMPTS[0], PROMPTS[2]],
            [others[0], SEEDED, others[1], others[2]],
            use_tqdm=False,
        )
    in_batch = batch[1].outputs[0].token_ids
    assert in_batch == alone
    assert len(alone) == 12
    with model.llm(max_num_batched_tokens=8, max_num_seqs=4, block_size=8) as llm:
        chunked = llm.generate(prompt, SEEDED, use_tqdm=False)[0].outputs[0].token_ids
    assert chunked == alone


def test_another_seed_gives_other_tokens(tiny: dict[str, TinyModel]) -> None:
    with tiny["llama"].llm() as llm:
        runs = llm.generate(
            [PROMPTS[1]] * 3,
            [SEEDED, SEEDED.clone(seed=1235), SEEDED.clone(seed=1236)],
            use_tqdm=False,
        )
    tokens = [tuple(r.outputs[0].token_ids) for r in runs]
    assert len(set(tokens)) == 3


def test_logprobs_equal_transformers(tiny: dict[str, TinyModel]) -> None:
    model = tiny["qwen2"]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3
        ),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=2),
    ]
    # Chunked prefill: prompt logprobs cross chunk boundaries.
    with model.llm(block_size=8, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        outputs = llm.generate([PROMPTS[4], PROMPTS[1]], params, use_tqdm=False)
    for out, p in zip(outputs, params, strict=True):
        completion = out.outputs[0]
        tokens = out.prompt_token_ids + completion.token_ids
        expected = log_softmax(model.hf, tokens)
        num_prompt = len(out.prompt_token_ids)
        assert completion.logprobs is not None
        assert len(completion.logprobs) == len(completion.token_ids)
        for i, (token, position) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            row = expected[num_prompt + i - 1]
            _check_position(position, token, row, p.logprobs or 0)
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert out.prompt_logprobs is not None
        assert len(out.prompt_logprobs) == num_prompt and out.prompt_logprobs[0] is None
        for pos in range(1, num_prompt):
            entry = out.prompt_logprobs[pos]
            assert entry is not None
            _check_position(entry, out.prompt_token_ids[pos], expected[pos - 1], 3)


def _check_position(position: dict, token: int, row: torch.Tensor, num_top: int) -> None:
    top = row.topk(num_top)
    assert set(position) == {token, *top.indices.tolist()}
    rank = int((row > row[token]).sum()) + 1
    assert position[token].rank == rank
    assert abs(position[token].logprob - float(row[token])) < 1e-4
    for r, (tid, lp) in enumerate(
        zip(top.indices.tolist(), top.values.tolist(), strict=True), start=1
    ):
        if tid != token:
            assert position[tid].rank == r
        assert abs(position[tid].logprob - lp) < 1e-4


def test_repetition_penalty_equals_transformers(tiny: dict[str, TinyModel]) -> None:
    model = tiny["qwen3"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    with model.llm() as llm:
        outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    for out in outputs:
        config = GenerationConfig(
            do_sample=False, max_new_tokens=12, repetition_penalty=1.8, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
        with torch.no_grad():
            ref = model.hf.generate(torch.tensor([out.prompt_token_ids]), generation_config=config)
        expected = ref[0, len(out.prompt_token_ids) :].tolist()
        assert out.outputs[0].token_ids == expected
        assert expected != greedy(model.hf, out.prompt_token_ids, 12)  # the penalty mattered


def test_stop_tokens_are_masked_until_min_tokens(tiny: dict[str, TinyModel]) -> None:
    """As transformers' ``min_new_tokens`` with the stop token as EOS: masked for the first
    ``min_tokens`` tokens, then it ends the request."""
    model = tiny["llama"]
    with model.llm() as llm:
        greedy_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        plain = llm.generate(PROMPTS[2], greedy_params, use_tqdm=False)[0]
        stop = plain.outputs[0].token_ids[3]  # greedy decoding reaches it at the 4th token
        params = SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop], min_tokens=5
        )
        out = llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0]
    config = GenerationConfig(
        do_sample=False, max_new_tokens=16, min_new_tokens=5, eos_token_id=stop, pad_token_id=0
    )
    prompt = plain.prompt_token_ids
    with torch.no_grad():
        ref = model.hf.generate(torch.tensor([prompt]), generation_config=config)
    expected = ref[0, len(prompt) :].tolist()
    assert out.token_ids == expected
    # Masked at the 4th and 5th tokens, then it came back and ended the request.
    assert stop not in expected[:5] and len(expected) == 6 and expected[-1] == stop
    assert out.finish_reason == "stop"


def test_logit_bias_bans_and_forces_tokens(tiny: dict[str, TinyModel]) -> None:
    model = tiny["llama"]
    with model.llm() as llm:
        greedy_params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
        plain = llm.generate(PROMPTS[2], greedy_params, use_tqdm=False)[0].outputs[0]
        first = plain.token_ids[0]
        banned = llm.generate(
            PROMPTS[2], greedy_params.clone(logit_bias={first: -100.0}), use_tqdm=False
        )[0].outputs[0]
        forced = llm.generate(
            [PROMPTS[2], PROMPTS[0]],
            [
                greedy_params.clone(logit_bias={7: 100.0}),
                SEEDED.clone(max_tokens=6, logit_bias={7: 100.0}),
            ],
            use_tqdm=False,
        )
    assert banned.token_ids[0] != first and first not in banned.token_ids
    for out in forced:
        assert out.outputs[0].token_ids == [7] * 6
    # Logprobs are the model's own: the forced token's is not raised to ~0.
    assert plain.logprobs is not None and banned.logprobs is not None
    assert banned.logprobs[0][banned.token_ids[0]].rank != 1


def test_grammar_bitmask_restricts_the_sampled_token(tiny: dict[str, TinyModel]) -> None:
    model = tiny["qwen2"]
    config = EngineConfig(
        model=str(model.path), backend="cuda", backend_options={"device": "cpu"}, max_model_len=64
    )
    backend = CudaBackend(config)
    try:
        backend.initialize_kv_cache(16)
        prompt = [5, 17, 99, 3]
        constrained = SamplingParams(
            temperature=0.0, structured_outputs=StructuredOutputsParams(regex="a+")
        )
        free = SamplingParams(temperature=0.0)
        scheduled = SchedulerOutput(
            new_reqs=[
                NewRequestData("free", prompt, free, [0], 0, 4),
                NewRequestData("constrained", prompt, constrained, [1], 0, 4),
            ],
            cached=CachedRequestData(),
            total_num_scheduled_tokens=8,
        )
        allowed = [7, 200, 319]  # 319: bit 31, the sign bit of its int32 word
        words = np.zeros((1, (backend.vocab_size() + 31) // 32), dtype=np.uint32)
        for token in allowed:
            words[0, token // 32] |= np.uint32(1 << (token % 32))
        bitmask = words.view(np.int32)
        backend.execute_model(scheduled)
        output = backend.sample_tokens(bitmask)
    finally:
        backend.close()
    row = log_softmax(model.hf, prompt)[-1]
    assert output.sampled_token_ids[0] == [int(row.argmax())]
    best_allowed = max(allowed, key=lambda t: float(row[t]))
    assert output.sampled_token_ids[1] == [best_allowed]
    assert best_allowed != int(row.argmax())
