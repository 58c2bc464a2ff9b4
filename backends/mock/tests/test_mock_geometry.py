"""The mock's options, its KV geometry (synthetic or from an HF config.json) and its provider."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
from engine_core_mock import MockBackend
from engine_core_mock._provider import provider

from engine_core import LLM, SamplingParams
from engine_core._engine.startup import size_kv_cache
from engine_core.abc import BackendProvider, KVCacheSpec
from engine_core.config import EngineConfig

GiB = 1 << 30

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def _model_dir(tmp_path: Path, config: dict[str, Any], shard_bytes: Sequence[int] = ()) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    for i, size in enumerate(shard_bytes, start=1):
        with open(tmp_path / f"model-{i:05d}-of-{len(shard_bytes):05d}.safetensors", "wb") as f:
            f.truncate(size)  # sparse: only the size matters
    return str(tmp_path)


# -- the synthetic model -------------------------------------------------------------------------


def test_synthetic_geometry() -> None:
    backend = MockBackend(EngineConfig())
    assert backend.kv_cache_spec() == KVCacheSpec(
        num_layers=32, num_kv_heads=8, head_size=128, dtype_bytes=2
    )
    assert backend.available_kv_cache_memory() == int(16 * GiB * 0.9)
    assert (backend.vocab_size(), backend.max_model_len()) == (258, None)


def test_vocab_is_the_tokenizers_unless_vocab_size_is_given(tmp_path: Path) -> None:
    """A mock serving an HF tokenizer samples only ids it can decode (it used to keep 32,000
    ids, most of which decode to nothing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["hello world", "say hello there"], trainer)
    directory = tmp_path / "tokenizer"
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    assert 258 < size <= 280
    assert MockBackend(EngineConfig(tokenizer=str(directory))).vocab_size() == size
    config = EngineConfig(tokenizer=str(directory), backend_options={"vocab_size": 1000})
    assert MockBackend(config).vocab_size() == 1000
    with LLM(backend="mock", tokenizer=str(directory)) as llm:
        out = llm.generate("hello", SamplingParams(max_tokens=8, seed=1), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1 and out[0].outputs[0].text


def test_options_override_the_geometry() -> None:
    options = {
        "vocab_size": 1000,
        "num_layers": 2,
        "num_kv_heads": 4,
        "head_size": 64,
        "dtype_bytes": 4,
        "device_memory_bytes": 1000,
        "weight_bytes": 100,
        "max_model_len": 4096,
    }
    backend = MockBackend(EngineConfig(backend_options=options, kv_cache_memory_fraction=0.5))
    assert backend.kv_cache_spec() == KVCacheSpec(
        num_layers=2, num_kv_heads=4, head_size=64, dtype_bytes=4
    )
    assert backend.available_kv_cache_memory() == 400
    assert (backend.vocab_size(), backend.max_model_len()) == (1000, 4096)


def test_dtype_of_the_engine_config_sets_the_kv_dtype() -> None:
    assert MockBackend(EngineConfig(dtype="float32")).kv_cache_spec().dtype_bytes == 4
    with pytest.raises(ValueError, match="dtype 'float13' is not a known dtype"):
        MockBackend(EngineConfig(dtype="float13"))


def test_unknown_options_are_named() -> None:
    with pytest.raises(ValueError, match=r"unknown mock backend_options \['colour', 'speed'\]"):
        MockBackend(EngineConfig(backend_options={"speed": 1, "colour": 2, "num_layers": 2}))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_layers": 0}, r"backend_options\['num_layers'\] must be an int >= 1, got 0"),
        ({"head_size": 1.5}, r"backend_options\['head_size'\] must be an int >= 1, got 1.5"),
        ({"weight_bytes": -1}, r"backend_options\['weight_bytes'\] must be an int >= 0, got -1"),
        ({"latency": {"step": 1}}, r"backend_options\['latency'\] has unknown key\(s\) \['step'\]"),
        ({"latency": {"step_s": -1}}, r"\['latency'\]\['step_s'\] must be a finite number >= 0"),
        ({"latency": 0.1}, r"backend_options\['latency'\] must be a dict"),
        ({"fault": {"kind": "raise"}}, "the keys 'kind' and 'at_step'"),
        ({"fault": {"kind": "raise", "at_step": 1, "when": 2}}, "the keys 'kind' and 'at_step'"),
        (
            {"fault": {"kind": "exit", "at_step": 1, "rank": -1}},
            r"\['rank'\] must be an int >= 0, got -1",
        ),
        ({"fault": {"kind": "melt", "at_step": 1}}, r"\['fault'\]\['kind'\] must be one of"),
        ({"fault": {"kind": "exit", "at_step": 0}}, r"\['at_step'\] must be an int >= 1, got 0"),
        ({"load_s": -1}, r"backend_options\['load_s'\] must be a finite number >= 0, got -1"),
        ({"load_s": "1"}, r"backend_options\['load_s'\] must be a finite number >= 0, got '1'"),
    ],
)
def test_bad_option_values_are_named(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MockBackend(EngineConfig(backend_options=options))


# -- an HF model directory -----------------------------------------------------------------------


def test_llama_8b_geometry_and_block_count_on_a_24_gib_device(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, LLAMA_8B, [4 * GiB] * 4)
    config = EngineConfig(
        model=model, max_model_len=32768, backend_options={"device_memory_bytes": 24 * GiB}
    )
    backend = MockBackend(config)
    spec = backend.kv_cache_spec()
    assert spec == KVCacheSpec(num_layers=32, num_kv_heads=8, head_size=128, dtype_bytes=2)
    assert (spec.page_size_bytes(16), spec.bytes_per_block(16)) == (65536, 2 * 1024 * 1024)
    assert (backend.vocab_size(), backend.max_model_len()) == (128256, 131072)
    # int(24 GiB * 0.9) - 16 GiB of weights = 6012954214 bytes = 2867 blocks of 2 MiB.
    assert backend.available_kv_cache_memory() == 6012954214
    num_blocks, resolved = size_kv_cache(config, backend)
    assert (num_blocks, resolved.max_model_len) == (2867, 32768)
    full_context = msgspec.structs.replace(config, max_model_len=131072)
    with pytest.raises(ValueError, match=r"holds 2867 blocks \(45872 tokens\) but one request"):
        size_kv_cache(full_context, backend)


def test_hf_defaults_for_kv_heads_and_head_dim(tmp_path: Path) -> None:
    hf = {
        "hidden_size": 768,
        "num_attention_heads": 12,
        "num_hidden_layers": 6,
        "dtype": "float32",
        "vocab_size": 50257,
    }
    backend = MockBackend(EngineConfig(model=_model_dir(tmp_path, hf)))
    assert backend.kv_cache_spec() == KVCacheSpec(
        num_layers=6, num_kv_heads=12, head_size=64, dtype_bytes=4
    )
    assert (backend.vocab_size(), backend.max_model_len()) == (50257, None)
    assert backend.available_kv_cache_memory() == int(16 * GiB * 0.9)


def test_text_config_of_a_multimodal_model(tmp_path: Path) -> None:
    hf = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": LLAMA_8B}
    backend = MockBackend(EngineConfig(model=_model_dir(tmp_path, hf)))
    assert backend.kv_cache_spec().num_kv_heads == 8
    assert backend.vocab_size() == 128256


def test_options_override_the_model_config(tmp_path: Path) -> None:
    options = {"num_layers": 2, "max_model_len": 1024, "vocab_size": 300}
    backend = MockBackend(
        EngineConfig(model=_model_dir(tmp_path, LLAMA_8B), backend_options=options)
    )
    assert backend.kv_cache_spec().num_layers == 2
    assert (backend.vocab_size(), backend.max_model_len()) == (300, 1024)


def test_missing_config_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"cannot read the model config {tmp_path}/config.json"):
        MockBackend(EngineConfig(model=str(tmp_path)))


