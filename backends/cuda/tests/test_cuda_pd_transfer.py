"""Prefill/decode disaggregation on the CUDA backend, on the CPU: a prefill engine computes the
prompt and the first token, a decode engine copies the prompt's KV pages into its own blocks
and decodes; greedy tokens equal one engine's, every transfer delivered its pages (no
recompute), on the same host's path (a handle of the KV tensor: shared memory on the CPU) and
across hosts (``pd_transport="zmq"``), at one and two tensor-parallel ranks (rank r pulls rank
r's shard), and every engine ends holding no block. The page copy itself is checked per
KV-cache group, on both paths."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
import torch
from engine_core_cuda._pd_transfer import CudaPDWorker, copy_pages
from hf_reference import PROMPTS
from tiny_models import TinyModel

from engine_core import AsyncLLM, RequestOutputKind, SamplingParams
from engine_core.config import EngineConfig
from engine_core.kv_connector import KVConnectorLayout

pytestmark = pytest.mark.timeout(240)

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = [p for p in PROMPTS if len(p.split()) > 6][:3]
TRANSPORT = {"asyncio": "auto", "trio": "zmq"}
"""Each event loop runs one path (two engine processes of the CUDA backend per run)."""


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def _generate(llm: AsyncLLM, prompt: str) -> list[int]:
    tokens: list[int] = []
    async for out in llm.generate(prompt, PARAMS):
        tokens = list(out.outputs[0].token_ids)
    return tokens


async def _idle(llm: AsyncLLM, timeout_s: float = 10.0) -> Any:
    with anyio.fail_after(timeout_s):
        while True:
            stats = await llm.get_stats()
            if all(s.num_free_kv_blocks == s.num_kv_blocks for s in stats.engines):
                return stats
            await anyio.sleep(0.05)


@pytest.mark.anyio
@pytest.mark.parametrize("tp", [1, 2])
async def test_prefill_and_decode_engines_give_one_engines_tokens(
    tiny: dict[str, TinyModel], anyio_backend: str, tp: int
) -> None:
    """``tp`` 2: each engine two tensor-parallel ranks (gloo), rank r pulling rank r's shard."""
    model = tiny["llama"]
    final = PARAMS.clone(output_kind=RequestOutputKind.FINAL_ONLY)
    with model.llm(block_size=4, dtype="float32", tensor_parallel_size=tp) as one:
        expected = [list(o.outputs[0].token_ids) for o in one.generate(LONG, final, use_tqdm=False)]
    transport = TRANSPORT[anyio_backend]
    async with AsyncLLM(
        model=str(model.path),
        backend="cuda",
        backend_options={"device": "cpu", "kernels": "torch"},
        dtype="float32",
        tensor_parallel_size=tp,
        block_size=4,
        max_model_len=256,
        num_kv_blocks=96,
        data_parallel_size=2,
        engine_roles=["prefill", "decode"],
        kv_connector_options={"pd_transport": transport},
    ) as llm:
        got: dict[int, list[int]] = {}

        async def run(i: int) -> None:
            got[i] = await _generate(llm, LONG[i])

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(len(LONG)):
                    tg.start_soon(run, i)
        assert [got[i] for i in range(len(LONG))] == expected
        stats = await _idle(llm)
        decode = next(s.kv_transfer for s in stats.engines if s.engine_role == "decode")
        prefill = next(s.kv_transfer for s in stats.engines if s.engine_role == "prefill")
        assert prefill["pd_exports"] == prefill["pd_exports_confirmed"] == len(LONG)
        assert decode["pd_transfers"] == len(LONG) and decode["pd_transfer_failed"] == 0
        path = "zmq" if transport == "zmq" else "shm"
        assert decode[f"pd_transfers_{path}"] == len(LONG)
        assert decode["pd_bytes"] > 0


def test_copy_pages_moves_whole_pages_per_group() -> None:
    # [slots, 2, blocks, block_size, kv_heads, head_size]
    src = torch.randn(2, 2, 6, 4, 1, 8)
    dst = torch.zeros_like(src)
    copy_pages(dst, [5, 1], src, [2, 3])
    assert torch.equal(dst[:, :, 5], src[:, :, 2]) and torch.equal(dst[:, :, 1], src[:, :, 3])
    assert not dst[:, :, [0, 2, 3, 4]].any()


def test_the_worker_refuses_what_it_cannot_carry() -> None:
    layout = KVConnectorLayout(
        num_blocks=4,
        block_size=4,
        kv_groups=[[0]],
        group_kinds=["full_attention"],
        group_spans=[None],
        page_size_bytes=64,
    )
    with pytest.raises(ValueError, match="draft model"):
        CudaPDWorker(EngineConfig(speculative_config={"num_speculative_tokens": 2}), layout)


