"""Prefill/decode disaggregation on the mock: a prefill engine computes the prompt and the first
token, a decode engine pulls the blocks (through shared memory, or over the authenticated ZMQ
transport as a decode engine on another machine does: ``pd_transport="zmq"``) and decodes; the
caller sees one stream, token-identical to a colocated run. Every failure ends with every engine
holding no block."""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import pytest

from engine_core import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from engine_core._engine.dp.client import DPClient
from engine_core.cli import build_parser, engine_config_from_args
from engine_core.config import EngineConfig

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

BS = 16
PROMPTS = [f"request number {i} is about " * 6 for i in range(6)]
GREEDY = SamplingParams(
    temperature=0.0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA
)
ROLES = ["prefill", "decode"]


def _colocated(prompts: list[str], params: SamplingParams) -> list[list[str]]:
    final = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
    with LLM(backend="mock", tokenizer="byte", block_size=BS) as single:
        return [
            [c.text for c in o.outputs] for o in single.generate(prompts, final, use_tqdm=False)
        ]


def _engine(**kwargs: Any) -> AsyncLLM:
    options = kwargs.pop("backend_options", {})
    return AsyncLLM(
        backend="mock",
        tokenizer="byte",
        block_size=BS,
        data_parallel_size=2,
        engine_roles=kwargs.pop("engine_roles", ROLES),
        backend_options=options,
        **kwargs,
    )


def _client(engine: AsyncLLM) -> DPClient:
    client = engine._client
    assert isinstance(client, DPClient)
    return client


async def _generate(engine: AsyncLLM, prompt: str, params: SamplingParams) -> list[str]:
    texts: dict[int, str] = {}
    async for out in engine.generate(prompt, params):
        for c in out.outputs:
            texts[c.index] = texts.get(c.index, "") + c.text
    return [texts[i] for i in sorted(texts)]


async def _run_all(engine: AsyncLLM, prompts: list[str], params: SamplingParams) -> list[list[str]]:
    results: dict[int, list[str]] = {}

    async def run(i: int) -> None:
        results[i] = await _generate(engine, prompts[i], params)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(run, i)
    return [results[i] for i in range(len(prompts))]


async def _no_block_held(engine: AsyncLLM, timeout_s: float = 5.0) -> Any:
    """Wait until every live engine holds no block (exports confirmed, leases expired)."""
    with anyio.fail_after(timeout_s):
        while True:
            stats = await engine.get_stats()
            if all(
                s.num_free_kv_blocks == s.num_kv_blocks and s.num_running == s.num_waiting == 0
                for s in stats.engines
            ):
                return stats
            await anyio.sleep(0.02)


def _by_role(stats: Any) -> dict[str, dict[str, float]]:
    return {s.engine_role: s.kv_transfer for s in stats.engines}


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("roles", "size", "message"),
    [
        (["prefill", "prefill"], 2, "no engine that decodes"),
        (["decode", "decode"], 2, "no engine that computes prompts"),
        (["prefill", "decode"], 3, "data_parallel_size is 3"),
        (["prefill", "decoder"], 2, "unknown role(s) ['decoder']"),
    ],
)
def test_engine_roles_errors_name_the_field(roles: list[str], size: int, message: str) -> None:
    with pytest.raises(ValueError, match="engine_roles") as info:
        EngineConfig(data_parallel_size=size, engine_roles=roles)
    assert message in str(info.value)


def test_engine_roles_default_and_flag() -> None:
    assert EngineConfig(data_parallel_size=2).roles == ["both", "both"]
    assert not EngineConfig(data_parallel_size=2, engine_roles=["both", "decode"]).disaggregated
    args = build_parser().parse_args(
        ["serve", "--data-parallel-size", "3", "--engine-roles", "prefill,decode,decode"]
    )
    config = engine_config_from_args(args)
    assert config.engine_roles == ["prefill", "decode", "decode"]
    assert config.disaggregated and config.kv_connector_name == "pd"


# -- the flow -------------------------------------------------------------------------------------


