"""The mock's half of the host KV tier: a modelled host<->device link and host pool.

``backend_options={"kv_link": {...}}``:

- ``bytes_per_s`` (default 50e9) and ``latency_s`` (10e-6): each transfer takes
  ``latency_s + bytes / bytes_per_s`` on the link, off the device's timeline; transfers one
  way queue behind each other (one copy stream each way: loads and saves do not wait on each
  other, as on a full-duplex PCIe link);
- ``host_memory_bytes``: the host memory the mock pretends it can pin (default: what this
  machine has available); a larger ``kv_offload_bytes`` is a startup error;
- ``fault``: ``{"kind": "drop" | "corrupt" | "late", "probability": p, "seed": s}`` injected per
  transfer, on loads (``"on": "loads"``, the default), saves (``"saves"``) or both. ``drop``: the
  load delivers nothing, reported failed; ``corrupt``: the bytes are wrong and the checksum catches
  it (reported failed; with ``"detect": False`` it does not, and the block ledger then raises when
  the block is read as computed: a wrong block never passes silently); ``late``: the transfer ends
  ``late_s`` (default 1.0) later, past the worker's ``deadline_s`` (default 0.25), so it is reported
  failed at its deadline and its data never lands; ``raise``: the worker half raises (a backend
  error: the engine dies with it as the cause).
- ``deadline_s``: the longest a load may take before it is reported failed.

Bookkeeping only: the pool allocates no memory for the blocks. Each host slot keeps the block
ledger's content fingerprint of the block saved into it (the token prefix the KV is for, and its
group), and a load writes exactly that into the device block: a load that delivers the wrong
block makes the ledger raise where a real backend would produce wrong tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_core.config import EngineConfig
from engine_core.kv_connector import (
    KVConnectorLayout,
    KVConnectorMetadata,
    KVConnectorReport,
    KVConnectorWorker,
    KVTransfer,
    check_host_memory,
)
from engine_core_mock._blocks import BlockLedger

__all__ = ["KVLinkOptions", "LinkFault", "MockHostWorker", "parse_kv_link"]

_FAULT_KINDS = ("drop", "corrupt", "late", "raise")
_EMPTY = -3
"""Content of a host slot nothing was saved into."""
_CORRUPT = 0x5A5A5A5A5A5A5A5A


@dataclass(frozen=True, slots=True)
class LinkFault:
    kind: str
    probability: float
    seed: int = 0
    detect: bool = True
    late_s: float = 1.0
    on: str = "loads"
    """Which transfers it hits: ``"loads"``, ``"saves"`` or ``"both"``."""


@dataclass(frozen=True, slots=True)
class KVLinkOptions:
    bytes_per_s: float = 50e9
    latency_s: float = 10e-6
    host_memory_bytes: int | None = None
    deadline_s: float = 0.25
    fault: LinkFault | None = None


def _number(name: str, value: Any, *, positive: bool = False) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not value >= 0
        or (positive and not value > 0)
        or value == float("inf")
    ):
        need = "> 0" if positive else ">= 0"
        raise ValueError(
            f"backend_options['kv_link'][{name!r}] must be a number {need}, got {value!r}"
        )
    return float(value)


def parse_kv_link(value: Any) -> KVLinkOptions | None:
    """Validate ``backend_options['kv_link']`` (None: the defaults, when a connector runs)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"backend_options['kv_link'] must be a dict, got {value!r}")
    known = {"bytes_per_s", "latency_s", "host_memory_bytes", "deadline_s", "fault"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"backend_options['kv_link'] has unknown key(s) {unknown}; known: {sorted(known)}"
        )
    fault = None
    raw = value.get("fault")
    if raw is not None:
        if not isinstance(raw, dict) or "kind" not in raw:
            raise ValueError(
                "backend_options['kv_link']['fault'] must be a dict with 'kind' "
                f"({', '.join(_FAULT_KINDS)}), 'probability' and 'seed', got {raw!r}"
            )
        extra = sorted(set(raw) - {"kind", "probability", "seed", "detect", "late_s", "on"})
        if extra:
            raise ValueError(f"backend_options['kv_link']['fault'] has unknown key(s) {extra}")
        if raw["kind"] not in _FAULT_KINDS:
            raise ValueError(
                f"backend_options['kv_link']['fault']['kind'] must be one of "
                f"{', '.join(_FAULT_KINDS)}, got {raw['kind']!r}"
            )
        probability = _number("fault.probability", raw.get("probability", 1.0))
        if probability > 1:
            raise ValueError(
                f"backend_options['kv_link']['fault']['probability'] must be in [0, 1], "
                f"got {probability!r}"
            )
        seed = raw.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(
                f"backend_options['kv_link']['fault']['seed'] must be an int, got {seed!r}"
            )
        on = raw.get("on", "loads")
        if on not in ("loads", "saves", "both"):
            raise ValueError(
                "backend_options['kv_link']['fault']['on'] must be 'loads', 'saves' or 'both', "
                f"got {on!r}"
            )
        fault = LinkFault(
            raw["kind"],
            probability,
            seed,
            bool(raw.get("detect", True)),
            _number("fault.late_s", raw.get("late_s", 1.0)),
            on,
        )
    memory = value.get("host_memory_bytes")
    if memory is not None and (
        not isinstance(memory, int) or isinstance(memory, bool) or memory < 0
    ):
        raise ValueError(
            f"backend_options['kv_link']['host_memory_bytes'] must be an int >= 0, got {memory!r}"
        )
    return KVLinkOptions(
        _number("bytes_per_s", value.get("bytes_per_s", 50e9), positive=True),
        _number("latency_s", value.get("latency_s", 10e-6)),
        memory,
        _number("deadline_s", value.get("deadline_s", 0.25), positive=True),
        fault,
    )


