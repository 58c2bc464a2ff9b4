"""FP8 weights on the CPU (dequantised matmul, activations quantised per token as on a GPU):
``quantization="fp8"`` on 32-bit checkpoints (dense and MoE) keeps the last-position logits
within cosine 0.99 of the unquantised model; compressed-tensors FP8 checkpoints written here
(per-channel and per-tensor ``weight_scale``, the real ``quantization_config`` block) load their
FP8 weights and scales as published; a DeepSeek-style block-wise ``fp8`` checkpoint loads
within FP8 error; unserved quantisations are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_core_cuda import CudaBackend
from hf_reference import PROMPTS
from tiny_models import TinyModel

from engine_core.abc import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams

QUANTISED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
             "w1", "w2", "w3")  # fmt: skip
"""The checkpoint matrices an FP8 checkpoint holds in FP8 (the LM head and routers stay)."""


def _backend(path: Path, **fields: Any) -> CudaBackend:
    config = EngineConfig(model=str(path), backend="cuda", max_model_len=128, block_size=16,
                          backend_options={"device": "cpu", "kernels": "torch"}, **fields)  # fmt: skip
    backend = CudaBackend(config)
    backend.initialize_kv_cache(32)
    return backend


def _last_logits(backend: CudaBackend, prompts: list[list[int]]) -> torch.Tensor:
    """Float32 logits of each prompt's last position, all prompts prefilled in one step."""
    news = [NewRequestData(f"r{i}", p, SamplingParams(temperature=0.0), [2 * i, 2 * i + 1], 0,
                           len(p)) for i, p in enumerate(prompts)]  # fmt: skip
    backend.execute_model(SchedulerOutput(news, CachedRequestData(), sum(map(len, prompts))))
    forward = backend.runner._forward
    assert forward is not None and forward.logits is not None
    logits = forward.logits.clone()
    backend.sample_tokens(None)
    return logits


def _prompts(model: TinyModel) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model.path / "tokenizer.json"))
    return [tokenizer.encode(p).ids[:30] for p in PROMPTS if tokenizer.encode(p).ids]


