"""The CUDA backend's worker half of the ``"pd"`` connector (``docs/disaggregation.md``): the
KV blocks of a prompt, computed on a prefill engine, copied into a decode engine's blocks.

The KV cache is one tensor ``[slots, 2, blocks, block_size, kv_heads, head_size]``
(``ModelRunner.kv_cache_shape``); a block's page is ``kv[:, :, b]``, every layer of the group
that owns the page. A transfer names, per KV-cache group, the decode side's blocks and the
prefill side's (``-1``: nothing in that group there); pages are copied whole.

Paths, chosen per load:

- **same host: a handle of the KV tensor.** The prefill engine exports its KV tensor once with
  torch's reduction (``torch.multiprocessing``'s, what its queues send: a handle, not the bytes)
  into a file beside its handoff segment (``/dev/shm/<segment>.<tp rank>.ipc``, mode 0600, removed
  at close): on a GPU a CUDA IPC handle; on the CPU the tensor is first moved into shared memory
  (``share_memory_``, in place: the model's per-layer views stay valid; torch's ``file_system``
  strategy) when ``/dev/shm`` has room for twice its size. The decode engine opens it once per
  prefill engine and copies the pages (``index_select`` / ``index_copy_``, device to device on a
  GPU), then checks, after the copy finished, that the export is still published and its engine
  alive: otherwise the blocks were (or may have been) freed and the load fails.
- **another host, or no handle: the authenticated ZMQ transport**
  (``engine_core._engine.pipes.pd_transport``): the prefill engine's server reads the pages (this
  module's :meth:`CudaPDWorker.read_pages`, in the server's thread) between its two checks of
  the publication, the decode side writes them into its blocks.

Exports (the prefill side) are published at the step that starts them (``ready``) and given up,
withdrawn first, when the reader confirmed (``done``) or 0.8 × ``kv_lease_s`` after the reader's
last renewal; only then are they reported, and the core frees the blocks.

Tensor parallelism: every rank has a worker half for its own shard of the heads (its own
handle, ``/dev/shm/<segment>.<tp rank>.ipc``, and its own transfer server; the transfer
parameters carry every rank's ``addresses``); rank ``r`` of the decode engine pulls from rank
``r`` of the prefill engine, so both need the same ``tensor_parallel_size``. The ranks agree:
each finishes its loads within the step that starts them (before the forward pass) and an
all-reduce of their outcomes makes a load valid only where it is valid on every rank; rank 0
alone publishes, gives up and reports (the ranks' servers read rank 0's handoff segment). No
draft model: it is refused at startup, naming the setting.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from engine_core._core.pd_connector import (
    ZMQ,
    HandoffSegment,
    attach,
    register_link,
    renew,
    segment_name,
)
from engine_core._engine.pipes.pd_transport import NOT_YET, OK, READ, RENEW, PDRemote
from engine_core.abc import AsyncModelRunnerOutput, ModelRunnerOutput
from engine_core.config import EngineConfig
from engine_core.kv_connector import (
    KVConnectorLayout,
    KVConnectorMetadata,
    KVConnectorReport,
    KVConnectorWorker,
    KVTransfer,
)

__all__ = [
    "CudaPDWorker",
    "copy_pages",
    "ipc_copy_probe",
    "ipc_path",
    "layout_from_text",
    "layout_text",
    "with_report",
]

_WORKER_LEASE = 0.8
"""An export is given up at this fraction of ``kv_lease_s`` after the reader's last renewal:
before the core's own lease, so it is withdrawn before its blocks are freed."""
_DEADLINE_S = 5.0
"""The longest a load waits for its export to be published."""
_RENEW_S = 0.01


def ipc_path(segment: str, tp_rank: int = 0) -> str:
    """Where tensor-parallel rank ``tp_rank`` of the prefill engine of handoff segment
    ``segment`` keeps its KV tensor's handle."""
    return f"/dev/shm/{segment}.{tp_rank}.ipc"


def copy_pages(
    dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int]
) -> None:
    """Copy pages ``src[:, :, src_ids]`` into ``dst[:, :, dst_ids]`` (one device, or the source
    on another; the copy is ordered on the current stream)."""
    if not dst_ids:
        return
    index = torch.tensor(src_ids, dtype=torch.long, device=src.device)
    pages = src.index_select(2, index)
    if pages.device != dst.device:
        pages = pages.to(dst.device, non_blocking=False)
    dst.index_copy_(2, torch.tensor(dst_ids, dtype=torch.long, device=dst.device), pages)


