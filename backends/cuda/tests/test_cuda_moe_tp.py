"""Mixture-of-experts models under tensor parallelism on the CPU: the experts' (and the shared
expert's) intermediate dimension is sharded, every rank holds every expert, the block's sum is
all-reduced once. Two simulated ranks (threads) match TP=1 within float32 rounding; TP=2 over
gloo (a worker process) gives TP=1's greedy tokens. gpt-oss too: its stacked experts (also from
MXFP4), their biases and its attention sinks are sharded."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from engine_core_cuda import CudaBackend
from engine_core_cuda._hf_config import load_model_config
from engine_core_cuda._tp.shard import shard_model_config, slice_of, stacked_expert_part
from test_cuda_gpt_oss import _mxfp4_checkpoint
from test_cuda_tp import CPU, PROMPTS, _steps, assert_shards_match_tp1
from tiny_models import TinyModel, edited_copy

from engine_core import SamplingParams
from engine_core.abc import SchedulerOutput
from engine_core.config import EngineConfig


def test_moe_shard_geometry_slices_and_fields_that_do_not_divide(
    tiny: dict[str, TinyModel], tmp_path: Path
) -> None:
    full = load_model_config(tiny["qwen2_moe"].path)  # experts of 32, shared expert of 48
    local = shard_model_config(full, 2)
    assert local.moe is not None and full.moe is not None
    assert (local.moe.intermediate_size, local.moe.shared_expert_intermediate_size) == (16, 24)
    assert local.moe.num_experts == 4  # every rank holds every expert
    prefix = "model.layers.0.mlp"
    assert slice_of(f"{prefix}.experts.2.gate_proj.weight", 2, full, 1, 2).start == 16
    assert slice_of(f"{prefix}.experts.2.down_proj.weight", 2, full, 1, 2).dim == 1
    assert slice_of(f"{prefix}.shared_expert.up_proj.weight", 2, full, 1, 2).stop == 48
    assert slice_of(f"{prefix}.gate.weight", 2, full, 1, 2) is None  # the router: replicated
    assert slice_of(f"{prefix}.shared_expert_gate.weight", 2, full, 1, 2) is None
    mixtral = load_model_config(tiny["mixtral"].path)
    cut = slice_of("model.layers.1.block_sparse_moe.experts.0.w2.weight", 2, mixtral, 0, 2)
    assert cut is not None and (cut.dim, cut.stop) == (1, 16)
    odd = edited_copy(tiny["qwen3_moe"].path, tmp_path / "odd", {"moe_intermediate_size": 33})
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(33\) % tensor_parallel_size"):
        shard_model_config(load_model_config(odd), 2)


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral", "gpt_oss"])
def test_two_simulated_ranks_match_tp1(tiny: dict[str, TinyModel], kind: str) -> None:
    model = tiny[kind]
    config = EngineConfig(model=str(model.path), backend="cuda", backend_options=CPU,
                          dtype="float32", max_model_len=256)  # fmt: skip
    prompts = [[5 + i, 40 + 3 * i, 7, 100 + i, 9][: 2 + i] for i in range(3)]
    outputs = _steps([[i * 4 + b for b in range(4)] for i in range(3)], prompts, 3)
    assert_shards_match_tp1(config, 2, outputs)


def test_gpt_oss_parts_reassemble_its_stacked_experts_and_sinks(
    tiny: dict[str, TinyModel],
) -> None:
    """Each rank's part of the interleaved gate/up tensor is whole gate/up pairs of its
    intermediate slice; the down projection splits by its input rows and its bias is held once;
    the sinks split by heads."""
    experts, inter, hidden = 4, 32, 8
    gate = torch.randn(experts, hidden, inter)
    up = torch.randn(experts, hidden, inter)
    interleaved = torch.stack([gate, up], dim=-1).reshape(experts, hidden, 2 * inter)
    down, bias = torch.randn(experts, inter, hidden), torch.randn(experts, hidden)
    n = inter // 2
    for rank in range(2):
        own = stacked_expert_part("gate_up_proj", interleaved, rank, 2)
        assert torch.equal(own[..., 0::2], gate[..., rank * n : (rank + 1) * n])
        assert torch.equal(own[..., 1::2], up[..., rank * n : (rank + 1) * n])
        part = stacked_expert_part("down_proj", down, rank, 2)
        assert torch.equal(part, down[:, rank * n : (rank + 1) * n])
        pair_bias = stacked_expert_part("gate_up_proj_bias", interleaved[:, 0], rank, 2)
        assert torch.equal(pair_bias, interleaved[:, 0, 2 * rank * n : 2 * (rank + 1) * n])
    held = [stacked_expert_part("down_proj_bias", bias, rank, 2) for rank in range(2)]
    assert torch.equal(held[0] + held[1], bias) and not held[1].any()
    assert stacked_expert_part("down_proj", down, 0, 1) is down
    full = load_model_config(tiny["gpt_oss"].path)
    heads = full.num_heads // 2
    cut = slice_of("model.layers.2.self_attn.sinks", 1, full, 1, 2)
    assert cut is not None and (cut.dim, cut.start, cut.stop) == (0, heads, 2 * heads)
    assert slice_of("model.layers.2.mlp.router.bias", 1, full, 1, 2) is None  # replicated
    assert slice_of("model.layers.2.self_attn.o_proj.bias", 1, full, 1, 2) is None  # added once
    local = shard_model_config(full, 2)
    assert local.moe is not None and full.moe is not None
    assert local.moe.intermediate_size == full.moe.intermediate_size // 2


def test_an_mxfp4_gpt_oss_on_two_simulated_ranks_matches_tp1(
    tiny: dict[str, TinyModel], tmp_path: Path
) -> None:
    """The MXFP4 experts are dequantised whole, then each rank keeps its part."""
    path = tmp_path / "gpt_oss_mxfp4"
    _mxfp4_checkpoint(tiny["gpt_oss"], path)
    assert load_model_config(path).mxfp4_experts
    config = EngineConfig(model=str(path), backend="cuda", backend_options=CPU,
                          dtype="float32", max_model_len=256)  # fmt: skip
    prompts = [[5 + i, 40 + 3 * i, 7, 100 + i, 9][: 2 + i] for i in range(3)]
    outputs = _steps([[i * 4 + b for b in range(4)] for i in range(3)], prompts, 2)
    assert_shards_match_tp1(config, 2, outputs)


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_tp2_on_gloo_greedy_tokens_equal_tp1(tiny: dict[str, TinyModel], kind: str) -> None:
    model = tiny[kind]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    found = []
    for tp in (1, 2):
        with model.llm(tensor_parallel_size=tp, dtype="float32", multiprocess=False) as llm:
            outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        found.append([list(o.outputs[0].token_ids) for o in outs])
    assert found[0] == found[1]


def _logits(config: EngineConfig, outputs: list[SchedulerOutput]) -> list[torch.Tensor]:
    backend = CudaBackend(config)
    try:
        backend.initialize_kv_cache(16)
        experts = backend.runner.model.model.layers[0].mlp.experts
        assert experts.w13.dtype == torch.float8_e4m3fn and experts.w13_scale is not None
        found = []
        for out in outputs:
            backend.execute_model(out)
            forward = backend.runner._forward
            assert forward is not None and forward.logits is not None
            found.append(forward.logits.clone())
            backend.sample_tokens(None)
        return found
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_tp2_fp8_experts_on_gloo_follow_tp1(tiny: dict[str, TinyModel], kind: str) -> None:
    """``quantization="fp8"`` under TP=2 over gloo: each rank quantises its rows of the weights
    and experts (per-row scales: TP=1's codes) and its slice of the activations (per token and
    shard, so the row-parallel products round differently from TP=1's): logits within cosine
    0.99 of TP=1's."""
    model = tiny[kind]
    prompts = [[5 + i, 40 + 3 * i, 7, 100 + i, 9][: 2 + i] for i in range(3)]
    outputs = _steps([[i * 4 + b for b in range(4)] for i in range(3)], prompts, 2)
    config = EngineConfig(model=str(model.path), backend="cuda", backend_options=CPU,
                          dtype="float32", max_model_len=256, quantization="fp8")  # fmt: skip
    one = _logits(config, outputs)
    two = _logits(msgspec.structs.replace(config, tensor_parallel_size=2), outputs)
    for a, b in zip(one, two, strict=True):
        assert min(torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()) >= 0.99
