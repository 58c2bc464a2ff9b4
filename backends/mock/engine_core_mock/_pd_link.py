"""The mock's worker half of the ``"pd"`` connector: blocks handed from a prefill engine to a
decode engine through the handoff segments of ``engine_core._core.pd_connector`` (shared memory
of this host).

Bookkeeping, as everywhere in the mock: an export publishes the block ledger's fingerprint of
each block (the token prefix its KV is for), a load writes exactly those fingerprints into the
decode engine's blocks, so a wrong block makes the ledger raise where a real backend would give
wrong tokens. The copy is modelled by ``backend_options["kv_link"]`` (``bytes_per_s``,
``latency_s``, ``fault`` ``drop``/``late``; ``deadline_s`` is the longest a load may wait for
its export to be published before it fails).

Prefill side (saves): each export's blocks are held in the ledger (no request may be handed
one to write) until the reader's ``done`` word carries the export's epoch, or the lease ran out
since the reader's last renewal; then ``ready`` is cleared first and the save is reported
(``finished_saves`` / ``failed_saves``): only then does the core free the blocks.

Decode side (loads): a load waits for the export to be published, renews the lease while it
copies (every step), and at the end of the modelled copy reads the contents, then checks that
the prefill engine is alive and its export still published (``ready``): otherwise the blocks
were (or may have been) freed and are reported failed (the core cuts the request back and it
recomputes).

Between hosts (or with ``kv_connector_options["pd_transport"] = "zmq"``) a load goes over the
authenticated ZMQ transport (``engine_core._engine.pipes.pd_transport``) instead: the worker half of
each engine of a disaggregated deployment runs its server (answering for its segment) and its
client; a load renews the export over it while the modelled copy runs, then reads the
fingerprints, which the server gives only if the export was published before and after the
read. A refused handshake (other keys), a dropped connection (the prefill engine died) or no
answer within ``kv_connector_options["pd_timeout_s"]`` fails the load: the request recomputes.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any

from engine_core._core.pd_connector import (
    ZMQ,
    HandoffSegment,
    attach,
    register_link,
    renew,
    segment_name,
)
from engine_core._engine.pipes.pd_transport import NOT_YET, OK, READ, RENEW, PDRemote
from engine_core.config import EngineConfig
from engine_core.kv_connector import (
    KVConnectorLayout,
    KVConnectorMetadata,
    KVConnectorReport,
    KVConnectorWorker,
    KVTransfer,
)
from engine_core_mock._blocks import BlockLedger
from engine_core_mock._kv_link import KVLinkOptions

__all__ = ["MockPDWorker"]

_POLL_S = 0.002
"""How often an idle engine looks at the segments while transfers are in flight."""
_MASK = (1 << 64) - 1
_SPECIAL = _MASK - 2
"""Stored fingerprints at or above this are the ledger's "unwritten"/"discarded" markers."""
_RENEW_S = 0.01
"""How often a load over ZMQ renews its export while it copies."""
_WORKER_LEASE = 0.8
"""The worker half gives up an export at this fraction of ``kv_lease_s`` (after the reader's
last renewal): before the core's own lease, so tags are always cleared before a free."""


class _Export:
    __slots__ = ("transfer", "slot", "epoch", "blocks", "since", "lease_s")

    def __init__(self, transfer: KVTransfer, blocks: list[int], lease_s: float) -> None:
        params = transfer.params or {}
        self.transfer = transfer
        self.slot = int(params["slot"])
        self.epoch = int(params["epoch"])
        self.blocks = blocks
        self.since = time.monotonic()
        self.lease_s = lease_s


class _Load:
    __slots__ = (
        "transfer",
        "params",
        "since",
        "start",
        "end",
        "fault",
        "rid",
        "read_at",
        "renewed",
    )

    def __init__(self, transfer: KVTransfer, since: float, fault: str | None) -> None:
        self.transfer = transfer
        self.params: dict[str, Any] = transfer.params or {}
        self.since = since
        self.start: float | None = None
        """When the copy began (the export was published), on the mock's clock."""
        self.end = 0.0
        self.fault = fault
        self.rid: int | None = None
        """Over ZMQ: the read request once sent, and when (wall clock)."""
        self.read_at = 0.0
        self.renewed = -1.0