async def test_outputs_match_a_colocated_run_and_no_block_is_held() -> None:
    expected = _colocated(PROMPTS, GREEDY)
    async with _engine() as engine:
        got = await _run_all(engine, PROMPTS, GREEDY)
        assert got == expected
        stats = await _no_block_held(engine)
        roles = _by_role(stats)
        assert roles["prefill"]["pd_exports"] == roles["prefill"]["pd_exports_confirmed"] == 6
        assert roles["decode"]["pd_transfers"] == 6
        assert roles["decode"]["pd_transfer_failed"] == 0
        assert roles["decode"]["pd_bytes"] > 0
        assert roles["decode"]["pd_transfers_shm"] == 6  # one host: shared memory
        assert roles["decode"]["pd_transfers_zmq"] == 0
        client = _client(engine)
        assert client.metrics.requests[1, "handoff"] == 6
        assert client._disagg is not None and not client._disagg.legs
        assert [e["role"] for e in client.engine_status()] == ROLES
        segments = [f"ecpd-{pid}-0" for pid in client.pids]
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in segments)


async def test_n_stop_strings_and_logprobs_stay_right() -> None:
    params = SamplingParams(
        temperature=0.0,
        max_tokens=30,
        ignore_eos=True,
        n=2,
        logprobs=2,
        stop=["/01"],
        output_kind=RequestOutputKind.DELTA,
    )
    expected = _colocated(PROMPTS[:2], params)
    final = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
    async with _engine() as engine:
        assert await _run_all(engine, PROMPTS[:2], params) == expected
        outs = [o async for o in engine.generate(PROMPTS[0], final)]
        completion = outs[-1].outputs[0]
        assert completion.logprobs is not None
        assert len(completion.logprobs) == len(completion.token_ids)
        await _no_block_held(engine)


async def test_an_abort_reaches_both_sides() -> None:
    slow = {"kv_link": {"latency_s": 0.5, "deadline_s": 5.0}}
    async with _engine(backend_options=slow) as engine:
        client = _client(engine)
        seen = anyio.Event()

        async def run() -> None:
            async for _ in engine.generate(PROMPTS[0], GREEDY, request_id="a"):
                seen.set()  # the first token: the decode leg is on its way

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await seen.wait()
                await anyio.sleep(0.05)  # the decode engine parked it, pulling
                tg.cancel_scope.cancel()
        stats = await _no_block_held(engine, timeout_s=2.0)  # far below the 30 s lease
        assert _by_role(stats)["prefill"]["pd_lease_expired"] == 0
        assert client._disagg is not None and not client._disagg.legs


async def test_a_decode_engine_that_rejects_frees_the_prefill_side_at_once() -> None:
    async with _engine() as engine:
        client = _client(engine)
        await client._clients[1].call_utility_async("pause_generation", "abort")
        with pytest.raises(Exception, match="paused"):
            await _generate(engine, PROMPTS[0], GREEDY)
        stats = await _no_block_held(engine, timeout_s=2.0)
        assert _by_role(stats)["prefill"]["pd_exports_confirmed"] == 1
        assert client._disagg is not None and client._disagg.metrics.released == 1


async def test_a_prefill_engine_dying_mid_transfer_leaves_the_decode_side_to_recompute() -> None:
    expected = _colocated(PROMPTS[:2], GREEDY)
    slow = {"kv_link": {"latency_s": 1.0, "deadline_s": 5.0}}
    async with _engine(backend_options=slow) as engine:
        client = _client(engine)
        first = anyio.Event()
        results: list[list[str]] = []

        async def run() -> None:
            texts = ""
            async for out in engine.generate(PROMPTS[0], GREEDY):
                texts += out.outputs[0].text
                first.set()
            results.append([texts])

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await first.wait()
                pid = client.pids[0]
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
        assert results == [expected[0]]
        # No prefill engine left: the decode engine takes whole requests (degraded, counted).
        assert await _generate(engine, PROMPTS[1], GREEDY) == expected[1]
        assert client._disagg is not None and client._disagg.metrics.degraded_no_prefill >= 1
        stats = await _no_block_held(engine)
        assert _by_role(stats)["decode"]["pd_transfer_failed"] == 1


async def test_a_decode_engine_dying_is_the_usual_failover() -> None:
    expected = _colocated(PROMPTS[:1], GREEDY)
    slow = {"latency": {"step_s": 0.01}}
    async with _engine(backend_options=slow, dp_failover="resume") as engine:
        client = _client(engine)
        tokens = 0
        text = ""
        with anyio.fail_after(20):
            async for out in engine.generate(PROMPTS[0], GREEDY):
                text += out.outputs[0].text
                tokens += 1
                if tokens == 4:
                    pid = client.pids[1]
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)
        assert [text] == expected[0]
        assert client.metrics.requests[0, "failover"] == 1
        assert client._disagg is not None and client._disagg.metrics.failovers == 1
        await _no_block_held(engine)


