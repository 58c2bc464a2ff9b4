"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) through
``LLM(backend="cuda")`` on the CPU against transformers (float32): greedy tokens identical and
logprobs within 1e-4, with the torch experts and with the interpreted fused Triton kernel; their
configs read as each architecture routes; unsupported MoE fields refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_reference import PROMPTS, greedy, log_softmax
from tiny_models import TinyModel, edited_copy

from engine_core import LLM, SamplingParams
from engine_core.outputs import RequestOutput

MOE = ["qwen3_moe", "qwen2_moe", "mixtral"]
LOGPROB_TOL = 1e-4


def _params(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def _check(model: TinyModel, outputs: list[RequestOutput]) -> None:
    for out in outputs:
        completion = out.outputs[0]
        expected = greedy(model.hf, out.prompt_token_ids, len(completion.token_ids))
        assert completion.token_ids == expected, f"prompt {out.prompt!r}"
        tokens = [*out.prompt_token_ids, *completion.token_ids]
        reference = log_softmax(model.hf, tokens)
        assert completion.logprobs is not None
        start = len(out.prompt_token_ids) - 1
        for i, entry in enumerate(completion.logprobs):
            token = completion.token_ids[i]
            error = abs(entry[token].logprob - float(reference[start + i, token]))
            assert error < LOGPROB_TOL, f"prompt {out.prompt!r}, token {i}: {error}"


@pytest.mark.parametrize("kind", MOE)
def test_batched_greedy_and_logprobs_equal_transformers(
    tiny: dict[str, TinyModel], kind: str
) -> None:
    model = tiny[kind]
    with model.llm() as llm:
        outputs = llm.generate(PROMPTS[:3], _params(max_tokens=5), use_tqdm=False)
    _check(model, outputs)


def test_fused_triton_kernel_end_to_end(tiny: dict[str, TinyModel]) -> None:
    """The interpreted fused MoE kernel in mixed prefill/decode batches (Qwen2-MoE: routed and
    shared experts)."""
    model = tiny["qwen2_moe"]
    with model.llm(max_num_batched_tokens=4, max_num_seqs=2,
                   backend_options={"kernels": "triton"}) as llm:  # fmt: skip
        assert llm._client.engine_core.backend.runner.ops.impl == "triton"
        outputs = llm.generate([PROMPTS[1], PROMPTS[2]], _params(max_tokens=2), use_tqdm=False)
    _check(model, outputs)


def test_configs_read_as_each_architecture_routes(tiny: dict[str, TinyModel]) -> None:
    from engine_core_cuda._hf_config import load_model_config

    qwen3 = load_model_config(tiny["qwen3_moe"].path)
    assert qwen3.moe is not None and qwen3.qk_norm
    assert (qwen3.moe.num_experts, qwen3.moe.top_k, qwen3.moe.intermediate_size) == (4, 2, 32)
    assert qwen3.moe.renormalize and qwen3.moe.sparse_layers == (0,)  # layer 1 dense
    qwen2 = load_model_config(tiny["qwen2_moe"].path)
    assert qwen2.moe is not None and qwen2.qkv_bias and not qwen2.moe.renormalize
    assert qwen2.moe.shared_expert_intermediate_size == 48
    mixtral = load_model_config(tiny["mixtral"].path)
    assert mixtral.moe is not None and mixtral.moe.renormalize
    assert mixtral.moe.prefix == "block_sparse_moe" and mixtral.moe.weight_names[0] == "w1"


def test_each_routing_feature_matters(tiny: dict[str, TinyModel], tmp_path: Path) -> None:
    """Without renormalisation (Qwen3-MoE) the engine's logprobs part from transformers': the
    parity test would catch a router that ignored ``norm_topk_prob``."""
    model = tiny["qwen3_moe"]
    copy = edited_copy(model.path, tmp_path / "no-renorm", {"norm_topk_prob": False})
    options = {"device": "cpu", "kernels": "torch"}
    with LLM(model=str(copy), backend="cuda", backend_options=options, max_model_len=256,
             num_kv_blocks=96) as llm:  # fmt: skip
        out = llm.generate([PROMPTS[1]], _params(max_tokens=1), use_tqdm=False)[0]
    tokens = [*out.prompt_token_ids, *out.outputs[0].token_ids]
    reference = log_softmax(model.hf, tokens)[len(out.prompt_token_ids) - 1]
    assert out.outputs[0].logprobs is not None
    token = out.outputs[0].token_ids[0]
    assert abs(out.outputs[0].logprobs[0][token].logprob - float(reference[token])) > 1e-3


@pytest.mark.parametrize(
    ("field", "value"),
    [("scoring_func", "expert_choice"), ("topk_method", "noaux_tc"), ("n_group", 8),
     ("num_experts_per_tok", 9)],
)  # fmt: skip
def test_unsupported_moe_fields_are_refused_by_name(
    tiny: dict[str, TinyModel], tmp_path: Path, field: str, value: object
) -> None:
    from engine_core_cuda._hf_config import load_model_config

    copy = edited_copy(tiny["qwen3_moe"].path, tmp_path / field, {field: value})
    with pytest.raises(ValueError, match=field) as info:
        load_model_config(copy)
    assert repr(value) in str(info.value) or str(value) in str(info.value)
    assert "supported" in str(info.value) or "exceeds" in str(info.value)


def test_router_softmax_sigmoid_and_renormalisation() -> None:
    from engine_core_cuda.kernels.moe_torch import route_topk

    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 0.0, 1.0]])
    weights, ids = route_topk(logits, 2)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[0, 2], [1, 3]]
    assert torch.allclose(weights, probs.gather(1, ids))
    weights, _ = route_topk(logits, 2, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(2))
    weights, ids = route_topk(logits, 2, scoring="sigmoid")
    assert torch.allclose(weights, torch.sigmoid(logits).gather(1, ids))
    weights, _ = route_topk(logits, 2, scoring="sigmoid", renormalize=True)
    expected = torch.sigmoid(logits).gather(1, ids)
    assert torch.allclose(weights, expected / expected.sum(-1, keepdim=True))


def test_checkpoint_names_per_expert(tiny: dict[str, TinyModel]) -> None:
    """The published per-expert names are what the tiny checkpoints hold, and every one of
    them maps into the stacked weights."""
    model = tiny["mixtral"]
    index = model.path / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(index), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert json.loads((model.path / "config.json").read_text())["num_local_experts"] == 4