class MockPDWorker(KVConnectorWorker):
    """See the module."""

    def __init__(
        self,
        config: EngineConfig,
        layout: KVConnectorLayout,
        options: KVLinkOptions | None,
        clock: Callable[[], float],
        rank: int = 0,
    ) -> None:
        super().__init__(config, layout, rank)
        self.options = options = options if options is not None else KVLinkOptions()
        self._clock = clock
        self._page = layout.page_size_bytes
        self._ledger: BlockLedger | None = None
        self._segment: HandoffSegment | None = None
        self._exports: dict[str, _Export] = {}
        self._loads: dict[str, _Load] = {}
        self._link_free_at = 0.0
        self._holds = [0] * layout.num_blocks
        """Exports holding each block (siblings share their prompt's blocks)."""
        self._renew = bool(config.kv_connector_options.get("renew", True))
        fault = options.fault
        self._rng = random.Random(fault.seed) if fault is not None else None
        self.num_loads = 0
        self.num_failed_loads = 0
        self._remote = PDRemote.from_config(
            config, segment_name(os.getpid(), config.data_parallel_rank)
        )
        if self._remote is not None:
            register_link(config.data_parallel_rank, self._remote)

    def register_kv_caches(self, kv_caches: Any) -> None:
        if not isinstance(kv_caches, BlockLedger):
            raise TypeError(f"the mock's pd connector registers a BlockLedger, got {kv_caches!r}")
        self._ledger = kv_caches

    def _own_segment(self) -> HandoffSegment:
        if self._segment is None:
            # Created by the scheduler half, in this same process.
            segment = attach(segment_name(os.getpid(), self.config.data_parallel_rank))
            if segment is None:
                raise RuntimeError("the pd connector's handoff segment is missing")
            self._segment = segment
        return self._segment

    # -- steps --------------------------------------------------------------------------------

    def start_step(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is None:
            return
        ledger = self._ledger
        if ledger is None:
            raise RuntimeError("the mock's pd connector started a step before register_kv_caches")
        for transfer_id in metadata.cancelled:
            load = self._loads.pop(transfer_id, None)
            if load is not None:
                for ids in load.transfer.block_ids:
                    for block_id in ids:
                        ledger.unhold(block_id)
        for save in metadata.saves:
            self._export(save, ledger)
        now = self._clock()
        for transfer in metadata.loads:
            if transfer.transfer_id in self._loads:
                raise RuntimeError(f"KV load {transfer.transfer_id!r} started twice")
            for ids in transfer.block_ids:
                for block_id in ids:
                    ledger.hold(block_id)
            load = self._loads[transfer.transfer_id] = _Load(transfer, now, self._draw())
            if load.params.get("via") == ZMQ:
                self._start_copy(load, now)  # the read at its end checks the publication
                continue
            segment = attach(str(load.params.get("segment", "")))
            if segment is not None:
                self._try_start(load, segment, now)  # published already: the copy starts now

    def _draw(self) -> str | None:
        fault = self.options.fault
        if fault is None or self._rng is None:
            return None
        return fault.kind if self._rng.random() < fault.probability else None

    def _export(self, save: KVTransfer, ledger: BlockLedger) -> None:
        segment = self._own_segment()
        blocks = [b for ids in save.block_ids for b in ids]
        export = _Export(save, blocks, float((save.params or {}).get("lease_s", 30.0)))
        tags, contents, holds = segment.tags, segment.contents, self._holds
        for block_id in blocks:
            ledger.hold(block_id)
            if not holds[block_id]:
                contents[block_id] = ledger.content(block_id) & _MASK
                tags[block_id] = export.epoch
            holds[block_id] += 1
        # ``done`` and ``renew`` were reset when the slot was given out (a release may come
        # before this publication: it stands).
        segment.ready[export.slot] = export.epoch  # last: the export is published
        self._exports[save.transfer_id] = export

    def next_end(self) -> float | None:
        """When to look again (None: nothing in flight)."""
        if not (self._loads or self._exports):
            return None
        now = self._clock()
        ends = [now + _POLL_S]
        ends.extend(load.end for load in self._loads.values() if load.start is not None)
        return min(ends)

    def get_finished(self) -> KVConnectorReport | None:
        return self.finished_by(self._clock())

    def finished_by(self, now: float) -> KVConnectorReport | None:
        if not (self._loads or self._exports):
            return None
        report = KVConnectorReport()
        if self._exports:
            self._finish_exports(report)
        if self._loads:
            self._finish_loads(report, now)
        return None if report.is_empty else report

    def _finish_exports(self, report: KVConnectorReport) -> None:
        ledger = self._ledger
        assert ledger is not None
        segment = self._own_segment()
        wall = time.monotonic()
        for transfer_id, export in list(self._exports.items()):
            slot, epoch = export.slot, export.epoch
            confirmed = segment.done[slot] == epoch
            if not confirmed:
                renewed = max(export.since, segment.renew[slot])
                if wall - renewed <= export.lease_s * _WORKER_LEASE:
                    continue
            # Withdrawn first: a reader that checks after this never uses the blocks.
            segment.ready[slot] = -epoch
            tags, holds = segment.tags, self._holds
            for block_id in export.blocks:
                holds[block_id] -= 1
                if not holds[block_id]:
                    tags[block_id] = 0
                ledger.unhold(block_id)
            del self._exports[transfer_id]
            (report.finished_saves if confirmed else report.failed_saves).append(transfer_id)

    def _try_start(self, load: _Load, segment: HandoffSegment, now: float) -> bool:
        """Start the modelled copy of ``load`` once its export is published."""
        params = load.params
        slot = int(params.get("slot", -1))
        if not 0 <= slot < segment.num_blocks or segment.ready[slot] != int(params.get("epoch", 0)):
            return False
        self._start_copy(load, now)
        return True

    def _start_copy(self, load: _Load, now: float) -> None:
        options = self.options
        blocks = sum(len(ids) for ids in load.transfer.block_ids)
        load.start = start = max(now, self._link_free_at)
        load.end = start + options.latency_s + blocks * self._page / options.bytes_per_s
        if load.fault == "late" and options.fault is not None:
            load.end += options.fault.late_s
        self._link_free_at = load.end

    def _finish_loads(self, report: KVConnectorReport, now: float) -> None:
        ledger = self._ledger
        assert ledger is not None
        options = self.options
        failed: list[list[int]] = [[] for _ in range(self.layout.num_groups)]
        for transfer_id, load in list(self._loads.items()):
            transfer, params = load.transfer, load.params
            if params.get("via") == ZMQ:
                outcome = self._remote_step(load, now)
                if outcome is False:
                    continue
                assert outcome is not True
                self._finish_remote(transfer_id, load, outcome, now, report, failed)
                continue
            segment = attach(str(params.get("segment", "")))
            epoch, slot = int(params.get("epoch", 0)), int(params.get("slot", -1))
            gone = segment is None or not segment.owner_alive()
            if not gone and load.start is None:
                assert segment is not None
                withdrawn = 0 <= slot < segment.num_blocks and segment.ready[slot] == -epoch
                if self._try_start(load, segment, now):
                    pass
                elif not withdrawn and now - load.since <= max(options.deadline_s, 1.0):
                    continue  # not published yet
                else:
                    gone = True  # never published
            timed_out = False
            if not gone and load.start is not None:
                if self._renew:
                    renew(params)
                timed_out = load.end - load.start > options.deadline_s
                if (load.start + options.deadline_s if timed_out else load.end) > now:
                    continue
            del self._loads[transfer_id]
            self.num_loads += 1
            report.finished_loads.append(transfer_id)
            if load.start is not None:
                report.load_s += min(now, load.end) - load.start
            ok_blocks = 0
            for g, (ids, remote) in enumerate(
                zip(transfer.block_ids, transfer.remote, strict=True)
            ):
                for block_id, source in zip(ids, remote, strict=True):
                    ledger.unhold(block_id)
                    valid = (
                        not gone
                        and not timed_out
                        and load.fault != "drop"
                        and segment is not None
                        and 0 <= source < segment.num_blocks
                    )
                    if valid:
                        assert segment is not None
                        value = segment.contents[source]
                        # After the read: still published (so held the whole time).
                        if (
                            value >= _SPECIAL
                            or segment.ready[slot] != epoch
                            or not segment.owner_alive()
                        ):
                            valid = False  # freed while it was read (or never written)
                        else:
                            ledger.set_content(block_id, value)
                            ok_blocks += 1
                    if not valid:
                        failed[g].append(block_id)
                        ledger.set_content(block_id, None)
            if ok_blocks < sum(len(ids) for ids in transfer.block_ids):
                self.num_failed_loads += 1
            report.bytes_loaded += ok_blocks * self._page
        if any(failed):
            report.failed_block_ids = failed

    def _remote_step(self, load: _Load, now: float) -> list[int] | bool | None:
        """A load over ZMQ: False while in flight, then the blocks' fingerprints (None: the
        load failed)."""
        remote = self._remote
        params = load.params
        if remote is None:
            return None
        client, address = remote.client, str(params["address"])
        slot, epoch = int(params.get("slot", -1)), int(params.get("epoch", 0))
        client.poll()
        if client.state(address) in ("refused", "gone"):
            return None  # other keys, or the prefill engine's connection dropped (it died)
        if load.rid is None:
            assert load.start is not None
            options = self.options
            if self._renew and now - load.renewed >= _RENEW_S:
                client.send(address, RENEW, slot, epoch)
                load.renewed = now
            if load.end - load.start > options.deadline_s:
                return False if load.start + options.deadline_s > now else None
            if load.end > now:
                return False
            if load.fault == "drop":
                return None
            load.rid = client.send(address, READ, slot, epoch, load.transfer.remote)
            load.read_at = time.monotonic()
            answer = client.wait(load.rid, timeout_s=0.02)  # usually there in a millisecond
        else:
            answer = client.take(load.rid)
        if answer is None:
            if time.monotonic() - load.read_at > remote.timeout_s:
                return None  # no answer: the prefill engine is gone or unreachable
            return False
        status, contents, _payload = answer
        if status == NOT_YET and now - load.since <= max(self.options.deadline_s, 1.0):
            load.rid = None  # published at the prefill engine's next step: ask again
            load.end = now
            return False
        return contents if status == OK else None

    def _finish_remote(
        self,
        transfer_id: str,
        load: _Load,
        contents: list[int] | None,
        now: float,
        report: KVConnectorReport,
        failed: list[list[int]],
    ) -> None:
        ledger = self._ledger
        assert ledger is not None
        transfer = load.transfer
        del self._loads[transfer_id]
        self.num_loads += 1
        report.finished_loads.append(transfer_id)
        if load.start is not None:
            report.load_s += min(now, load.end) - load.start
        values = iter(contents or [])
        ok_blocks = 0
        for g, ids in enumerate(transfer.block_ids):
            for block_id in ids:
                ledger.unhold(block_id)
                value = next(values, None) if contents is not None else None
                if value is not None and value < _SPECIAL:
                    ledger.set_content(block_id, value)
                    ok_blocks += 1
                else:
                    failed[g].append(block_id)
                    ledger.set_content(block_id, None)
        if ok_blocks < sum(len(ids) for ids in transfer.block_ids):
            self.num_failed_loads += 1
        report.bytes_loaded += ok_blocks * self._page

    def close(self) -> None:
        self._loads.clear()
        self._exports.clear()
        if self._remote is not None:
            register_link(self.config.data_parallel_rank, None)
            self._remote.close()
            self._remote = None
        if self._segment is not None:
            # The scheduler half owns (and removes) it.
            self._segment = None
