"""The ``"pd"`` KV connector: prefill/decode disaggregation between engines on one host
(``docs/disaggregation.md``).

A prefill engine computes a prompt and its first token; when the request finishes (it was sent with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": True}``) its full prompt blocks are
**exported**: held under a lease (the core's late free) and published in the engine's **handoff
segment**, a shared-memory segment of this host; the transfer parameters (machine, segment, block
ids, epoch, export slot) go back to the client with the first token. The client sends the request,
the parameters and the first token to a decode engine, whose connector offers those blocks at
admission, parks the request while its worker half pulls them, and confirms: the prefill engine's
worker half sees the confirmation and the core frees the blocks.

The handoff segment (one per engine, named by :func:`segment_name`), arrays of ``num_blocks``
64-bit words each:

- ``tags[b]``: the epoch of the first export still holding block ``b`` (0: none; exports of
  ``n`` siblings share their prompt's blocks);
- ``contents[b]``: what the block holds, for a backend that moves bookkeeping (the mock's block
  fingerprints); a device backend would publish handles to its memory instead;
- ``ready[s]``, ``done[s]`` (``s``: the export's slot, one per export in flight, given out by
  the scheduler half): the epoch once the export is published, withdrawn (the epoch negated)
  by the prefill side *before* the core may free the blocks (confirmation, lease expiry), so a
  reader that still
  finds its epoch there after its copy read blocks held the whole time, and otherwise fails
  its load and recomputes (it never uses freed blocks); the epoch once the reader is finished
  with it (copied, failed, cancelled, rejected or aborted: the prefill side may free);
- ``renew[s]``: when (``time.monotonic()``, one clock per host) the reader last said it is
  still copying: the lease runs from there.

Between hosts the segment cannot be attached: the worker half registers the engine's end of
the authenticated ZMQ transport (``engine_core._engine.pipes.pd_transport``, :func:`register_link`),
whose server answers for this segment; the transfer parameters then carry its ``address`` and a
decode engine on another machine (or any, with ``kv_connector_options["pd_transport"] =
"zmq"``) pulls over it, under the same rules. Without a transport (no deployment keys) such a
decode engine computes the prompt itself (``pd_other_host``).

Everything here is the standard library: the scheduler half runs in the engine process, the
client releases a rejected request's export itself (:func:`release`).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import socket
import time
from multiprocessing import resource_tracker, shared_memory
from typing import TYPE_CHECKING, Any, Protocol

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

__all__ = [
    "HandoffSegment",
    "PDConnectorScheduler",
    "PDProvider",
    "RemoteLink",
    "register_link",
    "release",
    "segment_name",
]

logger = logging.getLogger(__name__)

_MAGIC = 0x45435044  # "ECPD"
_HEADER = 4
"""Header words: magic, owner pid, num_blocks, reserved."""
_ARRAYS = ("tags", "contents", "ready", "done", "renew")

REMOTE_DECODE = "do_remote_decode"
"""``kv_transfer_params`` key the client sets on a request sent to a prefill engine."""


def _host_id() -> str:
    """This machine (its boot id where there is one): a segment is readable only here."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


HOST_ID = _host_id()


def segment_name(pid: int, rank: int) -> str:
    """The handoff segment of engine ``rank`` in process ``pid``."""
    return f"ecpd-{pid}-{rank}"


