"""The host-memory KV tier (CPU offload): the scheduler half of the built-in ``"host"`` connector.

An index of offloaded blocks keyed by the device prefix cache's keys (per KV-cache group, the
same suffixes as ``GroupedKVCacheManager``), so ``cache_salt`` isolates it too; LRU eviction; a
capacity in bytes (``EngineConfig.kv_offload_bytes``) cut into host slots of one page each
(``KVConnectorLayout.page_size_bytes``: every layer of a group, K and V, ``block_size`` tokens).

- **Saves.** Each step, the full blocks of the scheduled requests that were computed before the
  step (``ConnectorStep.num_computed_before``) and are not in the index are saved, off the
  critical path (the core keeps them out of reuse until the save is reported). A finished
  request's last blocks are saved after it ends (``request_finished`` holds its blocks).
  An entry becomes visible to lookups once its save is reported.
- **Lookups** continue past the device hit: the longest run of blocks after it that every group
  has in the index; loaded asynchronously (the request parks until the load is reported).
- **On a miss** the cost is one dict probe for the first block past the device hit.

Pure logic (no torch): the worker halves (mock, CUDA) move the bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from engine_core._core.kv_events import KVEventLog
from engine_core.kv_connector import (
    ConnectorRequest,
    ConnectorStep,
    KVConnectorLayout,
    KVConnectorMetadata,
    KVConnectorReport,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransfer,
)

if TYPE_CHECKING:
    from engine_core.config import EngineConfig

__all__ = ["HostTierProvider", "HostTierScheduler", "num_host_slots"]


def _first_live(kind: str, span: int, block_size: int) -> Callable[[int], int]:
    """The first block a window (chunked) group's queries from ``n`` computed tokens see."""
    if kind == "chunked_attention":
        return lambda n: n // span * span // block_size
    return lambda n: max(0, n - span + 1) // block_size


def num_host_slots(config: EngineConfig, layout: KVConnectorLayout) -> int:
    """Host slots (one page each) that ``kv_offload_bytes`` holds."""
    return int(config.kv_offload_bytes) // layout.page_size_bytes


class _Entry:
    __slots__ = ("slot", "group", "committed", "loading")

    def __init__(self, slot: int, group: int) -> None:
        self.slot = slot
        self.group = group
        self.committed = False
        """The save was reported: lookups may use it."""
        self.loading = 0
        """Loads in flight from this slot (it is not evicted meanwhile)."""


class _Load:
    __slots__ = ("req_id", "keys", "block_ids", "slots", "first_block", "num_tokens")

    def __init__(
        self,
        req_id: str,
        keys: list[list[bytes]],
        block_ids: list[list[int]],
        slots: list[list[int]],
        first_block: int,
        num_tokens: int,
    ) -> None:
        self.req_id = req_id
        self.keys = keys
        self.block_ids = block_ids
        self.slots = slots
        self.first_block = first_block
        self.num_tokens = num_tokens