class _Export:
    __slots__ = ("slot", "epoch", "since", "lease_s")

    def __init__(self, transfer: KVTransfer) -> None:
        params = transfer.params or {}
        self.slot = int(params["slot"])
        self.epoch = int(params["epoch"])
        self.since = time.monotonic()
        self.lease_s = float(params.get("lease_s", 30.0))


class _Load:
    __slots__ = ("transfer", "params", "since", "rid", "read_at", "renewed", "dst", "src")

    def __init__(self, transfer: KVTransfer) -> None:
        self.transfer = transfer
        self.params: dict[str, Any] = transfer.params or {}
        self.since = time.monotonic()
        self.rid: int | None = None
        self.read_at = 0.0
        self.renewed = 0.0
        pairs = [
            (d, s)
            for ids, remote in zip(transfer.block_ids, transfer.remote, strict=True)
            for d, s in zip(ids, remote, strict=True)
            if d >= 0 and s >= 0
        ]
        self.dst = [d for d, _ in pairs]
        self.src = [s for _, s in pairs]


class CudaPDWorker(KVConnectorWorker):
    """See the module."""

    def __init__(
        self,
        config: EngineConfig,
        layout: KVConnectorLayout,
        *,
        tp_rank: int = 0,
        segment: str | None = None,
        parallel: Any = None,
    ) -> None:
        """``tp_rank``, ``segment`` (rank 0's handoff segment) and ``parallel`` (the
        tensor-parallel group, for the ranks' agreement) under tensor parallelism."""
        super().__init__(config, layout, tp_rank)
        self.tp_rank = tp_rank
        self.tp_size = config.tensor_parallel_size
        self._parallel = parallel
        if config.speculative_config is not None:
            raise ValueError(
                "kv_connector 'pd' on the cuda backend does not carry a draft model's KV: "
                "speculative_config and disaggregating engine_roles do not run together"
            )
        self.rank = config.data_parallel_rank
        self.segment_name = segment or segment_name(os.getpid(), self.rank)
        self._segment: HandoffSegment | None = None
        self._kv_of: Callable[[], torch.Tensor | None] = lambda: None
        self._exports: dict[str, _Export] = {}
        self._loads: dict[str, _Load] = {}
        self._report = KVConnectorReport()
        self._ipc_file: str | None = None
        self._exported: torch.Tensor | None = None
        self._peers: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}
        """Decode side: the prefill engines' KV tensors opened by their handles, with the
        handle file's (inode, mtime) they were opened from."""
        self._renew = bool(config.kv_connector_options.get("renew", True))
        self._lock = threading.Lock()
        """With async scheduling a step's report is taken in a worker thread while the next
        step starts: one at a time."""
        self._remote = PDRemote.from_config(config, self.segment_name, payload=self.read_pages)
        if self._remote is not None and tp_rank == 0:
            register_link(self.rank, self._remote)

    @staticmethod
    def segment_of(config: EngineConfig) -> str:
        """The handoff segment of this process's engine (rank 0's)."""
        return segment_name(os.getpid(), config.data_parallel_rank)

    @property
    def address(self) -> str:
        """This rank's transfer server ("" without the transport)."""
        return self._remote.address if self._remote is not None else ""

    def set_addresses(self, addresses: list[str]) -> None:
        """Rank 0: every rank's server, in rank order (the transfer parameters carry them)."""
        if self._remote is not None:
            self._remote.addresses = list(addresses)

    def register_kv_caches(self, kv_caches: Any) -> None:
        """``kv_caches``: the runner's one KV tensor (registered again when it is reallocated,
        after a sleep: its handle is then exported anew), or a callable returning it."""
        getter = kv_caches if callable(kv_caches) else (lambda: kv_caches)
        kv = getter()
        if not isinstance(kv, torch.Tensor) or kv.dim() != 6:
            raise TypeError("the cuda backend's pd connector needs the allocated KV tensor")
        self._kv_of = getter
        self._export_handle(kv)

    def _export_handle(self, kv: torch.Tensor) -> None:
        """Publish the handle of ``kv`` (again after the runner reallocated it: a sleep), or
        remove a stale one when this tensor gets none (the ZMQ path then serves)."""
        self._exported = kv
        if kv.device.type == "cpu" and _shm_room(kv.numel() * kv.element_size()):
            import torch.multiprocessing as tmp

            tmp.set_sharing_strategy("file_system")  # a handle any process can open by name
            kv.share_memory_()  # in place: the layers' views of it stay valid
        elif kv.device.type != "cuda":
            self._remove_handle()
            return
        self._export_ipc(kv)

    @property
    def _kv(self) -> torch.Tensor | None:
        return self._kv_of()

    def _export_ipc(self, kv: torch.Tensor) -> None:
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers torch's reductions: handles, not bytes)

        handle = bytes(ForkingPickler.dumps(kv))
        path = ipc_path(self.segment_name, self.tp_rank)
        fresh = f"{path}.{time.monotonic_ns()}"
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(handle)
        os.replace(fresh, path)  # a new file: readers see another inode and reopen it
        self._ipc_file = path

    def _remove_handle(self) -> None:
        if self._ipc_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ipc_file)
            self._ipc_file = None

    def _own_segment(self) -> HandoffSegment:
        if self._segment is None:
            segment = attach(self.segment_name)  # created by the scheduler half, this process
            if segment is None:
                raise RuntimeError("the pd connector's handoff segment is missing")
            self._segment = segment
        return self._segment

    # -- the prefill side -------------------------------------------------------------------------

    def read_pages(self, blocks: list[list[int]]) -> bytes:
        """The pages of ``blocks`` (per group; ``-1`` skipped), as bytes after a header naming
        their dtype and page shape (:func:`_page_header`): what the transfer server sends (from
        its thread; the blocks are held, nothing writes them)."""
        kv = self._kv
        ids = [b for group in blocks for b in group if b >= 0]
        if kv is None or not ids:
            return b""
        pages = kv.index_select(2, torch.tensor(ids, dtype=torch.long, device=kv.device))
        body = pages.cpu().contiguous().view(torch.uint8).numpy().tobytes()
        return _page_header(kv) + body

    def _publish(self, save: KVTransfer) -> None:
        kv = self._kv
        if kv is not None and kv is not self._exported:
            self._export_handle(kv)  # reallocated (a sleep): readers must not use the old one
        if self.tp_rank:
            return  # rank 0 publishes and gives up (its segment); this rank's server serves
        export = _Export(save)
        self._own_segment().ready[export.slot] = export.epoch  # ``done``/``renew`` were reset
        self._exports[save.transfer_id] = export

    def _finish_exports(self, report: KVConnectorReport) -> None:
        segment = self._own_segment()
        wall = time.monotonic()
        for transfer_id, export in list(self._exports.items()):
            confirmed = segment.done[export.slot] == export.epoch
            if not confirmed:
                renewed = max(export.since, segment.renew[export.slot])
                if wall - renewed <= export.lease_s * _WORKER_LEASE:
                    continue
            segment.ready[export.slot] = -export.epoch  # withdrawn before the blocks are freed
            del self._exports[transfer_id]
            (report.finished_saves if confirmed else report.failed_saves).append(transfer_id)

    # -- the decode side --------------------------------------------------------------------------

    def start_step(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is None:
            return
        with self._lock:
            self._start_step(metadata)

    def _start_step(self, metadata: KVConnectorMetadata) -> None:
        for transfer_id in metadata.cancelled:
            self._loads.pop(transfer_id, None)
        for save in metadata.saves:
            self._publish(save)
        for transfer in metadata.loads:
            if transfer.transfer_id in self._loads:
                raise RuntimeError(f"KV load {transfer.transfer_id!r} started twice")
            self._loads[transfer.transfer_id] = _Load(transfer)
        if self._loads and self.tp_size > 1:
            self._agree_loads()
        elif self._loads:
            self._step_loads()  # before the forward pass: the copies run ahead of it

    def _agree_loads(self) -> None:
        """Tensor parallelism: finish every load now, on every rank, and keep one only where
        every rank delivered its shard (the same loads in the same order on each rank)."""
        loads = list(self._loads.items())
        outcomes: list[bool] = []
        for _transfer_id, load in loads:
            outcome = None
            while outcome is None:
                outcome = self._load_once(load)
                if outcome is None:
                    time.sleep(0.001)
            outcomes.append(outcome)
        flags = torch.tensor([1.0 if ok else 0.0 for ok in outcomes])
        kv = self._kv
        if kv is not None and self._parallel is not None:
            flags = self._parallel.all_reduce(flags.to(kv.device)).cpu()
        self._loads.clear()
        report = self._report
        for (transfer_id, load), total in zip(loads, flags.tolist(), strict=True):
            self._record(report, transfer_id, load, total >= self.tp_size - 0.5)

    def get_finished(self) -> KVConnectorReport | None:
        with self._lock:
            return self._get_finished()

    def _get_finished(self) -> KVConnectorReport | None:
        report, self._report = self._report, KVConnectorReport()
        if self._exports:
            self._finish_exports(report)
        if self._loads:
            self._step_loads(report)
        return None if report.is_empty else report

    def _load_once(self, load: _Load) -> bool | None:
        segment = str(load.params.get("segment", ""))
        via_handle = (
            load.params.get("via") != ZMQ
            and bool(segment)
            and os.path.exists(ipc_path(segment, self.tp_rank))
        )
        return self._handle_load(load) if via_handle else self._zmq_load(load)

    def _step_loads(self, report: KVConnectorReport | None = None) -> None:
        report = report if report is not None else self._report
        for transfer_id, load in list(self._loads.items()):
            outcome = self._load_once(load)
            if outcome is None:
                continue
            del self._loads[transfer_id]
            self._record(report, transfer_id, load, outcome)

    def _record(
        self, report: KVConnectorReport, transfer_id: str, load: _Load, outcome: bool
    ) -> None:
        report.finished_loads.append(transfer_id)
        report.load_s += time.monotonic() - load.since
        if outcome:
            report.bytes_loaded += len(load.dst) * self.layout.page_size_bytes
        else:
            failed = [[b for b in ids if b >= 0] for ids in load.transfer.block_ids]
            report.failed_block_ids = _merged(report.failed_block_ids, failed)

    def _handle_load(self, load: _Load) -> bool | None:
        """Same host. None: not published yet; then whether the copy is valid."""
        params = load.params
        segment = attach(str(params.get("segment", "")))
        slot, epoch = int(params.get("slot", -1)), int(params.get("epoch", 0))
        if segment is None or not segment.owner_alive() or not 0 <= slot < segment.num_blocks:
            return False
        if segment.ready[slot] != epoch:
            if segment.ready[slot] != -epoch and time.monotonic() - load.since <= _DEADLINE_S:
                return None
            return False
        source = self._peer(segment.name, self.tp_rank)
        kv = self._kv
        if source is None or kv is None:
            return False
        if source.dtype != kv.dtype or _page_shape(source) != _page_shape(kv):
            return False  # another model, shard (tensor-parallel size) or KV dtype
        if self._renew:
            renew(params)
        copy_pages(kv, load.dst, source, load.src)
        for device in {kv.device, source.device}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        # After the copy: still published (so held the whole time) and its engine alive.
        return segment.ready[slot] == epoch and segment.owner_alive()

    def _peer(self, segment: str, tp_rank: int) -> torch.Tensor | None:
        """The KV tensor of ``segment``'s engine, reopened when its handle changed."""
        try:
            stat = os.stat(ipc_path(segment, tp_rank))
        except OSError:
            self._peers.pop(segment, None)
            return None
        key = (stat.st_ino, stat.st_mtime_ns)
        known = self._peers.get(segment)
        if known is not None and known[0] == key:
            return known[1]
        try:
            with open(ipc_path(segment, tp_rank), "rb") as f:
                opened = pickle.load(f)  # written by this user's engine (mode 0600)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
            return None
        if not isinstance(opened, torch.Tensor):
            return None
        self._peers[segment] = (key, opened)
        return opened

    def _zmq_load(self, load: _Load) -> bool | None:
        """Over the transport. None: in flight; then whether the pages were delivered."""
        remote, kv = self._remote, self._kv
        params = load.params
        addresses = params.get("addresses") or [params.get("address")]
        if remote is None or kv is None or len(addresses) != self.tp_size:
            return False  # another tensor-parallel size: the shards do not line up
        address = str(addresses[self.tp_rank] or "")
        if not address:
            return False
        client = remote.client
        slot, epoch = int(params.get("slot", -1)), int(params.get("epoch", 0))
        client.poll()
        if client.state(address) in ("refused", "gone"):
            return False
        if load.rid is None:
            load.rid = client.send(address, READ, slot, epoch, [load.src])
            load.read_at = time.monotonic()
            answer = client.wait(load.rid, timeout_s=0.05)
        else:
            answer = client.take(load.rid)
        if answer is None:
            now = time.monotonic()
            if now - load.read_at > remote.timeout_s:
                return False
            if self._renew and now - load.renewed >= _RENEW_S:
                client.send(address, RENEW, slot, epoch)
                load.renewed = now
            return None
        status, _contents, payload = answer
        if status == NOT_YET and time.monotonic() - load.since <= _DEADLINE_S:
            load.rid = None  # published at the prefill engine's next step: ask again
            return None
        if status != OK:
            return False
        header = _page_header(kv)
        if payload[: len(header)] != header:
            return False  # another KV dtype or page shape (model, tensor-parallel shard)
        body = payload[len(header) :]
        shape = (kv.shape[0], kv.shape[1], len(load.src), *kv.shape[3:])
        expected = kv.element_size() * kv.shape[0] * kv.shape[1] * len(load.src)
        expected *= kv.shape[3] * kv.shape[4] * kv.shape[5]
        if len(body) != expected:
            return False
        pages = torch.frombuffer(bytearray(body), dtype=torch.uint8).view(kv.dtype).view(shape)
        dst = torch.tensor(load.dst, dtype=torch.long, device=kv.device)
        kv.index_copy_(2, dst, pages.to(kv.device))
        return True

    def close(self) -> None:
        self._loads.clear()
        self._exports.clear()
        self._peers.clear()
        if self._remote is not None:
            if self.tp_rank == 0:
                register_link(self.rank, None)
            self._remote.close()
            self._remote = None
        self._remove_handle()
        self._exported = None
        self._segment = None


def layout_text(layout: KVConnectorLayout) -> str:
    """``layout`` as text, for the tensor-parallel workers' call."""
    return msgspec.json.encode(layout).decode()


def layout_from_text(text: str) -> KVConnectorLayout:
    return msgspec.json.decode(text, type=KVConnectorLayout)


def _page_shape(kv: torch.Tensor) -> tuple[int, ...]:
    return (kv.shape[0], kv.shape[1], *kv.shape[3:])


def _page_header(kv: torch.Tensor) -> bytes:
    """What pages sent over ZMQ start with: their dtype and page shape, length-prefixed."""
    text = msgspec.msgpack.encode([str(kv.dtype), list(_page_shape(kv))])
    return len(text).to_bytes(4, "little") + text


def _shm_room(size: int) -> bool:
    """Whether ``/dev/shm`` has room for twice ``size`` bytes (else the ZMQ path serves)."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize >= 2 * size


def _merged(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    if not a:
        return b
    return [x + y for x, y in zip(a, b, strict=True)]


class _WithReport(AsyncModelRunnerOutput):
    """A launched step whose output carries the connector's report of that step's end."""

    def __init__(self, handle: AsyncModelRunnerOutput, worker: KVConnectorWorker) -> None:
        self._handle = handle
        self._worker = worker

    def get_output(self) -> ModelRunnerOutput:
        output = self._handle.get_output()
        self.device_time_s = self._handle.device_time_s
        output.kv_connector_report = self._worker.get_finished()
        return output


def with_report(
    handle: AsyncModelRunnerOutput, worker: KVConnectorWorker
) -> AsyncModelRunnerOutput:
    """``handle``, its output carrying ``worker``'s report (async scheduling)."""
    return _WithReport(handle, worker)


def ipc_copy_probe(inbox: Any, outbox: Any) -> None:
    """The decode side of ``bench/gpu_check.py``'s ``pd_ipc`` check, in a process of its own:
    takes a KV tensor from ``inbox`` (a ``torch.multiprocessing`` queue: CUDA IPC on a GPU,
    shared memory on the CPU), copies every page into its own tensor ``repeats`` times with
    :func:`copy_pages` and puts ``(seconds per copy, equal)`` in ``outbox``."""
    src, repeats = inbox.get()
    dst = torch.empty_like(src)
    ids = list(range(src.shape[2]))
    order = ids[::-1]  # another block id for each page, as a decode engine's would be
    sync = torch.cuda.synchronize if src.device.type == "cuda" else (lambda: None)
    copy_pages(dst, order, src, ids)  # warm-up
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        copy_pages(dst, order, src, ids)
    sync()
    elapsed = (time.perf_counter() - started) / repeats
    equal = bool(torch.equal(dst.flip(2), src))
    outbox.put((elapsed, equal))
    inbox.get()  # the exporter's "done": it keeps its tensor alive until then