async def test_an_expired_lease_makes_the_decode_side_recompute() -> None:
    expected = _colocated(PROMPTS[:1], GREEDY)
    slow = {"kv_link": {"latency_s": 1.0, "deadline_s": 5.0}}
    async with _engine(
        backend_options=slow, kv_lease_s=0.3, kv_connector_options={"renew": False}
    ) as engine:
        assert await _generate(engine, PROMPTS[0], GREEDY) == expected[0]
        roles = _by_role(await _no_block_held(engine))
        assert roles["prefill"]["pd_lease_expired"] == 1
        # The decode side gave up too (its load failed, or its own lease ran out): recomputed.
        assert roles["decode"]["pd_transfer_failed"] + roles["decode"]["pd_lease_expired"] >= 1
        assert roles["decode"]["pd_transfers"] == 0


async def test_leases_are_renewed_while_a_transfer_is_in_progress() -> None:
    expected = _colocated(PROMPTS[:1], GREEDY)
    slow = {"kv_link": {"latency_s": 1.0, "deadline_s": 5.0}}
    async with _engine(backend_options=slow, kv_lease_s=0.3) as engine:
        assert await _generate(engine, PROMPTS[0], GREEDY) == expected[0]
        roles = _by_role(await _no_block_held(engine))
        assert roles["prefill"]["pd_lease_expired"] == 0
        assert roles["decode"]["pd_transfers"] == 1
        assert roles["decode"]["pd_transfer_failed"] == 0


async def test_no_decode_engine_alive_the_prefill_engines_take_whole_requests() -> None:
    expected = _colocated(PROMPTS[:1], GREEDY)
    async with _engine() as engine:
        client = _client(engine)
        pid = client.pids[1]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(5):
            while client._alive[1]:
                await anyio.sleep(0.02)
                await engine.get_stats()
        assert await _generate(engine, PROMPTS[0], GREEDY) == expected[0]
        assert client._disagg is not None and client._disagg.metrics.degraded_no_decode == 1
        await _no_block_held(engine)


async def test_a_request_pinned_to_a_prefill_engine_is_refused() -> None:
    async with _engine() as engine:
        with pytest.raises(ValueError, match="prefill-only engine"):
            await _generate_pinned(engine, 0)
        assert await _generate_pinned(engine, 1)


async def _generate_pinned(engine: AsyncLLM, rank: int) -> list[str]:
    texts = ""
    async for out in engine.generate(PROMPTS[0], GREEDY, data_parallel_rank=rank):
        texts += out.outputs[0].text
    return [texts]


def test_disaggregation_names_what_it_cannot_run_with() -> None:
    with pytest.raises(ValueError, match="kv_offload_bytes"):
        EngineConfig(data_parallel_size=2, engine_roles=ROLES, kv_offload_bytes="1GiB")
    with pytest.raises(ValueError, match="kv_connector 'host'"):
        EngineConfig(data_parallel_size=2, engine_roles=ROLES, kv_connector="host")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(data_parallel_size=2, engine_roles=ROLES, enable_prefix_caching=False)


async def test_async_scheduling_keeps_the_handoff_exact() -> None:
    expected = _colocated(PROMPTS[:3], GREEDY)
    steps = {"latency": {"step_s": 0.002}}
    async with _engine(async_scheduling=True, backend_options=steps) as engine:
        assert await _run_all(engine, PROMPTS[:3], GREEDY) == expected
        roles = _by_role(await _no_block_held(engine))
        assert roles["decode"]["pd_transfers"] == 3
        assert roles["decode"]["pd_transfer_failed"] == 0


# -- across hosts: the authenticated ZMQ transport, forced on one machine ------------------------

ZMQ = {"pd_transport": "zmq"}


def _zmq_engine(**kwargs: Any) -> AsyncLLM:
    options = {**ZMQ, **kwargs.pop("kv_connector_options", {})}
    return _engine(kv_connector_options=options, **kwargs)