def _cosines(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()


def _logits(path: Path, prompts: list[list[int]], **fields: Any) -> torch.Tensor:
    backend = _backend(path, **fields)
    try:
        return _last_logits(backend, prompts)
    finally:
        backend.close()


def _halved(model: TinyModel, target: Path) -> Path:
    """A copy of ``model`` with its layers' matrices halved (std 0.06, three times HF's init):
    the tiny models' std of 0.12 gives every layer a gain far above a trained model's, which
    amplifies FP8's rounding (at full scale the tiny Qwen3's worst prompt is at cosine 0.98)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model.path, target)
    for path in target.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name, tensor in tensors.items():
            if tensor.dim() >= 2 and "embed_tokens" not in name and "lm_head" not in name:
                tensors[name] = tensor * 0.5
        save_file(tensors, str(path), metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_quantization_fp8_keeps_logits_within_cosine_099(
    tiny: dict[str, TinyModel], tmp_path: Path, kind: str
) -> None:
    model = tiny[kind]
    path = _halved(model, tmp_path / "halved")
    prompts = _prompts(model)
    full = _logits(path, prompts)
    backend = _backend(path, quantization="fp8")
    try:
        params = dict(backend.runner.model.named_parameters())
        assert params["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
        assert params["model.layers.0.self_attn.qkv_proj.weight_scale"].shape == (
            4 * 32 + 2 * 2 * 32,
        )
        if kind == "qwen3_moe":
            assert params["model.layers.0.mlp.experts.w13"].dtype == torch.float8_e4m3fn
            assert params["model.layers.0.mlp.experts.w13_scale"].shape == (4, 64)
            assert params["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # router
        assert params["lm_head.weight"].dtype == torch.float32
        quantised = _last_logits(backend, prompts)
    finally:
        backend.close()
    cosines = _cosines(full, quantised)
    assert min(cosines) >= 0.99, cosines
    assert not torch.equal(full, quantised)  # it did quantise


def _quantise(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 ``(q, weight_scale)`` the way compressed-tensors writes them."""
    if strategy == "tensor":
        scale = w.abs().amax().float() / 448.0
        return (w / scale).to(torch.float8_e4m3fn), scale.reshape(1)
    scale = w.abs().amax(dim=1, keepdim=True).float() / 448.0
    return (w / scale).to(torch.float8_e4m3fn), scale


def _block_quantise(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    scale = torch.empty(nr, nc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            scale[i, j] = tile.abs().amax() / 448.0
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scale[i, j]).to(
                torch.float8_e4m3fn
            )
    return q, scale


def _write_fp8_checkpoint(source: Path, target: Path, strategy: str,
                          quantization_config: dict[str, Any],
                          keep_experts: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """A copy of the model directory ``source`` whose quantised matrices are FP8 with their
    scales (``keep_experts``: the routed experts stay as they are); returns each FP8 matrix's
    dequantised value."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    dequantised: dict[str, torch.Tensor] = {}
    for path in sorted(target.glob("*.safetensors")):
        tensors = load_file(str(path))
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
            if module not in QUANTISED or (keep_experts and ".experts." in name):
                out[name] = tensor
                continue
            base = name.removesuffix(".weight")
            if strategy == "block":
                q, scale = _block_quantise(tensor, 16)
                out[f"{base}.weight_scale_inv"] = scale.contiguous()
                full = scale.repeat_interleave(16, 0)[: q.shape[0]].repeat_interleave(16, 1)
                dequantised[name] = q.float() * full[:, : q.shape[1]]
            else:
                q, scale = _quantise(tensor, strategy)
                out[f"{base}.weight_scale"] = scale.contiguous()
                out[f"{base}.input_scale"] = torch.tensor([0.02])  # static, unused
                dequantised[name] = q.float() * scale
            out[name] = q.contiguous()
        save_file(out, str(path), metadata={"format": "pt"})
    config_path = target / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config
    config_path.write_text(json.dumps(config))
    return dequantised


def _compressed_tensors_config(strategy: str) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": strategy,
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
            }  # fmt: skip
        },
    }


def _engine_dequantised(backend: CudaBackend) -> dict[str, torch.Tensor]:
    """The engine's FP8 weights times their scales, under their checkpoint names."""
    from engine_core_cuda._loader import _targets

    targets = _targets(backend.runner.model)
    out = {}
    for name, (param, start, rows) in targets.items():
        if name.endswith(".weight") and f"{name}_scale" in targets:
            scale_param, scale_start, _ = targets[f"{name}_scale"]
            q = param[start : start + rows].float()
            out[name] = q * scale_param[scale_start : scale_start + rows].float()[:, None]
    return out


@pytest.mark.parametrize(("kind", "strategy"), [("llama", "channel"), ("qwen3_moe", "tensor")])
def test_compressed_tensors_checkpoint_loads_as_published(
    tiny: dict[str, TinyModel], tmp_path: Path, kind: str, strategy: str
) -> None:
    model = tiny[kind]
    source = _halved(model, tmp_path / "halved")
    target = tmp_path / f"{kind}-fp8-{strategy}"
    dequantised = _write_fp8_checkpoint(source, target, strategy,
                                        _compressed_tensors_config(strategy))  # fmt: skip
    prompts = _prompts(model)
    backend = _backend(target)
    try:
        assert backend.runner.quantization is not None
        engine = _engine_dequantised(backend)
        assert set(engine) == set(dequantised)
        for name, value in dequantised.items():
            assert torch.equal(engine[name], value), name  # exactly the published values
        logits = _last_logits(backend, prompts)
    finally:
        backend.close()
    assert min(_cosines(_logits(source, prompts), logits)) >= 0.99


def test_experts_the_checkpoint_ignores_stay_unquantised(
    tiny: dict[str, TinyModel], tmp_path: Path
) -> None:
    model = tiny["qwen2_moe"]
    config = _compressed_tensors_config("channel")
    config["ignore"] = ["lm_head", "re:.*mlp.gate$", "re:.*mlp[.]experts[.]"]
    dequantised = _write_fp8_checkpoint(model.path, tmp_path / "ct", "channel", config,
                                        keep_experts=True)  # fmt: skip
    backend = _backend(tmp_path / "ct")
    try:
        params = dict(backend.runner.model.named_parameters())
        assert params["model.layers.0.mlp.experts.w13"].dtype == torch.float32
        assert params["model.layers.0.mlp.shared_expert.gate_up_proj.weight"].dtype == (
            torch.float8_e4m3fn
        )
        engine = _engine_dequantised(backend)
        assert set(engine) == set(dequantised)
        assert all(torch.equal(engine[n], v) for n, v in dequantised.items())
    finally:
        backend.close()
    config["ignore"] = ["lm_head", "re:.*experts[.]0[.]"]  # some experts of a block
    broken = tmp_path / "broken"
    _write_fp8_checkpoint(model.path, broken, "channel", config, keep_experts=True)
    with pytest.raises(ValueError, match="ignores only some of the experts"):
        _backend(broken)


def test_block_wise_fp8_checkpoint_loads_within_fp8_error(
    tiny: dict[str, TinyModel], tmp_path: Path
) -> None:
    model = tiny["qwen2_moe"]
    config = {"quant_method": "fp8", "activation_scheme": "dynamic",
              "weight_block_size": [16, 16], "modules_to_not_convert": ["lm_head"]}  # fmt: skip
    source = _halved(model, tmp_path / "halved")
    dequantised = _write_fp8_checkpoint(source, tmp_path / "block", "block", config)
    prompts = _prompts(model)
    backend = _backend(tmp_path / "block")
    try:
        assert backend.runner.quantization is not None
        assert backend.runner.quantization.block == (16, 16)
        engine = _engine_dequantised(backend)
        for name, value in dequantised.items():
            error = (engine[name] - value).norm() / value.norm()
            assert error < 0.05, (name, float(error))  # requantised per row: FP8's rounding
        logits = _last_logits(backend, prompts)
    finally:
        backend.close()
    assert min(_cosines(_logits(source, prompts), logits)) >= 0.99


@pytest.mark.parametrize(
    ("quantization_config", "field"),
    [({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
     ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format="),
     ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
         "num_bits": 4, "type": "int"}}}}, "config_groups.g.weights.num_bits=4"),
     ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size")],
)  # fmt: skip
def test_unserved_quantisation_is_refused_by_name(
    tiny: dict[str, TinyModel], tmp_path: Path, quantization_config: dict[str, Any], field: str
) -> None:
    from engine_core_cuda._hf_config import load_model_config
    from tiny_models import edited_copy

    copy = edited_copy(tiny["llama"].path, tmp_path / "q",
                       {"quantization_config": quantization_config})  # fmt: skip
    with pytest.raises(ValueError, match="quantization_config") as info:
        load_model_config(copy)
    assert field in str(info.value) and "supported" in str(info.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method='gptq'"),
     ({"scoring_func": "expert_choice"}, "scoring_func='expert_choice'")],
)  # fmt: skip
def test_startup_fails_naming_the_field(
    tiny: dict[str, TinyModel], tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    """The engine does not start on an unserved quantisation or MoE routing: the error names
    the field, its value and what is supported."""
    from tiny_models import edited_copy

    from engine_core import LLM

    copy = edited_copy(tiny["qwen3_moe"].path, tmp_path / "bad", changes)
    with pytest.raises(ValueError, match="supported") as info:
        LLM(model=str(copy), backend="cuda", backend_options={"device": "cpu"})
    assert message in str(info.value)


def test_per_token_quantisation_kernel_matches_torch() -> None:
    """The Triton kernel (interpreted) gives torch's scales exactly, and torch's FP8 codes
    except where Triton's interpreter mis-rounds a value just below a power of two (it drops
    the carry into the exponent: 124.8 becomes 64, not 128); on a GPU ``bench/gpu_check.py``
    (``fp8`` check) compares the codes exactly."""
    from engine_core_cuda._fp8 import quantize_rows
    from engine_core_cuda.kernels.fp8_quant import quantize_per_token

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 48, generator=gen) * torch.tensor([0.01, 1.0, 3.0, 100.0, 0.0])[:, None]
    q, scale = quantize_per_token(x)
    ref_q, ref_scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert torch.equal(scale, ref_scale)
    got, expected = q.float(), ref_q.float()
    carry_dropped = (got == expected / 2) & (torch.log2(expected.abs()) % 1 == 0)
    assert torch.all((got == expected) | carry_dropped)
    assert carry_dropped.float().mean() < 0.1
    assert torch.equal(q[4].float(), torch.zeros(48))  # a zero row stays zero, scale > 0
