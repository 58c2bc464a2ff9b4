"""Every field of a struct: instances with every field away from its default, for the tests
that a struct crosses the wire whole or that a conversion copies every field
(``every_field.instance(EngineConfig)``), and ``typed``, for the tests that pin every field's
value and type.

``test_every_field.py`` beside this checks that the instances set every field: a field added to a
struct fails it until ``KWARGS`` sets that field too.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

import msgspec

from engine_core._core.engine_io import EngineStats, KVGroupStats
from engine_core.config import EngineConfig, SpeculativeConfig
from engine_core.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

S = TypeVar("S", bound=msgspec.Struct)


def _numbered_stats() -> dict[str, Any]:
    fields = msgspec.structs.fields(EngineStats)
    return {f.name: f.type(i) for i, f in enumerate(fields, 1) if f.type in (int, float)}


KWARGS: dict[type[msgspec.Struct], dict[str, Any]] = {
    EngineConfig: {  # a resolved config too (max_model_len, max_num_batched_tokens)
        "model": "/models/m",
        "tokenizer": "byte",
        "backend": "mock",
        "backend_options": {"latency": {"per_step_s": 0.001}, "vocab_size": 512},
        "block_size": 32,
        "num_kv_blocks": 100,
        "kv_cache_memory_fraction": 0.5,
        "max_model_len": 4096,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 4096,
        "enable_chunked_prefill": False,
        "long_prefill_token_threshold": 64,
        "max_num_partial_prefills": 4,
        "max_long_partial_prefills": 2,
        "preemption_victim": "last_admitted",
        "max_bypass_steps": 8,
        "stall_timeout_s": 5.0,
        "enable_prefix_caching": False,
        "scheduling_policy": "priority",
        "async_scheduling": True,
        "multiprocess": True,
        "engine_runtime": "trio",
        "step_timeout_s": 30.0,
        "engine_heartbeat_timeout_s": None,
        "startup_timeout_s": 60.0,
        "grammar_compile_timeout_s": 2.5,
        "max_queued_requests": 1000,
        "max_n": 4,
        "max_stop_strings": 8,
        "max_stop_string_len": 256,
        "seed": 7,
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
        "data_parallel_size": 3,
        "data_parallel_rank": 2,
        "router": "round_robin",
        "router_balance_abs": 5,
        "router_balance_rel": 2.0,
        "dp_failover": "resume",
        "dp_restart_engines": True,
        "data_parallel_backend": "ray",
        "ray_address": "10.0.0.1:6379",
        "ray_placement_strategy": "STRICT_SPREAD",
        "ray_gpus_per_engine": 2,
        "ray_driver_host": "10.0.0.2",
        "placement_timeout_s": 30.0,
        "dp_restart_wait_s": 20.0,
        "quantization": "fp8",
        "kv_cache_dtype": "fp8",
        "kv_offload_bytes": 1 << 30,
        "kv_connector": "host",
        "kv_connector_options": {"x": 1},
        "kv_load_failure_policy": "fail",
        "kv_lease_s": 5.0,
        "kv_max_parked_fraction": 0.25,
        "enable_lora": True,
        "max_loras": 3,
        "max_lora_rank": 64,
        "max_cpu_loras": 5,
        "engine_roles": ["both", "decode", "both"],  # not disaggregated: a host tier beside
    },
    SpeculativeConfig: {
        "method": "draft_model",
        "num_speculative_tokens": 6,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 5,
        "model": "/models/draft",
        "dynamic": False,
        "allowed_k": [2, 4],
        "verification": "rejection",
    },
    SamplingParams: {  # all but detokenize (see AT_DEFAULT)
        "n": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 11,
        "max_tokens": 99,
        "min_tokens": 3,
        "stop": ["\n\n", "END"],
        "stop_token_ids": [42, 7],
        "ignore_eos": True,
        "include_stop_str_in_output": True,
        "logprobs": 5,
        "prompt_logprobs": 2,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "output_kind": RequestOutputKind.DELTA,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "structured_outputs": StructuredOutputsParams(choice=["yes", "no"]),
        "logit_bias": {5: 1.5, 9: -100.0},
    },
    # Every field (numbers, or lists and dicts of them) a different number, none 0 (the default of those that have
    # one), so a field dropped or swapped on the way shows.
    EngineStats: {
        **(_numbers := _numbered_stats()),
        "engines": [EngineStats(**_numbers)],
        "engine_ranks": [3],
        "spec_accepted_per_pos": [101, 102],
        "spec_drafted_per_pos": [103, 104],
        "spec_steps_by_k": {0: 105, 4: 106},
        "kv_groups": [KVGroupStats(kind="sliding_attention", window=107, blocks_in_use=108)],
        "engine_role": "decode",
        "kv_transfer": {"pd_transfers": 109.0},
    },
}
"""Per struct, keyword arguments that set every field away from its default."""

AT_DEFAULT: dict[type[msgspec.Struct], dict[str, str]] = {
    SamplingParams: {"detokenize": "the stop strings need detokenize=True"},
    EngineConfig: {
        "speculative_config": "async_scheduling=True (set above) excludes speculative decoding; "
        "SpeculativeConfig has its own instance"
    },
}
"""The fields an instance must leave at their default, and why."""


def instance(cls: type[S]) -> S:
    """A new ``cls`` with every field away from its default (but those in ``AT_DEFAULT``)."""
    return cls(**copy.deepcopy(KWARGS[cls]))


def typed(fields: msgspec.Struct | dict[str, Any]) -> dict[str, tuple[type, Any]]:
    """Each field's type and value: compared, ``False`` is not taken for ``0``, nor ``1`` for
    ``1.0``."""
    if isinstance(fields, msgspec.Struct):
        fields = msgspec.structs.asdict(fields)
    return {name: (type(value), value) for name, value in fields.items()}
