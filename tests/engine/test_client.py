"""``engine_core._engine.client``: the one place that picks the client for a config, and the
control-call check every client and the engine share (``engine_io.check_utility_call``)."""

from __future__ import annotations

import pytest

from engine_core._core.engine_io import UTILITY_METHODS, PauseMode, check_utility_call
from engine_core._engine.client import client_kind, make_client
from engine_core._engine.inproc_client import InprocClient
from engine_core.config import EngineConfig


@pytest.mark.parametrize(
    ("fields", "multiprocess", "data_parallel", "expected"),
    [
        ({}, False, False, "inproc"),  # LLM's default
        ({}, True, False, "mp"),  # AsyncLLM's default
        ({"multiprocess": True}, False, False, "mp"),
        ({"multiprocess": False}, True, False, "inproc"),
        ({"multiprocess": False, "data_parallel_size": 2}, True, False, "inproc"),
        ({"data_parallel_size": 2}, True, False, "dp"),
        ({"multiprocess": True, "data_parallel_size": 2}, False, False, "dp"),
        ({}, True, True, "dp"),
        ({"data_parallel_backend": "ray"}, True, False, "dp"),
    ],
)
def test_client_kind(
    fields: dict[str, object], multiprocess: bool, data_parallel: bool, expected: str
) -> None:
    config = EngineConfig(backend="mock", tokenizer="byte", **fields)  # type: ignore[arg-type]
    assert client_kind(config, multiprocess=multiprocess, data_parallel=data_parallel) == expected


def test_make_client_in_process_runs_the_config() -> None:
    client = make_client(EngineConfig(backend="mock", num_kv_blocks=64), multiprocess=False)
    try:
        assert isinstance(client, InprocClient)
        assert client.info.num_kv_blocks == 64
    finally:
        client.shutdown()


def test_in_process_refuses_data_parallelism() -> None:
    config = EngineConfig(backend="mock", multiprocess=False, data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size"):
        make_client(config, multiprocess=True)


def test_check_utility_call() -> None:
    for method in UTILITY_METHODS:
        check_utility_call(method, [])
    for mode in PauseMode:
        check_utility_call("pause_generation", [mode.value])
    with pytest.raises(ValueError, match="unknown utility method 'close'"):
        check_utility_call("close", [])
    with pytest.raises(ValueError, match="mode must be one of abort, wait, keep, got 'later'"):
        check_utility_call("pause_generation", ["later"])
