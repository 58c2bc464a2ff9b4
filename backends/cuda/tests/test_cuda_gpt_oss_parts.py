"""The parts of gpt-oss that do not need KV-cache groups, against transformers' own modules: the
router with a bias (softmax over the top-k logits = renormalised softmax), the experts' clamped
SwiGLU with biases (torch reference and the interpreted fused kernel), and MXFP4 dequantisation
of the published expert weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from engine_core_cuda._mxfp4 import dequantize_mxfp4
from engine_core_cuda.kernels.fused_moe import fused_moe
from engine_core_cuda.kernels.moe_torch import fused_moe_torch, route_topk
from tiny_models import TinyModel


def _gpt_oss_block(seed: int = 0):  # noqa: ANN202 (transformers' modules)
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    config = GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                          num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=64)  # fmt: skip
    torch.manual_seed(seed)
    router, experts = GptOssTopKRouter(config).eval(), GptOssExperts(config).eval()
    with torch.no_grad():
        for module in (router, experts):
            for param in module.parameters():
                param.normal_(0.0, 0.3)
    return config, router, experts


def _stacked(experts) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """transformers' interleaved ``gate_up_proj`` ``[E, H, 2I]`` (gate at even columns) as the
    backend's ``w13`` ``[E, 2I, H]`` (gate rows, then up rows), and ``down_proj`` ``[E, I, H]``
    as ``w2`` ``[E, H, I]``."""
    gate_up = experts.gate_up_proj.detach().transpose(1, 2)
    bias = experts.gate_up_proj_bias.detach()
    return {
        "w13": torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1).contiguous(),
        "b13": torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1).contiguous(),
        "w2": experts.down_proj.detach().transpose(1, 2).contiguous(),
        "b2": experts.down_proj_bias.detach().contiguous(),
    }


def test_router_bias_and_clamped_swiglu_experts_equal_transformers() -> None:
    config, router, experts = _gpt_oss_block()
    x = 2.0 * torch.randn(7, config.hidden_size)
    with torch.no_grad():
        _, hf_scores, hf_ids = router(x)
        expected = experts(x, hf_ids, hf_scores)
    logits = F.linear(x, router.weight, router.bias)
    weights, ids = route_topk(logits, config.num_experts_per_tok, renormalize=True)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_scores, atol=1e-6, rtol=1e-6)
    w = _stacked(experts)
    # the clamp matters on these inputs: some gate/up values exceed the limit
    pre = torch.einsum("th,eih->tei", x, w["w13"]) + w["b13"]
    assert float(pre.abs().max()) > config.swiglu_limit
    kwargs = {"b13": w["b13"], "b2": w["b2"], "swiglu_alpha": config.swiglu_alpha,
              "swiglu_limit": config.swiglu_limit}  # fmt: skip
    ref = fused_moe_torch(x, w["w13"], w["w2"], weights, ids, "swigluoai", **kwargs)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)
    got = fused_moe(x, w["w13"], w["w2"], weights, ids, "swigluoai", **kwargs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_router_module_with_a_bias(tiny: dict[str, TinyModel]) -> None:
    from engine_core_cuda._hf_config import load_model_config
    from engine_core_cuda._moe import SparseMoeBlock

    config = load_model_config(tiny["qwen3_moe"].path)
    assert config.moe is not None
    moe = dataclasses.replace(config.moe, router_bias=True)
    block = SparseMoeBlock(dataclasses.replace(config, moe=moe), torch.float32,
                           torch.device("cpu"))  # fmt: skip
    assert block.gate.bias is not None
    assert "model.layers.0.mlp.gate.bias" in block.checkpoint_targets("model.layers.0.mlp")
    with torch.no_grad():
        block.gate.weight.normal_()
        block.gate.bias.copy_(torch.tensor([0.0, 0.0, 100.0, 0.0]))  # expert 2 always chosen
    _, ids = block.gate(torch.randn(5, config.hidden_size))
    assert torch.all((ids == 2).any(dim=1))


@pytest.mark.parametrize("shape", [(3, 8, 2), (2, 4, 5, 1)])
def test_mxfp4_dequantisation_equals_transformers(shape: tuple[int, ...]) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(sum(shape))
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 134, shape, generator=gen, dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got.shape == (*shape[:-1], shape[-1] * 32)
    if len(shape) == 3:  # transformers' helper: [E, rows, groups, 16] -> [E, in, out]
        expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(got, expected.transpose(1, 2))
    # one value by hand: code 0x3 (1.5) low nibble, 0xA (-1.0) high nibble, scale 2 ** 1
    one = dequantize_mxfp4(torch.full((1, 1, 16), 0xA3, dtype=torch.uint8),
                           torch.full((1, 1), 128, dtype=torch.uint8), torch.float32)  # fmt: skip
    assert one[0, :2].tolist() == [3.0, -2.0]
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales.flatten())