async def test_outputs_over_zmq_match_a_colocated_run() -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, n=2, output_kind=RequestOutputKind.DELTA
    )
    expected = _colocated(PROMPTS[:4], GREEDY) + _colocated(PROMPTS[4:5], params)
    async with _zmq_engine() as engine:
        got = await _run_all(engine, PROMPTS[:4], GREEDY)
        got += [await _generate(engine, PROMPTS[4], params)]
        assert got == expected
        roles = _by_role(await _no_block_held(engine))
        decode, prefill = roles["decode"], roles["prefill"]
        assert prefill["pd_exports"] == prefill["pd_exports_confirmed"] == 6
        assert decode["pd_transfers"] == decode["pd_transfers_zmq"] >= 5
        # A sibling may find its prompt in the prefix cache its sibling's load filled.
        assert decode["pd_transfers"] + decode["pd_released_unread"] == 6
        assert decode["pd_transfers_shm"] == 0 and decode["pd_transfer_failed"] == 0
        assert decode["pd_bytes_zmq"] == decode["pd_bytes"] > 0
        assert decode["pd_handoff_s_zmq"] > 0
        assert decode["pd_auth_refused"] == 0


async def test_a_prefill_engine_dying_mid_transfer_over_zmq_recomputes() -> None:
    expected = _colocated(PROMPTS[:1], GREEDY)
    slow = {"kv_link": {"latency_s": 1.0, "deadline_s": 5.0}}
    async with _zmq_engine(backend_options=slow) as engine:
        client = _client(engine)
        first = anyio.Event()
        text = ""

        async def run() -> None:
            nonlocal text
            async for out in engine.generate(PROMPTS[0], GREEDY):
                text += out.outputs[0].text
                first.set()

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await first.wait()
                pid = client.pids[0]
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
        assert [text] == expected[0]
        stats = await _no_block_held(engine)
        assert _by_role(stats)["decode"]["pd_transfer_failed"] == 1


async def test_an_expired_lease_over_zmq_recomputes_and_renewals_keep_it() -> None:
    expected = _colocated(PROMPTS[:1], GREEDY)
    slow = {"kv_link": {"latency_s": 0.6, "deadline_s": 5.0}}  # twice the lease
    async with _zmq_engine(
        backend_options=slow, kv_lease_s=0.3, kv_connector_options={"renew": False}
    ) as engine:
        assert await _generate(engine, PROMPTS[0], GREEDY) == expected[0]
        roles = _by_role(await _no_block_held(engine))
        assert roles["prefill"]["pd_lease_expired"] == 1
        assert roles["decode"]["pd_transfers"] == 0
        assert roles["decode"]["pd_transfer_failed"] + roles["decode"]["pd_lease_expired"] >= 1
    async with _zmq_engine(backend_options=slow, kv_lease_s=0.3) as engine:
        assert await _generate(engine, PROMPTS[0], GREEDY) == expected[0]
        roles = _by_role(await _no_block_held(engine))
        assert roles["prefill"]["pd_lease_expired"] == 0
        assert roles["decode"]["pd_transfers_zmq"] == 1


async def test_aborts_and_rejections_release_over_zmq() -> None:
    slow = {"kv_link": {"latency_s": 0.5, "deadline_s": 5.0}}
    async with _zmq_engine(backend_options=slow) as engine:
        client = _client(engine)
        seen = anyio.Event()

        async def run() -> None:
            async for _ in engine.generate(PROMPTS[0], GREEDY, request_id="a"):
                seen.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await seen.wait()
                await anyio.sleep(0.05)  # parked on the decode engine, pulling
                tg.cancel_scope.cancel()
        stats = await _no_block_held(engine, timeout_s=2.0)  # far below the 30 s lease
        assert _by_role(stats)["prefill"]["pd_lease_expired"] == 0
        # A decode engine that rejects: the front end releases the export over ZMQ.
        await client._clients[1].call_utility_async("pause_generation", "abort")
        with pytest.raises(Exception, match="paused"):
            await _generate(engine, PROMPTS[1], GREEDY)
        stats = await _no_block_held(engine, timeout_s=2.0)
        assert _by_role(stats)["prefill"]["pd_exports_confirmed"] == 2
        assert client._disagg is not None and client._disagg._pd_client is not None