class HandoffSegment:
    """One engine's handoff segment (see the module): created by its owner, attached by
    readers (who never unlink it)."""

    def __init__(self, name: str, num_blocks: int | None = None) -> None:
        self.name = name
        self.owner = num_blocks is not None
        if num_blocks is not None:
            size = 8 * (_HEADER + len(_ARRAYS) * num_blocks)
            try:
                self._shm = shared_memory.SharedMemory(name, create=True, size=size)
            except FileExistsError:  # a segment of a dead process of the same pid
                stale = shared_memory.SharedMemory(name)
                stale.close()
                stale.unlink()
                self._shm = shared_memory.SharedMemory(name, create=True, size=size)
            fresh: Any = self._shm.buf
            head = fresh[: 8 * _HEADER]
            words = head.cast("q")  # a new segment reads as zeros
            words[0], words[1], words[2] = _MAGIC, os.getpid(), num_blocks
            words.release()
            head.release()
        else:
            self._shm = shared_memory.SharedMemory(name)
            # Python < 3.13 registers attached segments too and would unlink them at exit.
            with contextlib.suppress(Exception):  # best effort
                resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
        buf: Any = self._shm.buf
        self._views: list[Any] = []

        def view(start: int, count: int, fmt: str) -> Any:
            raw = buf[8 * start : 8 * (start + count)]
            typed = raw.cast(fmt)
            self._views += [typed, raw]
            return typed

        head = view(0, _HEADER, "q")
        if head[0] != _MAGIC:
            self._release_views()
            self._shm.close()
            raise ValueError(f"shared-memory segment {name!r} is not a handoff segment")
        self.pid = int(head[1])
        self.num_blocks = n = int(head[2])
        self.tags = view(_HEADER, n, "q")
        self.contents = view(_HEADER + n, n, "Q")
        self.ready = view(_HEADER + 2 * n, n, "q")
        self.done = view(_HEADER + 3 * n, n, "q")
        self.renew = view(_HEADER + 4 * n, n, "d")
        if self.owner:
            _attached[name] = self  # the worker half of this process uses it too

    def _release_views(self) -> None:
        for v in self._views:
            v.release()
        self._views = []

    def owner_alive(self) -> bool:
        """Whether the engine process that owns the segment still runs."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def close(self) -> None:
        if _attached.get(self.name) is self:
            del _attached[self.name]
        self._release_views()
        # A view still exported somewhere: the mapping goes with the process.
        with contextlib.suppress(BufferError):
            self._shm.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()


_attached: dict[str, HandoffSegment] = {}


@atexit.register
def _detach_all() -> None:
    while _attached:
        _attached.popitem()[1].close()


def attach(name: str) -> HandoffSegment | None:
    """The segment ``name`` (attached once per process), or None when it is gone (its
    engine died and the segment was removed)."""
    segment = _attached.get(name)
    if segment is not None:
        return segment
    if not name:
        return None
    try:
        segment = HandoffSegment(name)
    except (FileNotFoundError, ValueError):
        return None
    _attached[name] = segment
    return segment


def release(params: dict[str, Any] | None) -> bool:
    """Tell the prefill engine of ``params`` (the transfer parameters it returned) that
    nobody will read its export: it frees the blocks at its next step. Returns whether the
    segment was found."""
    if not params or "segment" not in params or params.get("host") != HOST_ID:
        return False
    segment = attach(params["segment"])
    if segment is None:
        return False
    slot, epoch = int(params["slot"]), int(params["epoch"])
    if 0 <= slot < segment.num_blocks:
        segment.done[slot] = epoch
    return True


def renew(params: dict[str, Any]) -> None:
    """The reader of ``params``'s export is still copying: the lease runs from now."""
    segment = attach(params["segment"])
    if segment is not None:
        slot = int(params["slot"])
        if 0 <= slot < segment.num_blocks:
            segment.renew[slot] = time.monotonic()


class RemoteLink(Protocol):
    """An engine's end of the transport between hosts (``engine_core._engine.pipes.pd_transport``),
    registered by its worker half: the scheduler half cannot open sockets itself."""

    address: str
    """Where this engine serves its exports."""

    @property
    def auth_refused(self) -> int: ...

    def release(self, params: dict[str, Any]) -> None:
        """Tell the prefill engine of ``params`` that nobody will read its export."""

    def renewed_at(self, params: dict[str, Any]) -> float:
        """When this engine last renewed the export of ``params`` (0.0: never)."""


_links: dict[int, RemoteLink] = {}


def register_link(rank: int, link: RemoteLink | None) -> None:
    """Register (None: remove) the transport of engine ``rank`` in this process."""
    if link is None:
        _links.pop(rank, None)
    else:
        _links[rank] = link


TRANSPORT_OPTION = "pd_transport"
"""``kv_connector_options`` key: ``"auto"`` (the default: shared memory on the same host, ZMQ
between hosts) or ``"zmq"`` (ZMQ even on the same host: what a deployment across hosts does,
on one machine)."""

SHM, ZMQ = "shm", "zmq"
"""The two transfer paths (``params["via"]`` on the decode side)."""


class _Load:
    __slots__ = (
        "params",
        "block_ids",
        "remote",
        "first_block",
        "num_tokens",
        "sent",
        "released",
        "sent_at",
    )

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params
        self.sent_at = 0.0
        self.block_ids: list[list[int]] = []
        self.remote: list[list[int]] = []
        self.first_block = 0
        self.num_tokens = 0
        self.sent = False
        self.released = False


