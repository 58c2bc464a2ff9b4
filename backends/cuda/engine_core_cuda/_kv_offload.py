"""The CUDA backend's half of the host KV tier (the built-in ``"host"`` connector's worker half).

- **Host buffer** (:class:`HostBuffer`): one tensor of ``num_slots`` host slots, pinned on a
  GPU, plain memory on the CPU. A slot is one page in a cross-layer contiguous layout: every
  layer slot of the page, K and V, ``block_size`` tokens (``[slots, 2, block_size, kv_heads,
  head_size]`` bytes, ``KVConnectorLayout.page_size_bytes``), so one block moves in one
  contiguous run, whatever the model's layer count. Bytes, not elements: an FP8 cache moves
  its bytes as they are.
- **Block copier** (:class:`BlockCopier`): a transfer's device blocks are gathered into one
  contiguous device buffer with one indexed copy (the device cache keeps a block's layers
  apart: ``[slots, 2, num_blocks, ...]``), then moved with one copy per run of consecutive host
  slots; a load is the reverse (runs of host slots into a device buffer, one indexed scatter).
  On a GPU each direction has its own stream (loads and saves overlap, and both overlap the
  forward pass): the copy stream first waits on an event recorded on the compute stream (the
  blocks' earlier writes and reads), and an event recorded after the copies tells when it is
  done. Nothing on the step's path waits for the host: ``get_finished`` only queries events.
  On the CPU the same code runs synchronously, with one strided copy per block by default
  (``copy``: torch's gather kernels cost more than they save on a CPU's few threads).
- **Worker half** (:class:`CudaHostWorker`): applies a step's cancelled transfers (the compute
  stream waits on their events, so no copy touches the blocks once they change hands), starts
  saves then loads, and reports what finished. A load from a slot that holds no stored block,
  or one past ``deadline_s``, is reported failed for its blocks (the core recomputes them;
  the compute stream waits on a late copy's event, so its bytes can never land on a block
  after it was recomputed). Under tensor parallelism every rank runs it on its shard of the
  cache, and the ranks agree, by a small host-side all-reduce over a ``gloo`` group, on what
  finished (on every rank) and what failed (on any rank); rank 0's report is then the merge.

``backend_options["kv_offload"]`` (all optional): ``copy``, ``"batched"`` (the GPU's default)
or ``"per_block"`` (the CPU's); ``deadline_s`` (default 10.0), the longest a
load may take before it is reported failed; ``fault``: ``{"kind": "drop" | "raise",
"probability": p, "seed": s}`` injected per load (tests: ``drop`` reports the load's blocks
failed, ``raise`` raises from the worker half, which is a backend error).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch

from engine_core.abc import AsyncModelRunnerOutput, ModelRunnerOutput
from engine_core.config import EngineConfig
from engine_core.kv_connector import (
    KVConnectorLayout,
    KVConnectorMetadata,
    KVConnectorReport,
    KVConnectorWorker,
    KVTransfer,
    available_host_memory,
    check_host_memory,
    load_kv_connector,
)
from engine_core_cuda._options import KVOffloadOptions, parse_kv_offload

__all__ = [
    "BlockCopier",
    "CudaHostWorker",
    "HostBuffer",
    "KVOffloadOptions",
    "WithReport",
    "build_worker",
    "parse_kv_offload",
    "slot_runs",
]

CHUNK_BYTES = 64 << 20
"""Bytes a batched copy moves per gather or scatter (its device buffer, per direction)."""


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``(first host slot, first index into slots, length)`` of each run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((slots[start], start, i - start))
            start = i
    return runs


class HostBuffer:
    """``num_slots`` host slots of ``page_bytes`` bytes each, one tensor (pinned on a GPU)."""

    def __init__(self, num_slots: int, page_bytes: int, *, pin: bool) -> None:
        self.num_slots = num_slots
        self.page_bytes = page_bytes
        requested = num_slots * page_bytes
        try:
            self.data = torch.empty((num_slots, page_bytes), dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as exc:
            raise ValueError(
                f"kv_offload_bytes (--kv-offload-bytes): {requested} bytes of host memory could "
                f"not be {'pinned' if pin else 'allocated'} ({exc}); available: "
                f"{available_host_memory()} bytes; give a smaller size (or 0 to turn the host "
                "tier off)"
            ) from exc


class BlockCopier:
    """Batched copies of whole blocks between the device KV tensor and a :class:`HostBuffer`.

    ``kv``: the cache, ``[slots, 2, num_blocks, block_size, kv_heads, head_size]`` of any dtype.
    Its bytes are viewed block-major (``[num_blocks, slots, 2, block_size, ...]``, no copy), so
    one indexed gather or scatter on the device moves a transfer's blocks to or from one
    contiguous buffer, and the buffer moves to or from the host in one copy per run of
    consecutive host slots."""

    def __init__(self, kv: torch.Tensor, host: HostBuffer, chunk_bytes: int = CHUNK_BYTES) -> None:
        if not kv.is_contiguous():
            raise ValueError("the KV cache tensor must be contiguous")
        raw = kv.view(torch.uint8) if kv.dtype != torch.uint8 else kv
        self.blocks = raw.movedim(2, 0)
        """``[num_blocks, slots, 2, block_size, kv_heads, head_bytes]`` (a view of the cache)."""
        self.block_shape = tuple(self.blocks.shape[1:])
        page = 1
        for n in self.block_shape:
            page *= n
        if page != host.page_bytes:
            raise ValueError(
                f"a device block is {page} bytes but a host slot {host.page_bytes} bytes: the "
                "layout's page_size_bytes does not match the KV cache"
            )
        self.host = host
        self.device = kv.device
        self.on_gpu = kv.device.type == "cuda"
        self.chunk = max(1, chunk_bytes // page)
        """Blocks per gather or scatter: a transfer moves in chunks through one device buffer
        per direction (reused in stream order), so a long prompt's load takes no more device
        memory than this."""
        self._staging: dict[str, torch.Tensor] = {}

    def _buffer(self, direction: str) -> torch.Tensor:
        """The device buffer of ``direction``, allocated on first use (on the copy stream when
        called under it, so the stream's order guards its reuse)."""
        buffer = self._staging.get(direction)
        if buffer is None:
            buffer = torch.empty(
                (self.chunk, self.host.page_bytes), dtype=torch.uint8, device=self.device
            )
            self._staging[direction] = buffer
        return buffer

    def _chunks(self, block_ids: list[int], slots: list[int]) -> list[tuple[list[int], list[int]]]:
        step = self.chunk
        return [
            (block_ids[i : i + step], slots[i : i + step]) for i in range(0, len(block_ids), step)
        ]

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        index = torch.tensor(block_ids, dtype=torch.int64, pin_memory=self.on_gpu)
        return index.to(self.device, non_blocking=True) if self.on_gpu else index

    def save(self, block_ids: list[int], slots: list[int]) -> list[Any]:
        """Device blocks into host slots; returns what must live until the copies end."""
        keep: list[Any] = []
        host = self.host.data
        buffer = self._buffer("save")
        for ids, chunk_slots in self._chunks(block_ids, slots):
            index = self._index(ids)
            gathered = buffer[: len(ids)]
            torch.index_select(
                self.blocks, 0, index, out=gathered.view(len(ids), *self.block_shape)
            )
            for slot, offset, length in slot_runs(chunk_slots):
                host[slot : slot + length].copy_(
                    gathered[offset : offset + length], non_blocking=self.on_gpu
                )
            keep.append(index)
        return keep

    def load(self, block_ids: list[int], slots: list[int]) -> list[Any]:
        """Host slots into device blocks; returns what must live until the copies end."""
        keep: list[Any] = []
        host = self.host.data
        buffer = self._buffer("load")
        for ids, chunk_slots in self._chunks(block_ids, slots):
            staging = buffer[: len(ids)]
            for slot, offset, length in slot_runs(chunk_slots):
                staging[offset : offset + length].copy_(
                    host[slot : slot + length], non_blocking=self.on_gpu
                )
            index = self._index(ids)
            self.blocks.index_copy_(0, index, staging.view(len(ids), *self.block_shape))
            keep.append(index)
        return keep

    def save_per_block(self, block_ids: list[int], slots: list[int]) -> list[Any]:
        """One strided copy per block: the CPU's default (torch's gather kernels cost more
        there than they save), and the reference the batched copy is measured against."""
        host = self.host.data
        for block_id, slot in zip(block_ids, slots, strict=True):
            host[slot].view(self.block_shape).copy_(self.blocks[block_id], non_blocking=self.on_gpu)
        return []

    def load_per_block(self, block_ids: list[int], slots: list[int]) -> list[Any]:
        host = self.host.data
        for block_id, slot in zip(block_ids, slots, strict=True):
            self.blocks[block_id].copy_(host[slot].view(self.block_shape), non_blocking=self.on_gpu)
        return []


class _Pending:
    __slots__ = ("transfer", "is_load", "start", "event", "keep", "failed", "entries", "nbytes")

    def __init__(self, transfer: KVTransfer, is_load: bool, start: float) -> None:
        self.transfer = transfer
        self.is_load = is_load
        self.start = start
        self.event: torch.cuda.Event | None = None
        self.keep: list[Any] = []
        self.failed: list[list[int]] = [[] for _ in transfer.block_ids]
        """Per group, device blocks of this load that cannot get valid KV (known at start)."""
        self.entries: list[tuple[int, int]] = []
        """(device block, host slot) pairs moved, all groups together."""
        self.nbytes = 0

    def done(self) -> bool:
        return self.event is None or self.event.query()


AgreeFn = Callable[[list[int]], list[int]]
"""Element-wise maximum of an int list over the tensor-parallel ranks."""


class CudaHostWorker(KVConnectorWorker):
    """The worker half of the ``"host"`` connector on the CUDA backend (see the module)."""

    def __init__(
        self,
        config: EngineConfig,
        layout: KVConnectorLayout,
        options: KVOffloadOptions,
        device: torch.device,
        rank: int = 0,
        tp_size: int = 1,
        agree: AgreeFn | None = None,
    ) -> None:
        super().__init__(config, layout, rank)
        self.options = options
        self.device = device
        self.tp_size = tp_size
        self._agree = agree
        requested = int(config.kv_offload_bytes)
        available = available_host_memory()
        # Every rank pins its own shard of each slot (page_size_bytes is per rank).
        check_host_memory(requested, None if available is None else available // tp_size)
        self.num_slots = requested // layout.page_size_bytes
        self.on_gpu = device.type == "cuda"
        self.host = HostBuffer(self.num_slots, layout.page_size_bytes, pin=self.on_gpu)
        self._valid = [False] * self.num_slots
        """Per host slot: it holds a block whose save ended."""
        self._copier: BlockCopier | None = None
        self._pending: dict[str, _Pending] = {}
        self._load_stream: torch.cuda.Stream | None = None
        self._save_stream: torch.cuda.Stream | None = None
        if self.on_gpu:
            self._load_stream = torch.cuda.Stream(device)
            self._save_stream = torch.cuda.Stream(device)
        self._rng = random.Random(options.fault_seed)
        self.num_loads = 0
        self.num_saves = 0

    def register_kv_caches(self, kv_caches: Any) -> None:
        """``kv_caches``: the one KV tensor ``[slots, 2, num_blocks, block_size, ...]``."""
        if not isinstance(kv_caches, torch.Tensor):
            raise TypeError(f"the host tier registers the KV cache tensor, got {type(kv_caches)}")
        self.release_kv_caches()
        self._copier = BlockCopier(kv_caches, self.host)
        batched = self.options.copy == "batched" or (self.options.copy is None and self.on_gpu)
        copier = self._copier
        self._save = copier.save if batched else copier.save_per_block
        self._load = copier.load if batched else copier.load_per_block

    # -- steps ----------------------------------------------------------------------------------

    def start_step(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is None:
            return
        copier = self._copier
        if copier is None:
            raise RuntimeError("the host tier started a step before register_kv_caches")
        for transfer_id in metadata.cancelled:
            pending = self._pending.pop(transfer_id, None)
            if pending is None:
                continue
            if pending.event is not None:
                # The blocks change hands in this step: its forward pass runs after the copies.
                torch.cuda.current_stream(self.device).wait_event(pending.event)
            if not pending.is_load:
                for _block, slot in pending.entries:
                    self._valid[slot] = False
        if not (metadata.saves or metadata.loads):
            return
        ready: torch.cuda.Event | None = None
        if self.on_gpu:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        now = time.monotonic()
        for save in metadata.saves:
            pending = self._begin(save, False, now)
            for _block, slot in pending.entries:
                self._valid[slot] = False  # until this save ends
            self._run(pending, self._save_stream, ready, self._save)
        for load in metadata.loads:
            pending = self._begin(load, True, now)
            kind = self._draw()
            if kind == "raise":
                raise RuntimeError("kv_offload fault injected: the host tier's worker half raised")
            if kind == "drop":
                for g, ids in enumerate(load.block_ids):
                    pending.failed[g] = [b for b in ids if b >= 0]
                pending.entries = []
            self._run(pending, self._load_stream, ready, self._load)

    def _draw(self) -> str | None:
        kind = self.options.fault_kind
        if kind is None:
            return None
        return kind if self._rng.random() < self.options.fault_probability else None

    def _begin(self, transfer: KVTransfer, is_load: bool, now: float) -> _Pending:
        if transfer.transfer_id in self._pending:
            raise RuntimeError(
                f"KV transfer {transfer.transfer_id!r} started while one of that id is in flight"
            )
        if len(transfer.remote) != len(transfer.block_ids) or any(
            len(r) != len(b) for r, b in zip(transfer.remote, transfer.block_ids, strict=True)
        ):
            raise RuntimeError(
                f"KV transfer {transfer.transfer_id!r}: host slots and block ids differ in shape"
            )
        pending = _Pending(transfer, is_load, now)
        for g, (ids, slots) in enumerate(zip(transfer.block_ids, transfer.remote, strict=True)):
            for block_id, slot in zip(ids, slots, strict=True):
                if block_id < 0 and slot < 0:
                    continue
                if block_id < 0 or not 0 <= slot < self.num_slots:
                    raise RuntimeError(
                        f"KV transfer {transfer.transfer_id!r}: host slot {slot} (block "
                        f"{block_id}) is outside the host pool ({self.num_slots} slots)"
                    )
                if is_load and not self._valid[slot]:
                    pending.failed[g].append(block_id)  # nothing stored there: recompute
                else:
                    pending.entries.append((block_id, slot))
        self._pending[transfer.transfer_id] = pending
        return pending

    def _run(
        self,
        pending: _Pending,
        stream: torch.cuda.Stream | None,
        ready: torch.cuda.Event | None,
        copy: Callable[[list[int], list[int]], list[Any]],
    ) -> None:
        if not pending.entries:
            return
        blocks = [b for b, _ in pending.entries]
        slots = [s for _, s in pending.entries]
        pending.nbytes = len(blocks) * self.host.page_bytes
        if stream is None:
            copy(blocks, slots)
            return
        assert ready is not None
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            pending.keep = copy(blocks, slots)
            event = torch.cuda.Event()
            event.record(stream)
        pending.event = event

    def wait(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until a transfer in flight ends: for a step that
        schedules no tokens, which the core runs only while transfers are in flight."""
        end = time.monotonic() + timeout_s
        delay = 20e-6
        while self._pending and not any(p.done() for p in self._pending.values()):
            if time.monotonic() >= end:
                return
            time.sleep(delay)
            delay = min(2 * delay, 5e-4)

    def get_finished(self) -> KVConnectorReport | None:
        if not self._pending:
            return None
        now = time.monotonic()
        deadline_s = self.options.deadline_s
        order = list(self._pending.values())
        # Per transfer: 0 ended, 1 in flight, 2 load past its deadline; then per block entry
        # of the loads, 1 where it failed. Maxima over the ranks: ended on every rank, failed
        # on any.
        states: list[int] = []
        for p in order:
            if p.done():
                states.append(0)
            elif p.is_load and now - p.start > deadline_s:
                states.append(2)
            else:
                states.append(1)
        flags = [
            1 if b in p.failed[g] else 0
            for p in order
            if p.is_load
            for g, ids in enumerate(p.transfer.block_ids)
            for b in ids
            if b >= 0
        ]
        if self._agree is not None:
            agreed = self._agree(states + flags)
            states, flags = agreed[: len(order)], agreed[len(order) :]
        report = KVConnectorReport()
        failed: list[list[int]] = [[] for _ in range(self.layout.num_groups)]
        k = 0
        for p, state in zip(order, states, strict=True):
            entries: list[tuple[int, int]] = []
            if p.is_load:
                for g, ids in enumerate(p.transfer.block_ids):
                    for b in ids:
                        if b >= 0:
                            entries.append((g, b))
            if state == 1:
                k += len(entries)
                continue
            transfer_id = p.transfer.transfer_id
            del self._pending[transfer_id]
            elapsed = now - p.start
            if not p.is_load:
                self.num_saves += 1
                for _block, slot in p.entries:
                    self._valid[slot] = True
                report.finished_saves.append(transfer_id)
                report.bytes_stored += p.nbytes * self.tp_size
                report.store_s += elapsed
                continue
            self.num_loads += 1
            report.finished_loads.append(transfer_id)
            report.load_s += elapsed
            if state == 2:
                if p.event is not None:
                    # The blocks are recomputed in a later step: a late copy lands first.
                    torch.cuda.current_stream(self.device).wait_event(p.event)
                for g, b in entries:
                    failed[g].append(b)
                k += len(entries)
                continue
            for g, b in entries:
                if flags[k]:
                    failed[g].append(b)
                k += 1
            report.bytes_loaded += p.nbytes * self.tp_size
        if any(failed):
            report.failed_block_ids = failed
        return None if report.is_empty else report

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def release_kv_caches(self) -> None:
        """Wait for the copies in flight and let go of the KV tensor (the backend frees or
        replaces it: ``sleep``, a new ``initialize_kv_cache``). The transfers are still
        reported; the next ``register_kv_caches`` gives the copier the new tensor."""
        for pending in self._pending.values():
            if pending.event is not None:
                pending.event.synchronize()
                pending.event = None
            pending.keep = []
        self._copier = None

    def close(self) -> None:
        self.release_kv_caches()
        self._pending.clear()


def gloo_agree(group: Any) -> AgreeFn:
    """An :data:`AgreeFn` over the process group ``group`` (a ``gloo`` group: CPU tensors)."""
    import torch.distributed as dist

    def agree(values: list[int]) -> list[int]:
        if not values:
            return values
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return [int(v) for v in tensor.tolist()]

    return agree


class WithReport(AsyncModelRunnerOutput):
    """A launched step's handle whose output carries the connector's report."""

    __slots__ = ("_handle", "_report", "device_time_s")

    def __init__(self, handle: AsyncModelRunnerOutput, report: KVConnectorReport) -> None:
        self._handle = handle
        self._report = report
        self.device_time_s: float | None = None

    def get_output(self) -> ModelRunnerOutput:
        output = self._handle.get_output()
        self.device_time_s = self._handle.device_time_s
        output.kv_connector_report = self._report
        return output


def build_worker(
    config: EngineConfig,
    layout: KVConnectorLayout,
    name: str,
    device: torch.device,
    rank: int,
    parallel: Any | None,
) -> KVConnectorWorker:
    """The worker half of connector ``name`` on this rank: the host tier's own
    (:class:`CudaHostWorker`), or the plugin's (``KVConnectorProvider.worker``).
    ``NotImplementedError`` for a connector with no worker half for this backend."""
    if name != "host":
        if parallel is not None and parallel.size > 1:
            raise NotImplementedError(
                f"KV connector {name!r} under tensor parallelism: the cuda backend agrees on "
                "the ranks' reports for its own host tier only"
            )
        worker = load_kv_connector(name).worker(config, layout, "cuda", rank)
        if worker is None:
            raise NotImplementedError(
                f"the cuda backend has no worker half for KV connector {name!r}"
            )
        return worker
    options = parse_kv_offload(config.backend_options.get("kv_offload"))
    agree: AgreeFn | None = None
    size = 1
    if parallel is not None and parallel.size > 1:
        import torch.distributed as dist

        size = parallel.size
        # A gloo group: the ranks agree on host integers without touching the device stream.
        group = None if parallel.backend == "gloo" else dist.new_group(backend="gloo")
        agree = gloo_agree(group)
    return CudaHostWorker(config, layout, options, device, rank, size, agree)