@pytest.mark.parametrize("path", ["handle", "zmq"])
def test_pages_cross_per_kv_cache_group(path: str) -> None:
    """Two workers in one process (a prefill and a decode engine's), two KV-cache groups whose
    entries are ``-1`` where a group moves nothing: exactly the named pages arrive, through the
    KV tensor's handle (shared memory on the CPU, CUDA IPC on a GPU) or over ZMQ; pages written
    after the export still arrive (a handle, not a copy)."""
    import msgspec

    from engine_core._core.pd_connector import HOST_ID, PDConnectorScheduler, release
    from engine_core._engine.pipes.addresses import deployment_keys
    from engine_core._engine.pipes.pd_transport import KEYS_OPTION
    from engine_core.kv_connector import KVConnectorMetadata, KVTransfer

    keys = msgspec.to_builtins(deployment_keys())
    layout = KVConnectorLayout(
        num_blocks=8,
        block_size=4,
        kv_groups=[[0], [1]],
        group_kinds=["full_attention", "sliding_attention"],
        group_spans=[None, 8],
        page_size_bytes=2 * 2 * 4 * 1 * 8 * 4,
    )

    def config(rank: int) -> EngineConfig:
        options = {KEYS_OPTION: keys, "pd_transport": "zmq" if path == "zmq" else "auto"}
        return EngineConfig(
            data_parallel_size=2, data_parallel_rank=rank, kv_connector_options=options
        )

    src = torch.zeros(1, 2, 8, 4, 1, 8)
    dst = torch.zeros_like(src)
    layer = src.unbind(0)[0]  # a view, as the model's layers hold
    prefill = CudaPDWorker(config(0), layout)
    owner = PDConnectorScheduler(config(0), layout)
    decode = CudaPDWorker(config(1), layout)
    try:
        prefill.register_kv_caches(lambda: src)
        decode.register_kv_caches(lambda: dst)
        layer.normal_()  # the prompt's KV, written after the export
        slot = owner._free_slots.pop()
        owner.segment.done[slot] = 0
        params = {"epoch": 5, "slot": slot, "lease_s": 30.0}
        tables = [[2, -1], [-1, 3]]
        save = KVTransfer("r", "r", tables, tables, 0, 8, params=params)
        assert prefill._remote is not None
        if path == "zmq":
            load_params = {"address": prefill._remote.address, "via": "zmq", **params}
        else:
            load_params = {"segment": owner.segment.name, "via": "shm", **params}
        load = KVTransfer("r", "r", [[6, -1], [-1, 7]], tables, 0, 8, params=load_params)
        decode.start_step(KVConnectorMetadata(loads=[load]))  # before the export is published
        prefill.start_step(KVConnectorMetadata(saves=[save]))
        report = None
        for _ in range(200):
            report = decode.get_finished()
            if report is not None:
                break
            time.sleep(0.01)
        assert report is not None and report.finished_loads == ["r"]
        assert not report.failed_block_ids
        assert torch.equal(dst[:, :, 6], src[:, :, 2]) and torch.equal(dst[:, :, 7], src[:, :, 3])
        assert not dst[:, :, [0, 1, 2, 3, 4, 5]].any()
        assert report.bytes_loaded == 2 * layout.page_size_bytes
        assert decode._remote is not None
        if path == "zmq":  # the confirmation (the scheduler half's): the prefill side lets go
            decode._remote.release(load_params)
        else:
            assert release({**load_params, "host": HOST_ID})
        for _ in range(200):
            done = prefill.get_finished()
            if done is not None:
                assert done.finished_saves == ["r"]
                assert owner.segment.ready[slot] == -5  # withdrawn before the free
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the export was never confirmed")
    finally:
        decode.close()
        prefill.close()
        owner.close()


def test_a_reallocated_kv_tensor_is_exported_again() -> None:
    """After a sleep the runner's KV tensor is a new one: the next export publishes its handle
    and a reader that opened the old one reopens it (never copies stale pages); a handle of
    another page shape fails the load."""
    import msgspec

    from engine_core._core.pd_connector import PDConnectorScheduler
    from engine_core._engine.pipes.addresses import deployment_keys
    from engine_core._engine.pipes.pd_transport import KEYS_OPTION
    from engine_core.kv_connector import KVConnectorMetadata, KVTransfer

    keys = msgspec.to_builtins(deployment_keys())
    layout = KVConnectorLayout(
        num_blocks=8,
        block_size=4,
        kv_groups=[[0]],
        group_kinds=["full_attention"],
        group_spans=[None],
        page_size_bytes=256,
    )

    def config(rank: int) -> EngineConfig:
        return EngineConfig(
            data_parallel_size=2, data_parallel_rank=rank, kv_connector_options={KEYS_OPTION: keys}
        )

    current = [torch.randn(1, 2, 8, 4, 1, 8)]
    dst = torch.zeros(1, 2, 8, 4, 1, 8)
    prefill = CudaPDWorker(config(0), layout)
    owner = PDConnectorScheduler(config(0), layout)
    decode = CudaPDWorker(config(1), layout)
    try:
        prefill.register_kv_caches(lambda: current[0])
        decode.register_kv_caches(lambda: dst)
        for epoch in (3, 4, 5):
            if epoch == 4:
                current[0] = torch.randn(1, 2, 8, 4, 1, 8)  # reallocated
            if epoch == 5:  # another shard (a prefill engine of another tensor-parallel size)
                current[0] = torch.randn(1, 2, 8, 4, 2, 8)
            slot = owner._free_slots.pop()
            owner.segment.done[slot] = 0
            params = {"epoch": epoch, "slot": slot, "lease_s": 30.0}
            save = KVTransfer(f"r{epoch}", f"r{epoch}", [[2]], [[2]], 0, 4, params=params)
            prefill.start_step(KVConnectorMetadata(saves=[save]))
            load_params = {"segment": owner.segment.name, "via": "shm", **params}
            load = KVTransfer(f"r{epoch}", f"r{epoch}", [[6]], [[2]], 0, 4, params=load_params)
            decode.start_step(KVConnectorMetadata(loads=[load]))
            report = decode.get_finished()
            assert report is not None and report.finished_loads == [f"r{epoch}"]
            if epoch == 5:
                assert report.failed_block_ids == [[6]]  # refused, never copied
                continue
            assert not report.failed_block_ids
            assert torch.equal(dst[:, :, 6], current[0][:, :, 2])
    finally:
        decode.close()
        prefill.close()
        owner.close()