class HostTierScheduler(KVConnectorScheduler):
    """The host tier's index and its transfers (see the module)."""

    def __init__(self, config: EngineConfig, layout: KVConnectorLayout) -> None:
        super().__init__(config, layout)
        self.block_size = layout.block_size
        self.num_groups = layout.num_groups
        self.capacity = num_host_slots(config, layout)
        if self.capacity <= 0:
            raise ValueError(
                f"kv_offload_bytes ({config.kv_offload_bytes}) holds no host block: one block "
                f"(page) is {layout.page_size_bytes} bytes"
            )
        self._suffixes = [b"" if g == 0 else b"/g%d" % g for g in range(self.num_groups)]
        self._window_of: list[Callable[[int], int] | None] = [
            None if span is None else _first_live(kind, span, layout.block_size)
            for kind, span in zip(layout.group_kinds, layout.group_spans, strict=True)
        ]
        self._full = [g for g, w in enumerate(self._window_of) if w is None]
        self._windowed = [(g, w) for g, w in enumerate(self._window_of) if w is not None]
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()
        """Key -> entry, least recently used first."""
        self._free_slots = list(range(self.capacity - 1, -1, -1))
        self._loads: dict[str, _Load] = {}
        """Loads to start (offered and allocated), by request id, until the next metadata."""
        self._loading: dict[str, _Load] = {}
        self._saving: dict[str, list[bytes]] = {}
        """Saves in flight: their keys, by transfer id."""
        self._finish_saves: dict[str, list[list[int]]] = {}
        """Finished requests whose last blocks to save (block tables), by request id."""
        self._offers: dict[str, tuple[list[list[bytes]], list[list[int]]]] = {}
        self._finished_requests: dict[str, tuple[ConnectorRequest, int]] = {}
        self._planned: dict[str, int] = {}
        """Per live request, the blocks whose saves were planned already."""
        self._num_saves = 0
        self.hit_tokens = 0
        self.loaded_tokens = 0
        self.num_loads = 0
        self.num_stores = 0
        self.failed_blocks = 0
        self.evictions = 0
        self.events: KVEventLog | None = None
        """Where blocks entering and leaving the tier are recorded (group 0's keys; the
        data-parallel router counts them as cheaper hits); None records nothing."""

    # -- lookups --------------------------------------------------------------------------------

    def _keys(self, request: ConnectorRequest, index: int) -> list[bytes]:
        key = request.block_keys[index]
        return [key + suffix for suffix in self._suffixes]

    def _committed(self, key: bytes) -> bool:
        entry = self._index.get(key)
        return entry is not None and entry.committed

    def _needed(
        self, first_live: Callable[[int], int], first: int, length: int, prompt_end: int
    ) -> Callable[[int], bool]:
        """Which entries of a window group a load of blocks ``first .. length`` must fill:
        those the window sees from the hit's end, and those of the prompt's own window (the
        device keeps them while the request runs)."""
        block_size = self.block_size
        live = max(first, min(first_live(length * block_size), length - 1))
        keep_from = (
            min(first_live(prompt_end * block_size), prompt_end - 1) if prompt_end > 0 else 0
        )
        return lambda i: i >= live or keep_from <= i < prompt_end

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """The longest hit past the device's: every full group needs each block, a window
        group only those its window sees from the hit's end (as the device cache's rule)."""
        block_size = self.block_size
        first = num_computed_tokens // block_size
        keys = request.block_keys
        end = min((len(request.all_token_ids) - 1) // block_size, len(keys))
        if end <= first:
            return 0, False
        committed = self._committed
        suffixes = self._suffixes
        if not committed(keys[first] + suffixes[0]) and 0 in self._full:
            return 0, False  # the miss path: one dict probe
        length = end
        for g in self._full:
            suffix = suffixes[g]
            n = first
            while n < length and committed(keys[n] + suffix):
                n += 1
            length = n
        # The device keeps a window group's blocks that a hit of the prompt needs (the window
        # before the prompt's end) as well as those its window sees: both must be loaded.
        prompt_end = min((request.num_prompt_tokens - 1) // block_size, len(keys))
        changed = True
        while changed and length > first:
            changed = False
            for g, span_first in self._windowed:
                suffix = suffixes[g]
                needed = self._needed(span_first, first, length, prompt_end)
                for i in range(length - 1, first - 1, -1):
                    if needed(i) and not committed(keys[i] + suffix):
                        length = i
                        changed = True
                        break
                if changed:
                    break
        if length <= first:
            return 0, False
        slots: list[list[int]] = []
        offer_keys: list[list[bytes]] = []
        for g in range(self.num_groups):
            suffix = suffixes[g]
            window = self._window_of[g]
            needed = (
                (lambda i: True)
                if window is None
                else self._needed(window, first, length, prompt_end)
            )
            group_slots = []
            group_keys = []
            for i in range(first, length):
                if not needed(i):
                    group_slots.append(-1)
                    group_keys.append(b"")
                else:
                    key = keys[i] + suffix
                    group_slots.append(self._index[key].slot)
                    group_keys.append(key)
            slots.append(group_slots)
            offer_keys.append(group_keys)
        self._offers[request.request_id] = (offer_keys, slots)
        return (length - first) * block_size, True

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[list[int]], num_external_tokens: int
    ) -> None:
        offer = self._offers.pop(request.request_id, None)
        if offer is None or num_external_tokens <= 0:
            return
        keys, slots = offer
        n = num_external_tokens // self.block_size
        keys = [k[:n] for k in keys]
        slots = [s[:n] for s in slots]
        index = self._index
        for group_keys in keys:
            for key in group_keys:
                if key:
                    entry = index[key]
                    entry.loading += 1
                    index.move_to_end(key)
        first = request.num_computed_tokens // self.block_size - n
        device = [
            [b if s >= 0 else -1 for b, s in zip(ids[:n], group_slots, strict=True)]
            for ids, group_slots in zip(block_ids, slots, strict=True)
        ]
        self._loads[request.request_id] = _Load(
            request.request_id,
            keys,
            device,
            slots,
            first,
            num_external_tokens,
        )

    def _end_load(self, req_id: str) -> _Load | None:
        load = self._loading.pop(req_id, None) or self._loads.pop(req_id, None)
        if load is None:
            return None
        index = self._index
        for group_keys in load.keys:
            for key in group_keys:
                entry = index.get(key) if key else None
                if entry is not None and entry.loading:
                    entry.loading -= 1
        return load

    def load_cancelled(self, request: ConnectorRequest) -> None:
        self._offers.pop(request.request_id, None)
        self._end_load(request.request_id)

    # -- saves ----------------------------------------------------------------------------------

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        index = self._index
        for key, entry in index.items():  # least recently used first
            if entry.committed and not entry.loading:
                del index[key]
                self.evictions += 1
                if self.events is not None and entry.group == 0:
                    self.events.removed(key)
                return entry.slot
        return None

    def _plan_save(
        self,
        transfer_id: str,
        request: ConnectorRequest,
        table: Sequence[Sequence[int]],
        num_full: int,
        saves: list[KVTransfer],
    ) -> None:
        """Save the blocks ``0 .. num_full`` of ``request`` that the index lacks, in every
        group that still holds them (an entry -1: nothing to move for that group)."""
        index = self._index
        num_groups = self.num_groups
        rows: list[tuple[int, list[int], list[int], list[bytes]]] = []
        start = self._planned.get(request.request_id, 0)
        self._planned[request.request_id] = num_full
        for i in range(start, num_full):
            ids = [-1] * num_groups
            slots = [-1] * num_groups
            new_keys = []
            for g, key in enumerate(self._keys(request, i)):
                block_id = table[g][i]
                if block_id < 0 or key in index:
                    continue
                slot = self._take_slot()
                if slot is None:
                    break
                index[key] = _Entry(slot, g)
                ids[g] = block_id
                slots[g] = slot
                new_keys.append(key)
            if new_keys:
                rows.append((i, ids, slots, new_keys))
        if not rows:
            return
        first, last = rows[0][0], rows[-1][0]
        block_ids = [[-1] * (last - first + 1) for _ in range(num_groups)]
        remote = [[-1] * (last - first + 1) for _ in range(num_groups)]
        keys: list[bytes] = []
        for i, ids, slots, new_keys in rows:
            for g in range(num_groups):
                block_ids[g][i - first] = ids[g]
                remote[g][i - first] = slots[g]
            keys += new_keys
        self._saving[transfer_id] = keys
        saves.append(
            KVTransfer(
                transfer_id,
                request.request_id,
                block_ids,
                remote,
                first,
                (last - first + 1) * self.block_size,
            )
        )

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._offers.pop(request.request_id, None)
        self._end_load(request.request_id)
        self._planned.pop(request.request_id, None)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_keys))
        index = self._index
        if not block_ids or not block_ids[0]:
            return False, None
        num_full = min(num_full, len(block_ids[0]))
        for i in range(num_full):
            if any(
                block_ids[g][i] >= 0 and k not in index
                for g, k in enumerate(self._keys(request, i))
            ):
                self._finish_saves[request.request_id] = block_ids
                # Keep what is needed to save it: the request object outlives this call.
                self._finished_requests[request.request_id] = (request, num_full)
                return True, None
        return False, None

    def build_metadata(self, step: ConnectorStep) -> KVConnectorMetadata | None:
        saves: list[KVTransfer] = []
        block_size = self.block_size
        index = self._index
        for i, (request, computed) in enumerate(
            zip(step.scheduled, step.num_computed_before, strict=True)
        ):
            num_full = min(computed // block_size, len(request.block_keys))
            # Cheap test first (one dict probe): the last full block is stored, and with it
            # every block before it (they were offered earlier).
            if num_full <= 0 or request.block_keys[num_full - 1] in index:
                continue
            table = step.block_table(i)
            num_full = min(num_full, len(table[0]))
            self._num_saves += 1
            self._plan_save(f"s{self._num_saves}", request, table, num_full, saves)
        if self._finish_saves:
            for req_id, table in self._finish_saves.items():
                request, num_full = self._finished_requests.pop(req_id)
                before = len(saves)
                self._plan_save(req_id, request, table, num_full, saves)
                if len(saves) == before:
                    # Nothing to save after all (stored meanwhile, or no room): a save of no
                    # block releases the held blocks at once.
                    saves.append(KVTransfer(req_id, req_id, [[] for _ in table]))
            self._finish_saves.clear()
        loads: list[KVTransfer] = []
        if self._loads:
            for req_id, load in self._loads.items():
                loads.append(
                    KVTransfer(
                        req_id,
                        req_id,
                        load.block_ids,
                        load.slots,
                        load.first_block,
                        load.num_tokens,
                    )
                )
                self._loading[req_id] = load
            self._loads = {}
        cancelled = step.cancelled
        if not (saves or loads or cancelled):
            return None
        return KVConnectorMetadata(loads=loads, saves=saves, cancelled=list(cancelled))

    # -- reports --------------------------------------------------------------------------------

    def on_report(self, report: KVConnectorReport) -> None:
        index = self._index
        failed = {b for ids in report.failed_block_ids for b in ids}
        for req_id in report.finished_loads:
            load = self._end_load(req_id)
            if load is None:
                continue
            self.num_loads += 1
            good = load.num_tokens
            if failed:
                # Forget the host copies of failed blocks (they may be bad), and count them.
                for g, ids in enumerate(load.block_ids):
                    for j, block_id in enumerate(ids):
                        if block_id >= 0 and block_id in failed:
                            good = min(good, j * self.block_size)
                            self.failed_blocks += 1
                            entry = index.pop(load.keys[g][j], None)
                            if entry is not None and not entry.loading:
                                self._free_slots.append(entry.slot)
                            if entry is not None and g == 0 and self.events is not None:
                                self.events.removed(load.keys[g][j])
            self.hit_tokens += good
            self.loaded_tokens += load.num_tokens
        for transfer_id in report.finished_saves:
            keys = self._saving.pop(transfer_id, None)
            if keys is None:
                continue
            self.num_stores += 1
            for key in keys:
                entry = index.get(key)
                if entry is not None:
                    entry.committed = True
                    if entry.group == 0 and self.events is not None:
                        self.events.stored(key)
        for transfer_id in report.failed_saves:
            keys = self._saving.pop(transfer_id, None)
            for key in keys or ():
                entry = index.pop(key, None)
                if entry is not None:
                    self._free_slots.append(entry.slot)

    # -- surfaces -------------------------------------------------------------------------------

    @property
    def num_resident_blocks(self) -> int:
        """Blocks stored in the host tier (all groups)."""
        return sum(1 for e in self._index.values() if e.committed)

    def resident_keys(self) -> list[bytes]:
        """Group 0's keys of every stored block (what the data-parallel router counts)."""
        return [k for k, e in self._index.items() if e.committed and e.group == 0]

    def contains(self, key: bytes) -> bool:
        entry = self._index.get(key)
        return entry is not None and entry.committed

    def stats(self) -> dict[str, int | float]:
        return {
            "hit_tokens": self.hit_tokens,
            "resident_blocks": self.num_resident_blocks,
            "capacity_blocks": self.capacity,
            "free_blocks": len(self._free_slots),
            "loads": self.num_loads,
            "stores": self.num_stores,
            "failed_blocks": self.failed_blocks,
            "evictions": self.evictions,
        }

    def reset(self) -> None:
        busy = {k: e for k, e in self._index.items() if e.loading or not e.committed}
        for key, entry in list(self._index.items()):
            if key not in busy:
                self._free_slots.append(entry.slot)
                if entry.group == 0 and self.events is not None:
                    self.events.removed(key)
        self._index = OrderedDict(busy)


class HostTierProvider:
    """The built-in ``"host"`` connector: its scheduler half; the worker halves are the
    backends' own (``Backend.init_kv_connector``)."""

    name = "host"

    def scheduler(self, config: EngineConfig, layout: KVConnectorLayout) -> KVConnectorScheduler:
        return HostTierScheduler(config, layout)

    def worker(
        self, config: EngineConfig, layout: KVConnectorLayout, backend: str, rank: int
    ) -> KVConnectorWorker | None:
        return None
