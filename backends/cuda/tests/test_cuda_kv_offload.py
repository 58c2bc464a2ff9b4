"""The host KV tier on the CUDA backend, on the CPU (plain host memory, synchronous copies: the
same code as on a GPU, without streams): outputs equal the tier off, prompts evicted from the
device come back from the host, preempted requests resume by load, failed loads recompute,
window groups (Gemma 3) and an FP8 cache move their pages, and tensor parallelism agrees."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import torch
from engine_core_cuda import CudaBackend
from engine_core_cuda._kv_offload import (
    BlockCopier,
    HostBuffer,
    parse_kv_offload,
    slot_runs,
)
from tiny_models import PAGES_PER_BLOCK, TinyModel

from engine_core import SamplingParams
from engine_core._core.engine_io import EngineCoreRequest
from engine_core._engine.core import EngineCore
from engine_core.config import EngineConfig
from engine_core.testing import check_kv_connector_worker

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def config(
    model: TinyModel,
    *,
    num_blocks: int = 24,
    offload: int = 1 << 20,
    options: dict[str, Any] | None = None,
    **fields: Any,
) -> EngineConfig:
    return EngineConfig(
        model=str(model.path),
        backend="cuda",
        backend_options={"device": "cpu", "kernels": "torch", **(options or {})},
        block_size=BLOCK,
        max_model_len=80,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_kv_blocks=num_blocks * PAGES_PER_BLOCK.get(model.kind, 1),
        kv_offload_bytes=offload,
        **fields,
    )


def prompt(i: int, length: int = 9 * BLOCK + 2) -> list[int]:
    return [(i * 31 + j * 7) % 300 + 3 for j in range(length)]


def run(core: EngineCore, requests: list[tuple[str, list[int]]]) -> dict[str, list[int]]:
    for req_id, tokens in requests:
        core.add_request(EngineCoreRequest(req_id, tokens, GREEDY))
    out: dict[str, list[int]] = {r: [] for r, _ in requests}
    deadline = time.monotonic() + 120
    while core.has_work:
        assert time.monotonic() < deadline, "the engine did not finish"
        step = core.step()
        for req_id, new in zip(step.req_ids, step.new_token_ids, strict=True):
            out[req_id].extend(new)
        for f in step.finished:
            assert f.error is None, f.error
    return out


def rounds(n: int = 3, k: int = 4) -> list[list[tuple[str, list[int]]]]:
    return [[(f"r{r}-{i}", prompt(i)) for i in range(k)] for r in range(n)]


def both(cfg: EngineConfig, batches: list[list[tuple[str, list[int]]]]) -> tuple[Any, Any, Any]:
    """Tokens with the tier off, with it on, and the stats of the run with it on."""
    results = []
    stats = None
    for c in (msgspec.structs.replace(cfg, kv_offload_bytes=0), cfg):
        core = EngineCore(c)
        try:
            tokens: dict[str, list[int]] = {}
            for batch in batches:
                tokens.update(run(core, batch))
            results.append(tokens)
            if c.kv_offload_bytes:
                stats = core.get_stats()
                kv = core.scheduler.kv
                assert kv.num_free_blocks == kv.num_blocks, "device blocks leaked"
                backend = core.backend
                assert isinstance(backend, CudaBackend)
                worker = backend.kv_worker
                assert worker is not None and not worker._pending
        finally:
            core.close()
    return results[0], results[1], stats


# -- the copier ---------------------------------------------------------------------------------


def test_slot_runs() -> None:
    assert slot_runs([3, 4, 5, 9, 2, 3]) == [(3, 0, 3), (9, 3, 1), (2, 4, 2)]
    assert slot_runs([]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_block_copier_round_trips_every_layer_of_a_block(dtype: torch.dtype) -> None:
    kv = (torch.randn(3, 2, 10, BLOCK, 2, 8) * 4).to(dtype)
    page = kv[:, :, 0].numel() * kv.element_size()
    host = HostBuffer(6, page, pin=False)
    copier = BlockCopier(kv, host)
    copier.save([7, 2, 5], [4, 5, 1])
    # Cross-layer contiguous: host slot 4 is block 7's every layer, K and V, in order.
    assert torch.equal(host.data[4], kv[:, :, 7].contiguous().view(torch.uint8).flatten())
    before = kv.clone()
    copier.load([0, 1, 9], [1, 4, 5])
    raw = kv.view(torch.uint8)
    for dst, src in ((0, 5), (1, 7), (9, 2)):
        assert torch.equal(raw[:, :, dst], before.view(torch.uint8)[:, :, src])
    for untouched in (2, 3, 4, 5, 6, 7, 8):
        assert torch.equal(raw[:, :, untouched], before.view(torch.uint8)[:, :, untouched])
    # Chunks of one block through the staging buffers move the same bytes.
    chunked = HostBuffer(6, page, pin=False)
    BlockCopier(kv, chunked, chunk_bytes=page).save([7, 2, 5], [4, 5, 1])
    assert torch.equal(chunked.data[[4, 5, 1]], host.data[[4, 5, 1]])
    again = torch.zeros_like(kv)
    BlockCopier(again, chunked, chunk_bytes=2 * page).load([3, 8, 6], [4, 5, 1])
    for dst, src in ((3, 7), (8, 2), (6, 5)):
        assert torch.equal(again.view(torch.uint8)[:, :, dst], kv.view(torch.uint8)[:, :, src])
    # The per-block reference copies the same bytes.
    other = HostBuffer(6, page, pin=False)
    BlockCopier(kv, other).save_per_block([7, 2, 5], [4, 5, 1])
    assert torch.equal(other.data[[4, 5, 1]], host.data[[4, 5, 1]])


def test_kv_offload_options_are_checked() -> None:
    assert parse_kv_offload(None).deadline_s == 10.0
    assert parse_kv_offload({"fault": {"kind": "drop", "probability": 0.5}}).fault_kind == "drop"
    assert parse_kv_offload({"copy": "batched"}).copy == "batched"
    for bad in ({"deadline": 1}, {"deadline_s": 0}, {"fault": {"kind": "late"}}, [], {"copy": 1}):
        with pytest.raises(ValueError, match="kv_offload"):
            parse_kv_offload(bad)


# -- the engine ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("async_scheduling", "copy"), [(False, "per_block"), (True, "per_block"), (False, "batched")]
)
def test_evicted_prompts_come_back_from_the_host_with_the_same_tokens(
    tiny: dict[str, TinyModel], async_scheduling: bool, copy: str
) -> None:
    cfg = config(
        tiny["llama"], async_scheduling=async_scheduling, options={"kv_offload": {"copy": copy}}
    )
    off, on, stats = both(cfg, rounds())
    assert on == off
    assert stats.kv_offload_hit_tokens > 0
    assert stats.kv_offload_bytes_loaded > 0 and stats.kv_offload_bytes_stored > 0
    assert stats.kv_offload_failed_blocks == 0


def test_the_connector_worker_checks_pass(tiny: dict[str, TinyModel]) -> None:
    check_kv_connector_worker(CudaBackend, config(tiny["llama"], num_blocks=20))


def test_preempted_requests_resume_by_load(tiny: dict[str, TinyModel]) -> None:
    # Too few blocks for four long requests at once: the scheduler preempts, and the tier
    # saved their blocks, so they resume by a load instead of a recompute.
    batch = [(f"p{i}", prompt(i, 12 * BLOCK)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = []
    for offload in (0, 1 << 20):
        core = EngineCore(config(tiny["llama"], num_blocks=34, offload=offload))
        try:
            for req_id, tokens in batch:
                core.add_request(EngineCoreRequest(req_id, tokens, params))
            out: dict[str, list[int]] = {r: [] for r, _ in batch}
            while core.has_work:
                step = core.step()
                for req_id, new in zip(step.req_ids, step.new_token_ids, strict=True):
                    out[req_id].extend(new)
            results.append((out, core.get_stats()))
        finally:
            core.close()
    (off, off_stats), (on, on_stats) = results
    assert on == off
    assert on_stats.num_preemptions > 0
    assert on_stats.kv_offload_hit_tokens > 0


def test_failed_loads_recompute_with_the_same_tokens(tiny: dict[str, TinyModel]) -> None:
    fault = {"kv_offload": {"fault": {"kind": "drop", "probability": 0.5, "seed": 1}}}
    off, on, stats = both(config(tiny["llama"], options=fault), rounds())
    assert on == off
    assert stats.kv_offload_failed_blocks > 0


def test_a_raising_worker_half_ends_the_engine_with_the_cause(tiny: dict[str, TinyModel]) -> None:
    fault = {"kv_offload": {"fault": {"kind": "raise", "probability": 1.0}}}
    core = EngineCore(config(tiny["llama"], options=fault))
    try:
        with pytest.raises(Exception) as info:
            for batch in rounds(2):
                run(core, batch)
        chain = []
        exc: BaseException | None = info.value
        while exc is not None:
            chain.append(str(exc))
            exc = exc.__cause__ or exc.__context__
        assert any("kv_offload fault injected" in text for text in chain), chain
    finally:
        core.close()


def test_fp8_kv_pages_move_their_bytes(tiny: dict[str, TinyModel]) -> None:
    cfg = config(tiny["llama"], dtype="bfloat16", kv_cache_dtype="fp8")
    off, on, stats = both(cfg, rounds())
    assert on == off
    assert stats.kv_offload_hit_tokens > 0
    core = EngineCore(cfg)
    try:
        backend = core.backend
        assert isinstance(backend, CudaBackend)
        worker = backend.kv_worker
        assert worker is not None
        tensor = backend.runner.kv_tensor
        assert tensor is not None and tensor.element_size() == 1
        assert worker.host.page_bytes == tensor[:, :, 0].numel()  # one byte per element
    finally:
        core.close()


def test_sliding_window_groups_get_host_hits(tiny: dict[str, TinyModel]) -> None:
    model = tiny["gemma3"]
    off, on, stats = both(config(model, options={"kv_offload": {"copy": "batched"}}), rounds())
    assert on == off
    assert stats.kv_offload_hit_tokens > 0
    assert stats.kv_offload_bytes_loaded > 0


def test_more_host_memory_than_available_is_a_startup_error(tiny: dict[str, TinyModel]) -> None:
    with pytest.raises(ValueError, match=r"kv_offload_bytes \(--kv-offload-bytes\).*only"):
        EngineCore(config(tiny["llama"], offload=1 << 50))


def test_tp2_agrees_and_gives_the_same_tokens(tiny: dict[str, TinyModel]) -> None:
    # Both ranks draw the same faults (one seed): failed blocks are agreed on too.
    fault = {
        "kv_offload": {"copy": "batched", "fault": {"kind": "drop", "probability": 0.5, "seed": 1}}
    }
    cfg = config(tiny["llama"], tensor_parallel_size=2, options=fault)
    off, on, stats = both(cfg, rounds(3, 3))
    assert on == off
    assert stats.kv_offload_hit_tokens > 0
    assert stats.kv_offload_bytes_loaded > 0
    assert stats.kv_offload_failed_blocks > 0


def test_sleep_and_wake_up_with_the_tier_on(tiny: dict[str, TinyModel]) -> None:
    cfg = config(tiny["llama"], options={"kv_offload": {"copy": "batched"}})
    batches = rounds(2)
    off = EngineCore(msgspec.structs.replace(cfg, kv_offload_bytes=0))
    try:
        expected = run(off, batches[0])
    finally:
        off.close()
    core = EngineCore(cfg)
    try:
        assert run(core, batches[0]) == expected
        core.sleep(1)
        core.wake_up()
        backend = core.backend
        assert isinstance(backend, CudaBackend) and backend.kv_worker is not None
        copier = backend.kv_worker._copier
        assert (
            copier is not None and copier.blocks.data_ptr() == backend.runner.kv_tensor.data_ptr()
        )
        again = run(core, [(f"again-{r}", p) for r, p in batches[1]])
        assert list(again.values()) == list(expected.values())
        kv = core.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        core.close()


def _worker(agree: Any) -> Any:
    from engine_core_cuda._kv_offload import CudaHostWorker, KVOffloadOptions

    from engine_core.kv_connector import KVConnectorLayout

    kv = torch.randn(2, 2, 8, BLOCK, 1, 4)
    page = kv[:, :, 0].numel() * kv.element_size()
    layout = KVConnectorLayout(
        num_blocks=8, block_size=BLOCK, kv_groups=[[0, 1]], group_kinds=["full_attention"],
        group_spans=[None], page_size_bytes=page,
    )  # fmt: skip
    worker = CudaHostWorker(
        EngineConfig(kv_offload_bytes=4 * page), layout, KVOffloadOptions(), torch.device("cpu"),
        rank=0, tp_size=2, agree=agree,
    )  # fmt: skip
    worker.register_kv_caches(kv)
    return worker, kv


def test_ranks_report_a_transfer_once_every_rank_finished_it() -> None:
    from engine_core.kv_connector import KVConnectorMetadata, KVTransfer

    other: list[int] = []  # what the other rank contributes to the maximum

    def agree(values: list[int]) -> list[int]:
        return [max(v, o) for v, o in zip(values, other or [0] * len(values), strict=True)]

    worker, kv = _worker(agree)
    save = KVTransfer("s", "a", [[3, 5]], [[0, 1]], num_tokens=2 * BLOCK)
    worker.start_step(KVConnectorMetadata(saves=[save]))
    other[:] = [1]  # the other rank's save is still in flight
    assert worker.get_finished() is None and worker.num_in_flight == 1
    other[:] = [0]
    report = worker.get_finished()
    assert report is not None and report.finished_saves == ["s"]
    assert report.bytes_stored == 2 * 2 * worker.host.page_bytes  # both ranks' shards
    # A load the other rank failed one block of: failed everywhere; the rest is loaded.
    load = KVTransfer("a", "a", [[6, 7]], [[0, 1]], num_tokens=2 * BLOCK)
    worker.start_step(KVConnectorMetadata(loads=[load]))
    other[:] = [0, 0, 1]  # per transfer, then per block: block 7 failed there
    report = worker.get_finished()
    assert report is not None and report.finished_loads == ["a"]
    assert report.failed_block_ids == [[7]]
    assert torch.equal(kv[:, :, 6], kv[:, :, 3])
    # A load from a slot nothing was saved into fails on this rank by itself.
    other[:] = []
    worker.start_step(KVConnectorMetadata(loads=[KVTransfer("b", "b", [[2]], [[3]])]))
    report = worker.get_finished()
    assert report is not None and report.failed_block_ids == [[2]]
    worker.close()


def test_tp2_a_raising_worker_half_ends_the_engine_without_a_hang(
    tiny: dict[str, TinyModel],
) -> None:
    fault = {"kv_offload": {"fault": {"kind": "raise", "probability": 1.0}}}
    core = EngineCore(config(tiny["llama"], tensor_parallel_size=2, options=fault))
    started = time.monotonic()
    try:
        with pytest.raises(Exception) as info:
            for batch in rounds(2):
                run(core, batch)
        text = []
        exc: BaseException | None = info.value
        while exc is not None:
            text.append(str(exc))
            exc = exc.__cause__ or exc.__context__
        assert any("kv_offload fault injected" in t for t in text), text
    finally:
        core.close()
    assert time.monotonic() - started < 60


def test_a_bad_kv_offload_option_fails_at_construction(tiny: dict[str, TinyModel]) -> None:
    bad = config(tiny["llama"], offload=0, options={"kv_offload": {"copy": "sideways"}})
    with pytest.raises(ValueError, match=r"backend_options\['kv_offload'\]\['copy'\]"):
        CudaBackend(bad)
