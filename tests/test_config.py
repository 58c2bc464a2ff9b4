"""EngineConfig: defaults, validation naming the parameter, resolution, wire format."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from helpers import every_field

from engine_core.config import DEFAULT_MAX_MODEL_LEN, EngineConfig, SpeculativeConfig


def test_defaults() -> None:
    c = EngineConfig()
    assert every_field.typed(c) == every_field.typed(
        {
            "model": None,
            "tokenizer": None,
            "backend": "auto",
            "backend_options": {},
            "block_size": 16,
            "num_kv_blocks": None,
            "kv_cache_memory_fraction": 0.9,
            "max_model_len": None,
            "max_num_seqs": 256,
            "max_num_batched_tokens": None,
            "enable_chunked_prefill": True,
            "long_prefill_token_threshold": 0,
            "max_num_partial_prefills": 0,
            "max_long_partial_prefills": 0,
            "enable_prefix_caching": True,
            "preemption_victim": "least_progress",
            "max_bypass_steps": 64,
            "stall_timeout_s": 60.0,
            "scheduling_policy": "fcfs",
            "async_scheduling": None,
            "multiprocess": None,
            "engine_runtime": "asyncio",
            "step_timeout_s": 300.0,
            "engine_heartbeat_timeout_s": 10.0,
            "startup_timeout_s": 300.0,
            "grammar_compile_timeout_s": 10.0,
            "max_queued_requests": None,
            "max_n": 128,
            "max_stop_strings": 64,
            "max_stop_string_len": 1024,
            "seed": 0,
            "dtype": "auto",
            "quantization": None,
            "kv_cache_dtype": "auto",
            "tensor_parallel_size": 1,
            "data_parallel_size": 1,
            "data_parallel_rank": 0,
            "router": None,
            "router_balance_abs": None,
            "router_balance_rel": 1.0,
            "dp_failover": "retry",
            "dp_restart_engines": False,
            "dp_restart_wait_s": 60.0,
            "data_parallel_backend": "mp",
            "ray_address": None,
            "ray_placement_strategy": "SPREAD",
            "ray_gpus_per_engine": None,
            "ray_driver_host": None,
            "placement_timeout_s": 300.0,
            "speculative_config": None,
            "kv_offload_bytes": 0,
            "kv_connector": None,
            "kv_connector_options": {},
            "kv_load_failure_policy": "recompute",
            "kv_lease_s": 30.0,
            "kv_max_parked_fraction": 0.5,
            "enable_lora": False,
            "max_loras": 1,
            "max_lora_rank": 16,
            "max_cpu_loras": None,
            "engine_roles": None,
        },
    )
    assert c.router_policy == "prefix"
    assert EngineConfig(enable_prefix_caching=False).router_policy == "least_loaded"
    assert c.balance_abs == 128
    assert c.tokenizer_name == "byte"


def test_backend_options_are_not_shared() -> None:
    a = EngineConfig()
    a.backend_options["x"] = 1
    assert EngineConfig().backend_options == {}


@pytest.mark.parametrize(
    "name,value",
    [
        ("scheduling_policy", "lifo"),
        ("router", "random"),
        ("router_balance_abs", -1),
        ("router_balance_rel", 0.5),
        ("dp_failover", "ignore"),
        ("dp_restart_wait_s", 0),
        ("data_parallel_rank", 1),
        ("engine_runtime", "uvloop"),
        ("backend", ""),
        ("block_size", 0),
        ("block_size", -16),
        ("block_size", True),
        ("block_size", 16.5),
        ("num_kv_blocks", 0),
        ("max_model_len", 0),
        ("max_model_len", -1),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("step_timeout_s", 0.0),
        ("step_timeout_s", -1.0),
        ("step_timeout_s", float("nan")),
        ("engine_heartbeat_timeout_s", 0.0),
        ("engine_heartbeat_timeout_s", -1.0),
        ("engine_heartbeat_timeout_s", float("nan")),
        ("startup_timeout_s", 0),
        ("max_queued_requests", 0),
        ("max_n", 0),
        ("max_n", True),
        ("max_n", None),
        ("max_stop_strings", 0),
        ("max_stop_string_len", -1),
        ("tensor_parallel_size", 0),
        ("data_parallel_size", 0),
        ("kv_cache_memory_fraction", 0.0),
        ("kv_cache_memory_fraction", 1.01),
        ("long_prefill_token_threshold", -1),
        ("data_parallel_backend", "mpi"),
        ("ray_placement_strategy", "STRICT_PACK"),
        ("ray_gpus_per_engine", -1),
        ("ray_gpus_per_engine", True),
        ("placement_timeout_s", 0),
        ("quantization", "int4"),
        ("kv_cache_dtype", "fp16"),
    ],
)
def test_invalid_value_names_the_parameter(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must"):
        EngineConfig(**{name: value})


def test_batched_tokens_must_cover_max_num_seqs() -> None:
    with pytest.raises(
        ValueError, match=r"^max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"
    ):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)
    assert EngineConfig(max_num_seqs=16, max_num_batched_tokens=16).max_num_batched_tokens == 16


def test_without_chunked_prefill_a_whole_prompt_must_fit_a_step() -> None:
    with pytest.raises(
        ValueError,
        match=r"^max_num_batched_tokens \(1024\) must be >= max_model_len \(2048\) when "
        "enable_chunked_prefill is False",
    ):
        EngineConfig(enable_chunked_prefill=False, max_model_len=2048, max_num_batched_tokens=1024)
    EngineConfig(enable_chunked_prefill=True, max_model_len=2048, max_num_batched_tokens=1024)
    EngineConfig(enable_chunked_prefill=False, max_model_len=1024, max_num_batched_tokens=1024)


def test_backend_options_must_be_a_dict() -> None:
    with pytest.raises(TypeError, match="^backend_options must be a dict"):
        EngineConfig(backend_options=[("a", 1)])  # type: ignore[arg-type]


def test_gpus_per_engine() -> None:
    assert EngineConfig(backend="cuda", tensor_parallel_size=2).gpus_per_engine == 2
    assert EngineConfig(backend="mock", tensor_parallel_size=2).gpus_per_engine == 0
    assert EngineConfig(backend="mock", ray_gpus_per_engine=1).gpus_per_engine == 1
    assert EngineConfig(backend="cuda", ray_gpus_per_engine=0).gpus_per_engine == 0


def test_tokenizer_name() -> None:
    assert EngineConfig(model="/m").tokenizer_name == "/m"
    assert EngineConfig(model="/m", tokenizer="/t").tokenizer_name == "/t"
    assert EngineConfig(tokenizer="byte").tokenizer_name == "byte"


def test_resolved_fills_in_lengths() -> None:
    c = EngineConfig().resolved(model_max_len=None)
    assert (c.max_model_len, c.max_num_batched_tokens) == (DEFAULT_MAX_MODEL_LEN, 8192)
    c = EngineConfig().resolved(model_max_len=4096)
    assert (c.max_model_len, c.max_num_batched_tokens) == (4096, 8192)
    c = EngineConfig(max_num_seqs=10000).resolved(model_max_len=4096)
    assert c.max_num_batched_tokens == 10000
    c = EngineConfig(enable_chunked_prefill=False).resolved(model_max_len=32768)
    assert (c.max_model_len, c.max_num_batched_tokens) == (32768, 32768)
    c = EngineConfig(max_model_len=1000, max_num_batched_tokens=512).resolved(model_max_len=4096)
    assert (c.max_model_len, c.max_num_batched_tokens) == (1000, 512)


def test_resolved_rejects_what_the_model_cannot_do() -> None:
    with pytest.raises(
        ValueError, match=r"max_model_len \(8192\) exceeds the model's limit \(2048"
    ):
        EngineConfig(max_model_len=8192).resolved(model_max_len=2048)
    # Resolution validates again: an explicit budget below the resolved length is rejected.
    with pytest.raises(ValueError, match="^max_num_batched_tokens .* when enable_chunked_prefill"):
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=1024).resolved(
            model_max_len=None
        )


def test_from_kwargs() -> None:
    assert EngineConfig.from_kwargs(max_num_seqs=8).max_num_seqs == 8
    with pytest.raises(TypeError, match="unknown EngineConfig field.*: max_seqs, tp"):
        EngineConfig.from_kwargs(max_seqs=8, tp=2)


def test_msgpack_round_trip() -> None:
    c = every_field.instance(EngineConfig)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(c), type=EngineConfig)
    assert decoded == c
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(EngineConfig()), type=EngineConfig) == (
        EngineConfig()
    )


def test_decoding_validates() -> None:
    with pytest.raises(msgspec.ValidationError, match="scheduling_policy"):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode({"scheduling_policy": "lifo"}), type=EngineConfig
        )
    with pytest.raises(msgspec.ValidationError, match="max_num_seqs must be an int > 0"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"max_num_seqs": 0}), type=EngineConfig)


# -- speculative decoding --------------------------------------------------------------------------


def test_speculative_config_defaults_and_dict_conversion() -> None:
    c = EngineConfig(speculative_config={"num_speculative_tokens": 3})
    assert c.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    assert every_field.typed(SpeculativeConfig()) == every_field.typed(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
            "model": None,
            "dynamic": True,
            "allowed_k": None,
            "verification": "exact",
        }
    )
    assert SpeculativeConfig().proposed_in_core
    assert not SpeculativeConfig(method="mock").proposed_in_core
    assert SpeculativeConfig(num_speculative_tokens=3).k_choices == [0, 1, 2, 3]
    assert SpeculativeConfig(num_speculative_tokens=8, allowed_k=[4, 2]).k_choices == [0, 2, 4, 8]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an int > 0, got 0"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": ""}, "speculative method must be a non-empty name"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min must be an int > 0"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, r"prompt_lookup_max \(2\) must be >="),
        ({"method": "draft_model"}, "'draft_model' needs model"),
        ({"allowed_k": []}, "allowed_k must be a non-empty list"),
        ({"allowed_k": [-1]}, "each of allowed_k must be an int >= 0, got -1"),
        ({"allowed_k": [5]}, r"allowed_k holds 5, more than num_speculative_tokens \(4\)"),
        ({"verification": "lossy"}, "verification"),
    ],
)
def test_speculative_config_validation_names_the_parameter(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)
    with pytest.raises(ValueError, match=message):  # converted from a dict: the same checks
        EngineConfig(speculative_config=kwargs)


def test_speculative_config_rejects_unknown_fields_and_other_types() -> None:
    with pytest.raises(ValueError, match="unknown field `num_spec_tokens`"):
        EngineConfig(speculative_config={"num_spec_tokens": 2})
    with pytest.raises(TypeError, match="speculative_config must be a SpeculativeConfig or a dict"):
        EngineConfig(speculative_config=4)  # type: ignore[arg-type]


def test_speculation_excludes_async_scheduling() -> None:
    with pytest.raises(ValueError, match="async_scheduling=True does not work with speculative"):
        EngineConfig(speculative_config=SpeculativeConfig(), async_scheduling=True)
    assert EngineConfig(speculative_config={}, async_scheduling=False).async_scheduling is False


def test_speculative_config_round_trip() -> None:
    spec = every_field.instance(SpeculativeConfig)
    c = EngineConfig(speculative_config=spec)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(c), type=EngineConfig) == c
    assert msgspec.json.decode(msgspec.json.encode(spec), type=SpeculativeConfig) == spec