class PDConnectorScheduler(KVConnectorScheduler):
    """The scheduler half of ``"pd"`` (see the module): exports on the prefill side, loads on
    the decode side; an engine of role ``"both"`` does either as its requests ask."""

    def __init__(self, config: EngineConfig, layout: KVConnectorLayout) -> None:
        super().__init__(config, layout)
        self.rank = config.data_parallel_rank
        self.block_size = layout.block_size
        self.page_size_bytes = layout.page_size_bytes
        transport = config.kv_connector_options.get(TRANSPORT_OPTION, "auto")
        if transport not in ("auto", ZMQ):
            raise ValueError(
                f"kv_connector_options[{TRANSPORT_OPTION!r}] must be 'auto' or 'zmq', "
                f"got {transport!r}"
            )
        self.force_zmq = transport == ZMQ
        self.segment = HandoffSegment(segment_name(os.getpid(), self.rank), layout.num_blocks)
        self._epochs = itertools.count((os.getpid() << 24) + 1)
        self._exports: list[KVTransfer] = []
        """Exports to publish at the next step (saves of the worker half)."""
        self._held: dict[str, int] = {}
        """Exports in flight: request id -> slot."""
        self._free_slots = list(range(layout.num_blocks - 1, -1, -1))
        """Export slots (``ready``/``done``/``renew`` entries) not in use: one per export in
        flight, so exports sharing blocks (``n`` siblings, one prefix) never collide."""
        self._loads: dict[str, _Load] = {}
        """Decode side: requests whose KV comes from a prefill engine."""
        self._consumed: set[str] = set()
        """Decode side: requests whose export was read or released (a preempted one that
        comes back computes, or hits its own prefix cache)."""
        self.counters: dict[str, int | float] = {
            "pd_exports": 0,
            "pd_exports_confirmed": 0,
            "pd_lease_expired": 0,
            "pd_transfers": 0,
            "pd_transfer_failed": 0,
            "pd_released_unread": 0,
            "pd_other_host": 0,
            "pd_bytes": 0,
            "pd_transfer_s": 0.0,
            "pd_auth_refused": 0,
        }
        for path in (SHM, ZMQ):
            self.counters[f"pd_transfers_{path}"] = 0
            self.counters[f"pd_bytes_{path}"] = 0
            self.counters[f"pd_handoff_s_{path}"] = 0.0

    # -- the decode side ----------------------------------------------------------------------

    def _load_of(self, request: ConnectorRequest) -> _Load | None:
        req_id = request.request_id
        load = self._loads.get(req_id)
        if load is not None:
            return load
        if req_id in self._consumed:
            return None
        params = getattr(request, "kv_transfer_params", None)
        if not params or "segment" not in params:
            return None
        if params.get("host") == HOST_ID and not (self.force_zmq and params.get("address")):
            load = self._loads[req_id] = _Load({**params, "via": SHM})
            return load
        if params.get("address") and self.rank in _links:
            load = self._loads[req_id] = _Load({**params, "via": ZMQ})
            return load
        # Another machine's export and no transport (no deployment keys): this engine
        # computes the prompt (the prefill side's lease frees the blocks).
        self._consumed.add(req_id)
        self.counters["pd_other_host"] += 1
        return None

    def _release(self, req_id: str, *, unread: bool) -> None:
        load = self._loads.pop(req_id, None)
        if load is None or load.released:
            return
        self._consumed.add(req_id)
        load.released = True
        if load.params.get("via") == ZMQ:
            link = _links.get(self.rank)
            if link is not None:
                link.release(load.params)
        else:
            release(load.params)
        if unread:
            self.counters["pd_released_unread"] += 1

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        load = self._load_of(request)
        if load is None or load.sent or load.num_tokens:
            return 0, False
        bs = self.block_size
        remote_tokens = int(load.params.get("num_tokens", 0))
        usable = min(remote_tokens, (len(request.all_token_ids) - 1) // bs * bs)
        if usable <= num_computed_tokens:
            # The local prefix cache has it all (or nothing to load): free the prefill side.
            self._release(request.request_id, unread=True)
            return 0, False
        return usable - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[list[int]], num_external_tokens: int
    ) -> None:
        load = self._loads.get(request.request_id)
        if load is None:
            return
        if num_external_tokens == 0:
            self._release(request.request_id, unread=True)
            return
        bs = self.block_size
        first = (request.num_computed_tokens - num_external_tokens) // bs
        count = num_external_tokens // bs
        remote = load.params["block_ids"]
        load.block_ids = block_ids
        load.remote = [list(r[first : first + count]) for r in remote]
        load.first_block = first
        load.num_tokens = num_external_tokens

    def build_metadata(self, step: ConnectorStep) -> KVConnectorMetadata | None:
        loads = []
        for req_id, load in self._loads.items():
            if load.num_tokens and not load.sent:
                load.sent = True
                load.sent_at = time.monotonic()
                loads.append(
                    KVTransfer(
                        req_id,
                        req_id,
                        load.block_ids,
                        load.remote,
                        load.first_block,
                        load.num_tokens,
                        params=load.params,
                    )
                )
        saves, self._exports = self._exports, []
        if not loads and not saves:
            return None
        return KVConnectorMetadata(loads=loads, saves=saves)

    def on_report(self, report: KVConnectorReport) -> None:
        failed = {b for ids in report.failed_block_ids for b in ids}
        counters = self.counters
        for req_id in report.finished_loads:
            load = self._loads.get(req_id)
            if load is None:
                continue
            if any(b in failed for ids in load.block_ids for b in ids):
                counters["pd_transfer_failed"] += 1
            else:
                counters["pd_transfers"] += 1
                path = load.params.get("via", SHM)
                counters[f"pd_transfers_{path}"] += 1
                blocks = sum(1 for ids in load.block_ids for b in ids if b >= 0)
                counters[f"pd_bytes_{path}"] += blocks * self.page_size_bytes
                counters[f"pd_handoff_s_{path}"] += time.monotonic() - load.sent_at
            self._release(req_id, unread=False)
        counters["pd_bytes"] += report.bytes_loaded
        counters["pd_transfer_s"] += report.load_s
        for req_id in report.finished_saves:
            slot = self._held.pop(req_id, None)
            if slot is not None:
                self._free_slots.append(slot)
                counters["pd_exports_confirmed"] += 1
        for req_id in report.failed_saves:
            slot = self._held.pop(req_id, None)
            if slot is not None:
                self._free_slots.append(slot)
                counters["pd_lease_expired"] += 1

    def load_cancelled(self, request: ConnectorRequest) -> None:
        self._release(request.request_id, unread=True)

    # -- both sides: a request ends -------------------------------------------------------------

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if req_id in self._loads:
            # Ended before its load was reported (aborted, rejected, failed): nobody reads it.
            self._release(req_id, unread=True)
        self._consumed.discard(req_id)
        params = getattr(request, "kv_transfer_params", None)
        if not params or not params.get(REMOTE_DECODE):
            return False, None
        status = getattr(request, "status", None)
        if getattr(status, "name", None) != "FINISHED_LENGTH_CAPPED":
            return False, None  # stopped, aborted or failed: nothing to decode elsewhere
        num_full = request.num_computed_tokens // self.block_size
        num_full = min(num_full, request.num_prompt_tokens // self.block_size)
        tables = [list(t[:num_full]) for t in block_ids]
        if num_full == 0 or any(b < 0 for t in tables for b in t) or not self._free_slots:
            return False, {"engine": self.rank, "num_tokens": 0}
        epoch = next(self._epochs)
        slot = self._free_slots.pop()
        self.segment.renew[slot] = 0.0  # before the parameters leave: a release may come first
        self.segment.done[slot] = 0
        out = {
            "engine": self.rank,
            "host": HOST_ID,
            "segment": self.segment.name,
            "block_ids": tables,
            "num_tokens": num_full * self.block_size,
            "epoch": epoch,
            "slot": slot,
        }
        link = _links.get(self.rank)
        if link is not None:
            out["address"] = link.address  # readers on other hosts pull over ZMQ
            addresses = getattr(link, "addresses", None)
            if addresses and len(addresses) > 1:
                out["addresses"] = list(addresses)  # one per tensor-parallel rank
        self._exports.append(
            KVTransfer(
                req_id,
                req_id,
                tables,
                [list(t) for t in tables],
                0,
                num_full * self.block_size,
                params={"epoch": epoch, "slot": slot, "lease_s": self.config.kv_lease_s},
            )
        )
        self._held[req_id] = slot
        self.counters["pd_exports"] += 1
        return True, out

    def lease_renewals(self) -> dict[str, float]:
        """Transfers still under way, and when their reader last said so (the core's lease
        runs from there): exports of this engine, and loads this engine is pulling."""
        renew_at = self.segment.renew
        out = {req_id: renew_at[slot] for req_id, slot in self._held.items() if renew_at[slot]}
        link = _links.get(self.rank)
        for req_id, load in self._loads.items():
            if load.sent and load.params.get("via") == ZMQ:
                if link is not None and (at := link.renewed_at(load.params)):
                    out[req_id] = at
            elif load.sent:
                segment = attach(str(load.params.get("segment", "")))
                slot = int(load.params.get("slot", -1))
                if segment is not None and 0 <= slot < segment.num_blocks and segment.renew[slot]:
                    out[req_id] = segment.renew[slot]
        return out

    def stats(self) -> dict[str, int | float]:
        link = _links.get(self.rank)
        if link is not None:
            self.counters["pd_auth_refused"] = link.auth_refused
        return dict(self.counters)

    def close(self) -> None:
        self.segment.close()


def now() -> float:
    """The host-wide clock the segment's ``renew`` stamps use."""
    return time.monotonic()


class PDProvider:
    """The built-in ``"pd"`` connector. Backends bring the worker half (the mock's and the
    CUDA backend's), which registers the transport between hosts (:func:`register_link`)."""

    name = "pd"

    def scheduler(self, config: EngineConfig, layout: KVConnectorLayout) -> KVConnectorScheduler:
        return PDConnectorScheduler(config, layout)

    def worker(
        self, config: EngineConfig, layout: KVConnectorLayout, backend: str, rank: int
    ) -> KVConnectorWorker | None:
        return None
