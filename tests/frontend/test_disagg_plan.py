"""The client's part of disaggregation alone (``engine_core._engine.dp.disagg``): which leg a
request is in, where each leg may go, the degraded modes and the handoff."""

from __future__ import annotations

import pytest

from engine_core import SamplingParams
from engine_core._core.engine_io import EngineCoreRequest, FinishedRequest
from engine_core._engine.dp.disagg import Disaggregation

ROLES = ["prefill", "decode", "decode"]
ALIVE = [True, True, True]


def _request(rid: str = "r", **params: object) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=8, **params))  # type: ignore[arg-type]


def test_a_new_request_goes_to_a_prefill_engine_for_one_token() -> None:
    disagg = Disaggregation(ROLES)
    sent, engines, least = disagg.plan(_request(min_tokens=4), None, ALIVE)
    assert engines == [0] and not least
    assert sent.sampling_params.max_tokens == 1 and sent.sampling_params.min_tokens == 1
    assert sent.kv_transfer_params == {"do_remote_decode": True}
    disagg.record_tokens("r", [42])
    params = {"segment": "s", "slot": 0, "epoch": 1, "block_ids": [[5]], "num_tokens": 16}
    decode = disagg.on_finished(FinishedRequest("r", "length", kv_transfer_params=params))
    assert decode is not None
    assert decode.sampling_params.max_tokens == 8
    assert decode.resume_output_token_ids == [42] and decode.kv_transfer_params == params
    again, engines, least = disagg.plan(decode, "handoff", ALIVE)
    assert again is decode and engines == [1, 2] and least
    assert disagg.on_finished(FinishedRequest("r", "length")) is None  # the real ending
    assert not disagg.legs and disagg.metrics.handoffs == 1


def test_a_first_token_that_ends_the_request_is_its_ending() -> None:
    disagg = Disaggregation(ROLES)
    disagg.plan(_request(), None, ALIVE)
    assert disagg.on_finished(FinishedRequest("r", "stop")) is None
    assert not disagg.legs


@pytest.mark.parametrize("params", [{"max_tokens": 1}])
def test_requests_that_gain_nothing_stay_whole(params: dict[str, int]) -> None:
    disagg = Disaggregation(ROLES)
    request = EngineCoreRequest("r", [1], SamplingParams(**params))  # type: ignore[arg-type]
    sent, engines, _ = disagg.plan(request, None, ALIVE)
    assert sent is request and engines == [1, 2]


def test_degraded_modes_are_counted() -> None:
    disagg = Disaggregation(ROLES)
    sent, engines, _ = disagg.plan(_request("a"), None, [False, True, True])
    assert engines == [1, 2] and sent.kv_transfer_params is None
    sent, engines, _ = disagg.plan(_request("b"), None, [True, False, False])
    assert engines == [0] and sent.kv_transfer_params is None
    metrics = disagg.metrics
    assert (metrics.degraded_no_prefill, metrics.degraded_no_decode) == (1, 1)


def test_a_pin_to_a_prefill_engine_is_refused() -> None:
    disagg = Disaggregation(ROLES)
    pinned = EngineCoreRequest("r", [1], SamplingParams(), data_parallel_rank=0)
    with pytest.raises(ValueError, match="prefill-only engine"):
        disagg.plan(pinned, None, ALIVE)
    decode = EngineCoreRequest("r", [1], SamplingParams(), data_parallel_rank=2)
    assert disagg.plan(decode, None, ALIVE) == (decode, None, False)


def test_a_decode_leg_that_fails_over_drops_its_parameters() -> None:
    disagg = Disaggregation(ROLES)
    disagg.plan(_request(), None, ALIVE)
    params = {"segment": "gone", "slot": 0, "epoch": 1, "block_ids": [[5]], "num_tokens": 16}
    decode = disagg.on_finished(FinishedRequest("r", "length", kv_transfer_params=params))
    assert decode is not None
    moved, engines, least = disagg.plan(decode, "failover", [True, False, True])
    assert moved.kv_transfer_params is None and engines == [2] and least
    assert disagg.metrics.failovers == 1


def test_an_export_of_another_machine_is_computed_here() -> None:
    from engine_core._core.pd_connector import HOST_ID, PDConnectorScheduler
    from engine_core.config import EngineConfig
    from engine_core.kv_connector import KVConnectorLayout

    layout = KVConnectorLayout(
        num_blocks=8,
        block_size=4,
        kv_groups=[[0]],
        group_kinds=["full_attention"],
        group_spans=[None],
        page_size_bytes=64,
    )
    connector = PDConnectorScheduler(EngineConfig(data_parallel_rank=0), layout)
    try:

        class _Request:
            request_id = "r"
            all_token_ids = list(range(13))
            num_prompt_tokens = 12
            num_computed_tokens = 0
            block_keys: list[bytes] = []
            cache_salt = None
            num_preemptions = 0
            kv_transfer_params = {
                "host": "elsewhere",
                "segment": connector.segment.name,
                "slot": 0,
                "epoch": 1,
                "block_ids": [[0, 1, 2]],
                "num_tokens": 12,
            }

        assert HOST_ID != "elsewhere"
        assert connector.get_num_new_matched_tokens(_Request(), 0) == (0, False)
        assert connector.stats()["pd_other_host"] == 1
        _Request.kv_transfer_params["host"] = HOST_ID
        _Request.request_id = "s"
        assert connector.get_num_new_matched_tokens(_Request(), 0) == (12, True)
    finally:
        connector.close()


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_every_launcher_gets_each_engine_its_role(backend: str) -> None:
    """Local processes and Ray actors start from the same per-engine config."""
    from engine_core._engine.dp.client import DPClient
    from engine_core.config import EngineConfig

    config = EngineConfig(
        data_parallel_size=3,
        engine_roles=ROLES,
        data_parallel_backend=backend,  # type: ignore[arg-type]
    )
    client = DPClient.__new__(DPClient)
    client._setup(config)
    configs = [client._engine_config(rank) for rank in range(3)]
    assert [c.engine_role for c in configs] == ROLES
    assert all(c.kv_connector_name == "pd" for c in configs)
    assert client._disagg is not None and client.metrics.disagg is client._disagg.metrics