def test_unparsable_config_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"cannot read the model config {tmp_path}/config.json"):
        MockBackend(EngineConfig(model=str(tmp_path)))


def test_config_json_without_layers_names_the_key(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, {"hidden_size": 64, "num_attention_heads": 4})
    with pytest.raises(ValueError, match="config.json has no valid 'num_hidden_layers'"):
        MockBackend(EngineConfig(model=model))


# -- the provider --------------------------------------------------------------------------------


def test_provider_describes_and_loads_the_mock() -> None:
    assert isinstance(provider, BackendProvider)
    assert (provider.name, provider.install_hint) == ("mock", "pip install engine-core-mock")
    assert provider.is_available() == (True, "deterministic CPU mock")
    assert provider.load() is MockBackend


def test_importing_the_provider_stays_light() -> None:
    script = (
        "import sys, engine_core_mock._provider; "
        "print(sorted(m for m in sys.modules if m.startswith('engine_core')))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.stdout.strip() == "['engine_core_mock', 'engine_core_mock._provider']"


def test_fp8_kv_cache_dtype_doubles_the_blocks(tmp_path: Path) -> None:
    """``kv_cache_dtype="fp8"``: one byte per element, so the same memory holds twice the
    blocks of the bf16 cache (2867 above)."""
    model = _model_dir(tmp_path, LLAMA_8B, [4 * GiB] * 4)
    config = EngineConfig(model=model, max_model_len=32768, kv_cache_dtype="fp8",
                          backend_options={"device_memory_bytes": 24 * GiB})  # fmt: skip
    backend = MockBackend(config)
    assert backend.kv_cache_spec().dtype_bytes == 1
    assert size_kv_cache(config, backend)[0] == 5734
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3'"):
        EngineConfig(kv_cache_dtype="int4")  # type: ignore[arg-type]
