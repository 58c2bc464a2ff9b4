"""Each layer's kind of attention and RoPE as read from ``config.json``: both spellings of
Gemma 3's settings, the defaults of each architecture, and the startup errors that name the
field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from engine_core_cuda import CudaBackend
from engine_core_cuda._hf_config import RopeConfig, load_model_config
from engine_core_cuda._rope import inverse_frequencies
from tiny_models import WINDOW, TinyModel, edited_copy

from engine_core.config import EngineConfig


def _copy(model: TinyModel, tmp_path: Path, **changes: object) -> Path:
    return edited_copy(model.path, tmp_path / model.kind, changes)


def _backend(directory: Path) -> CudaBackend:
    options = {"device": "cpu", "kernels": "torch"}
    return CudaBackend(EngineConfig(model=str(directory), backend="cuda", backend_options=options))


def test_gemma3_reads_the_same_from_both_spellings(
    tiny: dict[str, TinyModel], tmp_path: Path
) -> None:
    model = tiny["gemma3"]
    published = load_model_config(model.path)  # rope_theta, rope_local_base_freq, pattern
    written = tmp_path / "new-spelling"
    model.hf.config.save_pretrained(written)  # rope_parameters per layer type, layer_types
    assert "rope_parameters" in json.loads((written / "config.json").read_text())
    current = load_model_config(written)
    assert dataclasses.replace(current, checkpoint_dtype="float32") == published
    assert published.rope == RopeConfig(100000.0, "linear", 2.0)
    assert published.local_rope == RopeConfig(1000.0)
    assert published.layer_types == ("sliding_attention",) * 2 + ("full_attention",) + (
        "sliding_attention",
    )
    assert (published.qk_norm, published.tie_word_embeddings, published.head_size) == (
        True, True, 32)  # fmt: skip
    assert published.attn_logit_softcapping is None  # Gemma 3 has none (transformers ignores it)


def test_gemma2_reads_the_same_from_both_spellings(
    tiny: dict[str, TinyModel], tmp_path: Path
) -> None:
    model = tiny["gemma2"]  # saved by transformers 5: rope_parameters, dtype
    config = json.loads((model.path / "config.json").read_text())
    assert "rope_parameters" in config and "rope_theta" not in config
    published = _copy(model, tmp_path, rope_parameters=None, dtype=None,
                      rope_theta=config["rope_parameters"]["rope_theta"],
                      torch_dtype=config["dtype"])  # fmt: skip
    assert load_model_config(published) == load_model_config(model.path)


def test_gemma3_ropes_per_layer_kind_equal_transformers(tiny: dict[str, TinyModel]) -> None:
    model = tiny["gemma3"]
    config = load_model_config(model.path)
    rotary = model.hf.model.rotary_emb
    for index, kind in enumerate(config.layer_types):
        expected = getattr(rotary, f"{kind}_inv_freq")
        assert torch.equal(inverse_frequencies(config.layer_rope(index), 32), expected), kind


def test_per_layer_attention_arguments(tiny: dict[str, TinyModel]) -> None:
    gemma2 = load_model_config(tiny["gemma2"].path)
    layers = [gemma2.layer_attention(i) for i in range(3)]
    assert [a.kind for a in layers] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert [a.window for a in layers] == [WINDOW, None, WINDOW]
    assert {a.scale for a in layers} == {24**-0.5} and {a.softcap for a in layers} == {4.0}
    assert gemma2.final_logit_softcapping == 6.0 and gemma2.hidden_act == "gelu_pytorch_tanh"
    llama = load_model_config(tiny["llama"].path)
    assert llama.layer_types == ("full_attention",) * 2
    assert llama.layer_attention(0).span is None and llama.layer_attention(0).scale == 16**-0.5


@pytest.mark.parametrize(
    ("kind", "changes", "layer_types"),
    [
        # Gemma 2 without layer_types alternates, window first (transformers' default).
        ("gemma2", {"layer_types": None}, ["sliding_attention", "full_attention"] * 2),
        ("mistral", {"sliding_window": None}, ["full_attention"] * 2),
        ("gemma3", {"sliding_window_pattern": None}, ["sliding_attention"] * 4),  # pattern 6
        ("qwen2", {"sliding_window": 4, "use_sliding_window": False}, ["full_attention"] * 2),
    ],
)
def test_layer_types_defaults(
    tiny: dict[str, TinyModel], tmp_path: Path, kind: str, changes: dict[str, object],
    layer_types: list[str],
) -> None:  # fmt: skip
    config = load_model_config(_copy(tiny[kind], tmp_path, **changes))
    assert list(config.layer_types) == layer_types[: config.num_layers]


@pytest.mark.parametrize(
    ("kind", "changes", "message"),
    [
        ("gemma3", {"layer_types": ["full_attention"] * 3},
         "layer_types has 3 entries but num_hidden_layers is 4"),
        ("gemma2", {"layer_types": ["full_attention", "linear_attention", "full_attention"]},
         "has layer_types 'linear_attention'; supported: full_attention, sliding_attention"),
        ("gemma2", {"sliding_window": None}, "has sliding_attention layers but no sliding_window"),
        ("mistral", {"layer_types": ["chunked_attention"] * 2},
         "has chunked_attention layers but no attention_chunk_size"),
        ("mistral", {"sliding_window": 0}, "invalid sliding_window 0"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping -1.0"),
        ("qwen2", {"use_sliding_window": True}, "sets use_sliding_window"),
        ("llama", {"hidden_act": "relu"}, "hidden_act 'relu'; supported: silu, gelu_pytorch_tanh"),
    ],
)  # fmt: skip
def test_a_bad_layer_config_fails_at_startup_naming_the_field(
    tiny: dict[str, TinyModel], tmp_path: Path, kind: str, changes: dict[str, object],
    message: str,
) -> None:  # fmt: skip
    directory = _copy(tiny[kind], tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        _backend(directory)