class _Transfer:
    __slots__ = ("transfer", "start", "end", "fault", "values", "is_load")

    def __init__(
        self,
        transfer: KVTransfer,
        start: float,
        end: float,
        fault: str | None,
        values: list[list[int]] | None,
        is_load: bool,
    ) -> None:
        self.transfer = transfer
        self.start = start
        self.end = end
        self.fault = fault
        self.values = values
        self.is_load = is_load


class MockHostWorker(KVConnectorWorker):
    """The worker half of the ``"host"`` connector on the mock (see the module)."""

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
        check_host_memory(int(config.kv_offload_bytes), options.host_memory_bytes)
        self.num_slots = int(config.kv_offload_bytes) // layout.page_size_bytes
        self._host = [_EMPTY] * self.num_slots
        """Per host slot, the ledger content saved into it (bookkeeping: no KV bytes)."""
        self._checksums = [_EMPTY] * self.num_slots
        self._page = layout.page_size_bytes
        self._clock = clock
        self._link_free_at = [0.0, 0.0]
        """When each direction of the link is free: host to device (loads), device to host
        (saves). A PCIe link is full duplex, and a GPU copies each way on its own engine."""
        self._pending: dict[str, _Transfer] = {}
        self._ledger: BlockLedger | None = None
        fault = options.fault
        self._rng = random.Random(fault.seed) if fault is not None else None
        self.num_loads = 0
        self.num_saves = 0
        self.num_faults = 0

    def register_kv_caches(self, kv_caches: Any) -> None:
        if not isinstance(kv_caches, BlockLedger):
            raise TypeError(f"the mock's host tier registers a BlockLedger, got {kv_caches!r}")
        self._ledger = kv_caches

    # -- steps ----------------------------------------------------------------------------------

    def _draw(self, *, is_load: bool) -> str | None:
        fault = self.options.fault
        if fault is None or self._rng is None:
            return None
        if (not is_load and fault.kind == "late") or fault.on == ("saves" if is_load else "loads"):
            return None
        if self._rng.random() < fault.probability:
            self.num_faults += 1
            return fault.kind
        return None

    def _schedule(
        self, transfer: KVTransfer, now: float, fault: str | None, *, is_load: bool
    ) -> tuple[float, float]:
        options = self.options
        num_blocks = sum(1 for ids in transfer.block_ids for b in ids if b >= 0)
        way = 0 if is_load else 1
        start = max(now, self._link_free_at[way])
        end = start + options.latency_s + num_blocks * self._page / options.bytes_per_s
        self._link_free_at[way] = end
        if fault == "late":
            end += options.fault.late_s if options.fault is not None else 0.0
        return start, end

    def start_step(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is None:
            return
        ledger = self._ledger
        if ledger is None:
            raise RuntimeError("the mock's host tier started a step before register_kv_caches")
        now = self._clock()
        for transfer_id in metadata.cancelled:
            pending = self._pending.pop(transfer_id, None)
            if pending is not None:  # a load, or a save past its lease
                for ids in pending.transfer.block_ids:
                    for block_id in ids:
                        if block_id >= 0:
                            ledger.unhold(block_id)
        for save in metadata.saves:
            self._check(save)
            values = [
                [ledger.content(b) if b >= 0 else _EMPTY for b in ids] for ids in save.block_ids
            ]
            for ids in save.block_ids:
                for block_id in ids:
                    if block_id >= 0:
                        ledger.hold(block_id)
            fault = self._draw(is_load=False)
            self._raise_if(fault)
            start, end = self._schedule(save, now, fault, is_load=False)
            self._add(save, _Transfer(save, start, end, fault, values, False))
        for load in metadata.loads:
            self._check(load)
            for ids in load.block_ids:
                for block_id in ids:
                    if block_id >= 0:
                        ledger.hold(block_id)
            fault = self._draw(is_load=True)
            self._raise_if(fault)
            start, end = self._schedule(load, now, fault, is_load=True)
            self._add(load, _Transfer(load, start, end, fault, None, True))

    @staticmethod
    def _raise_if(fault: str | None) -> None:
        if fault == "raise":
            raise RuntimeError("mock kv_link fault injected: the host tier's worker half raised")

    def _add(self, transfer: KVTransfer, pending: _Transfer) -> None:
        if transfer.transfer_id in self._pending:
            raise RuntimeError(
                f"KV transfer {transfer.transfer_id!r} started while one of that id is in flight"
            )
        self._pending[transfer.transfer_id] = pending

    def _check(self, transfer: KVTransfer) -> None:
        if len(transfer.remote) != len(transfer.block_ids) or any(
            len(r) != len(b) for r, b in zip(transfer.remote, transfer.block_ids, strict=True)
        ):
            raise RuntimeError(
                f"KV transfer {transfer.transfer_id!r}: host slots and block ids differ in shape"
            )
        for slots, ids in zip(transfer.remote, transfer.block_ids, strict=True):
            for slot, block_id in zip(slots, ids, strict=True):
                if block_id < 0 and slot < 0:
                    continue  # nothing to move for this group here
                if not 0 <= slot < self.num_slots or block_id < 0:
                    raise RuntimeError(
                        f"KV transfer {transfer.transfer_id!r}: host slot {slot} is outside the "
                        f"host pool ({self.num_slots} slots)"
                    )

    def next_end(self) -> float | None:
        """When the next transfer in flight ends (None: none)."""
        if not self._pending:
            return None
        deadline = self.options.deadline_s
        return min(
            min(p.end, p.start + deadline) if p.is_load else p.end for p in self._pending.values()
        )

    def get_finished(self) -> KVConnectorReport | None:
        return self.finished_by(self._clock())

    def finished_by(self, now: float) -> KVConnectorReport | None:
        """The transfers that ended by ``now`` (the step's end on the modelled timeline)."""
        if not self._pending:
            return None
        ledger = self._ledger
        assert ledger is not None
        deadline_s = self.options.deadline_s
        fault_cfg = self.options.fault
        detect = fault_cfg.detect if fault_cfg is not None else True
        report = KVConnectorReport()
        failed: list[list[int]] = [[] for _ in range(self.layout.num_groups)]
        for transfer_id, pending in list(self._pending.items()):
            transfer = pending.transfer
            timed_out = pending.is_load and pending.end - pending.start > deadline_s
            ends_at = pending.start + deadline_s if timed_out else pending.end
            if ends_at > now:
                continue
            del self._pending[transfer_id]
            nbytes = sum(1 for ids in transfer.block_ids for b in ids if b >= 0) * self._page
            if not pending.is_load:
                self.num_saves += 1
                values = pending.values
                assert values is not None
                for g, (ids, slots) in enumerate(
                    zip(transfer.block_ids, transfer.remote, strict=True)
                ):
                    for block_id, slot, value in zip(ids, slots, values[g], strict=True):
                        if block_id < 0:
                            continue
                        ledger.unhold(block_id)
                        if pending.fault == "drop":
                            continue
                        self._checksums[slot] = value
                        self._host[slot] = value ^ _CORRUPT if pending.fault == "corrupt" else value
                if pending.fault == "drop":
                    report.failed_saves.append(transfer_id)
                else:
                    report.finished_saves.append(transfer_id)
                    report.bytes_stored += nbytes
                    report.store_s += pending.end - pending.start
                continue
            self.num_loads += 1
            report.finished_loads.append(transfer_id)
            report.load_s += ends_at - pending.start
            for g, (ids, slots) in enumerate(zip(transfer.block_ids, transfer.remote, strict=True)):
                for block_id, slot in zip(ids, slots, strict=True):
                    if block_id < 0:
                        continue
                    ledger.unhold(block_id)
                    value = self._host[slot]
                    if pending.fault == "corrupt":
                        value ^= _CORRUPT
                    bad = (
                        timed_out
                        or pending.fault == "drop"
                        or value == _EMPTY
                        or (detect and value != self._checksums[slot])
                    )
                    if bad:
                        failed[g].append(block_id)
                        ledger.set_content(block_id, None)
                    else:
                        ledger.set_content(block_id, value)
            if not timed_out and pending.fault != "drop":
                report.bytes_loaded += nbytes
        if any(failed):
            report.failed_block_ids = failed
        return None if report.is_empty else report

    def close(self) -> None:
        self._pending.clear()
