"""gpt-oss (``GptOssForCausalLM``) end to end against transformers (float32), beyond what
``test_cuda_windowed_models`` (batched greedy + logprobs, chunked prefill across the window's
edge, each feature shown to matter) and ``test_cuda_kv_groups_engine`` (window blocks released
through the engine core's KV-cache groups) check: its config (YaRN RoPE, alternating layers,
sinks, biases, experts), the interpreted Triton kernels (sinks in the windowed attention, the
clamped SwiGLU in the fused MoE kernel), and an MXFP4 checkpoint written here (the published
format: ``…_blocks``/``…_scales`` and ``quant_method: mxfp4``) loading as its dequantised
weights."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from engine_core_cuda._mxfp4 import FP4_E2M1_VALUES, dequantize_mxfp4
from hf_reference import PROMPTS
from test_cuda_windowed_models import _check, _params
from tiny_models import WINDOW, TinyModel


def test_config(tiny: dict[str, TinyModel]) -> None:
    from engine_core_cuda._hf_config import load_model_config

    config = load_model_config(tiny["gpt_oss"].path)
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert config.sliding_window == WINDOW and config.attention_sinks
    assert config.qkv_bias and config.o_bias and not config.mxfp4_experts
    rope = config.rope
    assert (rope.scaling, rope.factor, rope.original_max_position_embeddings) == ("yarn", 8.0, 64)
    assert not rope.truncate
    assert rope.attention_factor == pytest.approx(0.1 * math.log(8.0) + 1.0)
    moe = config.moe
    assert moe is not None and moe.stacked and moe.router_bias and moe.renormalize
    assert moe.activation == "swigluoai" and moe.sparse_layers == (0, 1, 2, 3)
    assert (moe.swiglu_alpha, moe.swiglu_limit) == (1.702, 7.0)


def test_yarn_tables_equal_transformers(tiny: dict[str, TinyModel]) -> None:
    from engine_core_cuda._hf_config import load_model_config
    from engine_core_cuda._rope import RotaryTables

    config = load_model_config(tiny["gpt_oss"].path)
    for truncate in (False, True):
        rope = config.rope.__class__(**{**_fields(config.rope), "truncate": truncate})
        tables = RotaryTables(rope, config.head_size, 300, torch.float32, torch.device("cpu"))
        hf_config = copy.deepcopy(tiny["gpt_oss"].hf.config)
        hf_config.rope_parameters = {**hf_config.rope_parameters, "truncate": truncate}
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

        cos, sin = GptOssRotaryEmbedding(hf_config)(torch.zeros(1), torch.arange(300)[None])
        half = config.head_size // 2
        torch.testing.assert_close(tables.cos[:, :half], cos[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(tables.sin[:, half:], sin[0], atol=1e-6, rtol=1e-6)


def _fields(rope: object) -> dict[str, object]:
    return {name: getattr(rope, name) for name in rope.__slots__}  # type: ignore[attr-defined]


def test_triton_kernels_end_to_end(tiny: dict[str, TinyModel]) -> None:
    model = tiny["gpt_oss"]
    with model.llm(block_size=4, max_num_batched_tokens=16, max_num_seqs=2,
                   backend_options={"kernels": "triton"}) as llm:  # fmt: skip
        assert llm._client.engine_core.backend.runner.ops.impl == "triton"
        # a prefill chunk beside a decode, then decodes past the window
        outputs = llm.generate([PROMPTS[0], PROMPTS[4]], _params(max_tokens=3), use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outputs) > 2 * WINDOW
    _check(model, outputs)


def _to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[*rows, in]`` float -> MXFP4 (blocks ``[*rows, in / 32, 16]``, scales ``[*rows, in /
    32]``): per group of 32 the power of two that brings its largest magnitude to at most 6,
    then the nearest e2m1 value."""
    groups = weight.reshape(*weight.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp_min(2.0**-60)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    lut = torch.tensor(FP4_E2M1_VALUES)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def _mxfp4_checkpoint(model: TinyModel, target: Path, drop: str | None = None) -> torch.nn.Module:
    """A copy of the tiny gpt-oss with its experts in MXFP4; returns the transformers model
    with the dequantised experts."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model.path, target)
    tensors = load_file(str(target / "model.safetensors"))
    hf = copy.deepcopy(model.hf)
    for i, layer in enumerate(hf.model.layers):
        experts = layer.mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = _to_mxfp4(tensors.pop(name).transpose(1, 2))  # [E, out, in]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            dequantised = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2)
            with torch.no_grad():
                getattr(experts, proj).copy_(dequantised)
    if drop is not None:
        del tensors[drop]
    save_file(tensors, str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (target / "config.json").write_text(json.dumps(config))
    return hf


def test_an_mxfp4_checkpoint_loads_its_dequantised_experts(
    tiny: dict[str, TinyModel], tmp_path: Path
) -> None:
    source = tiny["gpt_oss"]
    quantised = TinyModel.__new__(TinyModel)
    quantised.kind, quantised.path = "gpt_oss", tmp_path / "gpt_oss_mxfp4"
    quantised.hf = _mxfp4_checkpoint(source, quantised.path)
    original = source.hf.model.layers[0].mlp.experts.gate_up_proj
    changed = quantised.hf.model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(original, changed)  # the MXFP4 rounding is visible
    with quantised.llm() as llm:
        lm = llm._client.engine_core.backend.runner.model
        experts = lm.model.layers[0].mlp.experts
        hf_gate_up = changed.detach().transpose(1, 2)  # [E, 2I, H], gate and up interleaved
        assert torch.equal(experts.w13[:, :32], hf_gate_up[:, 0::2])
        assert torch.equal(experts.w13[:, 32:], hf_gate_up[:, 1::2])
        down = quantised.hf.model.layers[0].mlp.experts.down_proj.detach()
        assert torch.equal(experts.w2, down.transpose(1, 2))
        outputs = llm.generate(PROMPTS[1:4], _params(prompt_logprobs=1), use_tqdm=False)
    _check(quantised, outputs)


def test_an_mxfp4_tensor_without_its_scales_is_refused(
    tiny: dict[str, TinyModel], tmp_path: Path
) -> None:
    from engine_core_cuda._hf_config import load_model_config
    from engine_core_cuda._loader import load_weights
    from engine_core_cuda._model import CausalLM

    path = tmp_path / "broken"
    _mxfp4_checkpoint(tiny["gpt_oss"], path, drop="model.layers.1.mlp.experts.down_proj_scales")
    config = load_model_config(path)
    assert config.mxfp4_experts
    model = CausalLM(config, 64, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="down_proj_blocks without its other half"):
        load_weights(model, path)


def test_the_model_writes_back_the_checkpoint_it_loaded(tiny: dict[str, TinyModel]) -> None:
    """The loaded weights under their checkpoint names, the stacked experts re-interleaved into
    the checkpoint's layout, are the checkpoint (what a test or benchmark saves to reload)."""
    from engine_core_cuda._hf_config import load_model_config
    from engine_core_cuda._loader import (
        checkpoint_tensors,
        load_weights,
        stacked_checkpoint_tensors,
    )
    from engine_core_cuda._model import CausalLM
    from safetensors.torch import load_file

    path = tiny["gpt_oss"].path
    model = CausalLM(load_model_config(path), 64, torch.float32, torch.device("cpu"))
    load_weights(model, path)
    stacked = stacked_checkpoint_tensors(model)
    assert "model.layers.1.mlp.experts.gate_up_proj_bias" in stacked
    written = checkpoint_tensors(model) | stacked
    on_disk = load_file(str(path / "model.safetensors"))
    if model.config.tie_word_embeddings:
        on_disk.pop("lm_head.weight", None)
    assert sorted(written) == sorted(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(written[name], tensor), name


def test_an_fp8_checkpoint_is_refused(tiny: dict[str, TinyModel], tmp_path: Path) -> None:
    from engine_core_cuda._hf_config import load_model_config
    from tiny_models import edited_copy

    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    path = edited_copy(tiny["gpt_oss"].path, tmp_path / "fp8", {"quantization_config": fp8})
    with pytest.raises(ValueError, match="an FP8 checkpoint of GptOssForCausalLM"):
        load_model_config(path)
    assert load_model_config(tiny["gpt_oss"].path, quantization="fp8").quantization is not None


def _fp8_logits(
    path: Path, quantization: str | None
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The last-position logits of a prefill of four prompts (the same inputs either way: a
    decode step would feed each model its own greedy choice), and the first layer's experts
    (copies)."""
    from engine_core_cuda import CudaBackend
    from test_cuda_tp import CPU, _steps

    from engine_core.config import EngineConfig

    config = EngineConfig(model=str(path), backend="cuda", backend_options=CPU, dtype="float32",
                          max_model_len=256, quantization=quantization)  # fmt: skip
    prompts = [[5 + i, 40 + 3 * i, 7, 100 + i, 9, 60 - i, 11][: 3 + i] for i in range(4)]
    backend = CudaBackend(config)
    try:
        backend.initialize_kv_cache(16)
        found = []
        for out in _steps([[i * 4 + b for b in range(4)] for i in range(4)], prompts, 0):
            backend.execute_model(out)
            forward = backend.runner._forward
            assert forward is not None and forward.logits is not None
            found.append(forward.logits.clone())
            backend.sample_tokens(None)
        experts = backend.runner.model.model.layers[0].mlp.experts
        return found, {name: p.detach().clone() for name, p in experts.named_parameters()}
    finally:
        backend.close()


@pytest.mark.parametrize("source", ["float32", "mxfp4"])
def test_fp8_experts_follow_the_unquantised_model(
    tiny: dict[str, TinyModel], tmp_path: Path, source: str
) -> None:
    """``quantization="fp8"``: the stacked experts (from float32, or MXFP4 dequantised first)
    are quantised per row as they load, with their biases and the sinks kept; the logits stay
    within cosine 0.99 of the unquantised model's (its matrices halved, as in ``test_cuda_fp8``:
    the tiny models' gain amplifies FP8's rounding)."""
    from engine_core_cuda._fp8 import FP8_DTYPE, quantize_rows
    from test_cuda_fp8 import _halved

    path = _halved(tiny["gpt_oss"], tmp_path / "halved")
    if source == "mxfp4":
        halved = TinyModel.__new__(TinyModel)
        halved.kind, halved.path, halved.hf = "gpt_oss", path, tiny["gpt_oss"].hf
        path = tmp_path / "gpt_oss_mxfp4"
        _mxfp4_checkpoint(halved, path)
    plain, reference = _fp8_logits(path, None)
    quantised, experts = _fp8_logits(path, "fp8")
    assert experts["w13"].dtype == experts["w2"].dtype == FP8_DTYPE
    assert torch.equal(experts["b13"], reference["b13"]) and experts["b13"].abs().sum() > 0
    for name in ("w13", "w2"):  # the same rows, quantised as they load
        codes, scales = quantize_rows(reference[name])
        assert torch.equal(experts[name].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(experts[f"{name}_scale"], scales)
    for a, b in zip(plain, quantised, strict=True):
        assert min(torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()) >= 0.99


def test_the_sinks_matter(tiny: dict[str, TinyModel], tmp_path: Path) -> None:
    """The same checkpoint with every sink logit at -1e4 (no sinks) parts from transformers."""
    from safetensors.torch import load_file, save_file
    from test_cuda_windowed_models import LOGPROB_TOL, _worst_logprob_error

    source = tiny["gpt_oss"]
    edited = TinyModel.__new__(TinyModel)
    edited.kind, edited.path, edited.hf = "gpt_oss", tmp_path / "no_sinks", source.hf
    shutil.copytree(source.path, edited.path)
    tensors = load_file(str(edited.path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".sinks")]:
        tensors[name] = torch.full_like(tensors[name], -1e4)
    save_file(tensors, str(edited.path / "model.safetensors"))
    with edited.llm() as llm:
        outputs = llm.generate(PROMPTS[3:4], _params(prompt_logprobs=1), use_tqdm=False)
    assert _worst_logprob_error(edited, outputs[0]) > 100 * LOGPROB_TOL


def test_the_published_gpt_oss_20b_config(tmp_path: Path) -> None:
    """openai/gpt-oss-20b's config.json as published (MXFP4, ``rope_scaling``, no
    ``swiglu_alpha``): its geometry, and its YaRN tables equal transformers' (default
    ``GptOssConfig`` is that model)."""
    from engine_core_cuda._hf_config import load_model_config
    from engine_core_cuda._rope import RotaryTables
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    published = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
        "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
        "num_local_experts": 32, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                                "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
                                "quant_method": "mxfp4"},
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn",
                         "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
        "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(published))
    config = load_model_config(tmp_path)
    assert config.mxfp4_experts and config.quantization is None
    assert config.moe is not None and (config.moe.num_experts, config.moe.top_k) == (32, 4)
    assert config.sliding_window == 128 and config.layer_attention(0).window == 128
    assert config.layer_attention(1).window is None
    tables = RotaryTables(config.rope, 64, 5000, torch.float32, torch.device("cpu"))
    cos, sin = GptOssRotaryEmbedding(GptOssConfig())(torch.zeros(1), torch.arange(5000)[None])
    torch.testing.assert_close(tables.cos[:, :32], cos[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(tables.sin[:, 32:], sin[0], atol=1e-6, rtol=1e-6)
