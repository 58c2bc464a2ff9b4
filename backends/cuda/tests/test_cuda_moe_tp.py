"""Mixture-of-experts models under tensor parallelism on the CPU: the experts' (and the shared
expert's) intermediate dimension is sharded, every rank holds every expert, the block's sum is
all-reduced once. Two simulated ranks (threads) match TP=1 within float32 rounding; TP=2 over
gloo (a worker process) gives TP=1's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from engine_core_cuda import CudaBackend
from engine_core_cuda._hf_config import load_model_config
from engine_core_cuda._tp.shard import shard_model_config, slice_of
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


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_two_simulated_ranks_match_tp1(tiny: dict[str, TinyModel], kind: str) -> None:
    model = tiny[kind]
    config = EngineConfig(model=str(model.path), backend="cuda", backend_options=CPU,
                          dtype="float32", max_model_len=256)  # fmt: skip
    prompts = [[5 + i, 40 + 3 * i, 7, 100 + i, 9][: 2 + i] for i in range(3)]
    outputs = _steps([[i * 4 + b for b in range(4)] for i in range(3)], prompts, 3)
    assert_shards_match_tp1(config, 2, outputs)


def test_tp2_on_gloo_greedy_tokens_equal_tp1(tiny: dict[str, TinyModel]) -> None:
    model = tiny["qwen3_moe"]
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


def test_tp2_fp8_experts_on_gloo_follow_tp1(tiny: dict[str, TinyModel]) -> None:
    """``quantization="fp8"`` under TP=2 over gloo: each rank quantises its rows of the weights
    and experts (per-row scales: TP=1's codes) and its slice of the activations (per token and
    shard, so the row-parallel products round differently from TP=1's): logits within cosine
    0.99 of TP=1's."""
    model = tiny["qwen3_moe"]
    prompts = [[5 + i, 40 + 3 * i, 7, 100 + i, 9][: 2 + i] for i in range(3)]
    outputs = _steps([[i * 4 + b for b in range(4)] for i in range(3)], prompts, 2)
    config = EngineConfig(model=str(model.path), backend="cuda", backend_options=CPU,
                          dtype="float32", max_model_len=256, quantization="fp8")  # fmt: skip
    one = _logits(config, outputs)
    two = _logits(msgspec.structs.replace(config, tensor_parallel_size=2), outputs)
    for a, b in zip(one, two, strict=True):
        assert min(torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()) >= 0.99
