"""Reading HF model directories: both config spellings, sharded weights, and startup errors that
name what is wrong."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_core_cuda import CudaBackend
from engine_core_cuda._hf_config import RopeConfig, load_model_config
from engine_core_cuda._rope import inverse_frequencies
from tiny_models import TinyModel

from engine_core.config import EngineConfig


def _copy(model: TinyModel, tmp_path: Path) -> Path:
    target = tmp_path / model.kind
    shutil.copytree(model.path, target)
    return target


def _edit_config(directory: Path, **changes: object) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _backend(directory: Path, **options: object) -> CudaBackend:
    return CudaBackend(
        EngineConfig(
            model=str(directory), backend="cuda", backend_options={"device": "cpu", **options}
        )
    )


def test_both_config_spellings_give_the_same_model(
    tiny: dict[str, TinyModel], tmp_path: Path
) -> None:
    new_style = tiny["llama"].path
    published = _copy(tiny["llama"], tmp_path)
    config = json.loads((new_style / "config.json").read_text())
    rope = dict(config["rope_parameters"])
    _edit_config(
        published,
        rope_parameters=None,
        dtype=None,
        rope_theta=rope.pop("rope_theta"),
        rope_scaling=rope,
        torch_dtype="bfloat16",
    )
    a, b = load_model_config(new_style), load_model_config(published)
    assert a.rope == b.rope == RopeConfig(10000.0, "llama3", 4.0, 1.0, 4.0, 64)
    assert (a.checkpoint_dtype, b.checkpoint_dtype) == ("float32", "bfloat16")
    assert dataclasses.replace(b, checkpoint_dtype="float32") == a


def test_architecture_flags(tiny: dict[str, TinyModel]) -> None:
    llama = load_model_config(tiny["llama"].path)
    qwen2 = load_model_config(tiny["qwen2"].path)  # the published spelling
    qwen3 = load_model_config(tiny["qwen3"].path)
    assert (llama.tie_word_embeddings, llama.qkv_bias, llama.qk_norm) == (True, False, False)
    assert (qwen2.tie_word_embeddings, qwen2.qkv_bias, qwen2.o_bias) == (False, True, False)
    assert (qwen2.rope.theta, qwen2.checkpoint_dtype) == (1000.0, "float32")
    assert (qwen3.qk_norm, qwen3.head_size, qwen3.num_kv_heads) == (True, 32, 2)


def test_llama3_rope_scaling_matches_transformers(tiny: dict[str, TinyModel]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = tiny["llama"].hf.config
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    got = inverse_frequencies(load_model_config(tiny["llama"].path).rope, 16)
    assert torch.equal(got, expected)
    assert not torch.equal(got, inverse_frequencies(RopeConfig(10000.0), 16))


def test_an_unsupported_architecture_fails_at_startup(
    tiny: dict[str, TinyModel], tmp_path: Path
) -> None:
    directory = _copy(tiny["llama"], tmp_path)
    _edit_config(directory, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"architecture GPT2LMHeadModel in .* is not supported; "
                       r"supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):  # fmt: skip
        _backend(directory)


def test_an_unsupported_rope_scaling_fails_at_startup(
    tiny: dict[str, TinyModel], tmp_path: Path
) -> None:
    directory = _copy(tiny["qwen2"], tmp_path)
    _edit_config(directory, rope_scaling={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(ValueError, match="uses RoPE scaling 'longrope'; supported: default, lin"):
        _backend(directory)
    _edit_config(directory, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="YaRN RoPE without a valid original_max_position_emb"):
        _backend(directory)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_a_missing_file_fails_at_startup(
    tiny: dict[str, TinyModel], tmp_path: Path, name: str
) -> None:
    directory = _copy(tiny["llama"], tmp_path)
    (directory / name).unlink()
    message = "has no weights" if name == "model.safetensors" else f"has no {name}"
    with pytest.raises(FileNotFoundError, match=message):
        _backend(directory)


def test_a_missing_shard_is_named(tiny: dict[str, TinyModel], tmp_path: Path) -> None:
    directory = _copy(tiny["qwen3"], tmp_path)
    shards = sorted(directory.glob("model-*.safetensors"))
    assert len(shards) > 2  # the tiny Qwen3 is saved in shards with an index
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=f"lacks the shard.* {shards[1].name}"):
        _backend(directory)


def test_a_missing_weight_is_named(tiny: dict[str, TinyModel], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    directory = _copy(tiny["qwen2"], tmp_path)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError, match="lacks weight.* model.layers.1.self_attn.k_proj.bias"):
        _backend(directory)


def test_dummy_weights_need_only_the_config(tiny: dict[str, TinyModel], tmp_path: Path) -> None:
    directory = tmp_path / "config-only"
    directory.mkdir()
    shutil.copy(tiny["qwen3"].path / "config.json", directory)
    backend = _backend(directory, load_format="dummy")
    try:
        weight = backend.runner.model.model.layers[0].mlp.down_proj.weight
        assert 0.015 < float(weight.std()) < 0.025
    finally:
        backend.close()


def test_unknown_and_invalid_options_are_rejected(tiny: dict[str, TinyModel]) -> None:
    with pytest.raises(ValueError, match=r"unknown cuda backend_options \['colour'\]"):
        _backend(tiny["llama"].path, colour="red")
    with pytest.raises(ValueError, match="backend_options\\['kernels'\\] must be one of"):
        _backend(tiny["llama"].path, kernels="flash")
    with pytest.raises(ValueError, match="backend_options\\['device'\\] must be 'cuda'"):
        _backend(tiny["llama"].path, device="tpu")
