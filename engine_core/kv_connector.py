"""The KV connector contract: what a plugin author implements to move KV blocks between the
engine's device cache and somewhere else (host memory, a disk, another engine).

``docs/kv_connector.md`` is the guide; this module is the reference. A connector has two halves:

- a **scheduler half** (:class:`KVConnectorScheduler`), in the engine process: pure Python, no
  torch. It is asked, when a request is admitted, how many tokens beyond the device's prefix hit
  it can supply (and whether asynchronously); told the blocks allocated for them; builds each
  step's :class:`KVConnectorMetadata`, which travels to the worker half inside
  ``SchedulerOutput.kv_connector_metadata``; receives the worker half's per-step
  :class:`KVConnectorReport` (``ModelRunnerOutput.kv_connector_report``); and is asked, when a
  request finishes, whether its blocks must be held a while longer and what transfer parameters
  to return to the client.
- a **worker half** (:class:`KVConnectorWorker`), in the backend, on every tensor-parallel rank:
  it registers the KV cache, starts each step's loads and saves, and reports finished transfers
  and failed block ids.

Everything is per KV-cache group: a block table is ``block_ids[g]`` for group ``g`` (one group:
one list), as in ``SchedulerOutput``.

Connectors are found by name: the built-in ones, then the entry-point group
``engine_core.kv_connectors``, whose entry points name a :class:`KVConnectorProvider` (cheap to
import, like a backend provider).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    from engine_core.config import EngineConfig

__all__ = [
    "ENTRY_POINT_GROUP",
    "ConnectorRequest",
    "KVConnectorLayout",
    "KVConnectorMetadata",
    "KVConnectorProvider",
    "KVConnectorReport",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "KVTransfer",
    "available_host_memory",
    "check_host_memory",
    "BUILTIN_CONNECTORS",
    "load_kv_connector",
    "ConnectorStep",
]

ENTRY_POINT_GROUP = "engine_core.kv_connectors"
"""The entry-point group of connector plugins (each names a :class:`KVConnectorProvider`)."""


# -- wire types ----------------------------------------------------------------------------------


class KVTransfer(msgspec.Struct, array_like=True, omit_defaults=True):
    """One load or save of some of a request's blocks, in every KV-cache group.

    ``block_ids[g]`` are device block ids of group ``g``; ``remote[g]``, parallel to it, are
    the connector's own addresses for them (host slots, offsets, remote block ids: the scheduler
    half's choice, opaque to the core). Every group lists the same number of entries, one per
    table position from ``first_block`` on; an entry ``-1`` (in ``block_ids[g]`` and
    ``remote[g]``) moves nothing for that group there (a window group needs only the blocks its
    window sees; a block already stored in one group but not another).
    """

    transfer_id: str
    """Unique among the transfers in flight; a load's id is its request's id."""
    req_id: str
    block_ids: list[list[int]]
    remote: list[list[int]] = []
    first_block: int = 0
    """Position in the request's block table of ``block_ids[g][0]``."""
    num_tokens: int = 0
    """Tokens the transfer covers (for the worker's accounting and cost models)."""
    params: dict[str, Any] | None = None
    """Connector-specific parameters (plain msgspec-encodable values)."""


class KVConnectorMetadata(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the scheduler half tells the worker half for one step (inside
    ``SchedulerOutput.kv_connector_metadata``; None on a step with nothing for the connector).

    Ordering rules the worker half keeps, in :meth:`KVConnectorWorker.start_step`:

    1. ``cancelled`` first: a cancelled transfer's blocks are handed to other requests in this
       very step, so no copy into (or out of) them may run after this step's forward pass
       starts (on a device: the compute stream waits on the cancelled copies' events).
       Cancelled transfers are not reported as finished.
    2. ``saves``: the blocks hold final KV (computed in earlier steps). The core keeps them out
       of reuse until the save is reported in ``finished_saves`` (or ``failed_saves``), so
       they may be copied at leisure, off the step's critical path.
    3. ``loads``: the blocks are the request's, allocated and not read by any step until the
       load is reported in ``finished_loads``.
    """

    loads: list[KVTransfer] = []
    saves: list[KVTransfer] = []
    cancelled: list[str] = []
    """Transfer ids of loads the core gave up on (their requests recompute), and of saves not
    reported within ``kv_lease_s`` (their blocks go back to the pool: the worker half must not
    read them after this step's forward pass starts)."""
    extra: bytes = b""
    """Connector-specific payload (e.g. msgspec-encoded), opaque to the core."""

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.cancelled or self.extra)


class KVConnectorReport(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the worker half reports back (``ModelRunnerOutput.kv_connector_report``; None when
    there is nothing to report). A transfer is reported once, in the output of any step at or
    after the one that started it; with several tensor-parallel ranks the backend merges the
    ranks' reports (a transfer is finished when every rank finished it; a block failed when it
    failed on any rank: :meth:`merge`)."""

    finished_loads: list[str] = []
    """Loads that ended, successfully or not (their failed blocks are in ``failed_block_ids``)."""
    finished_saves: list[str] = []
    failed_block_ids: list[list[int]] = []
    """Per KV-cache group, device block ids of loads that did not deliver valid KV (dropped,
    corrupt, late past the worker's deadline). Empty: none failed."""
    failed_saves: list[str] = []
    """Saves that did not store valid KV: the scheduler half forgets their blocks."""
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_s: float = 0.0
    """Seconds the finished loads took, summed (start to end, as the worker measured)."""
    store_s: float = 0.0

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_loads or self.finished_saves or self.failed_block_ids or self.failed_saves
        )

    @staticmethod
    def merge(reports: Sequence[KVConnectorReport | None]) -> KVConnectorReport | None:
        """One report from every tensor-parallel rank's: transfers finished on all ranks,
        blocks failed on any. Transfers finished on only some ranks are left out (the caller
        keeps them for a later step)."""
        present = [r for r in reports if r is not None]
        if not present:
            return None
        if len(present) == 1 and len(reports) == 1:
            return present[0]
        n = len(reports)

        def on_all(lists: list[list[str]]) -> list[str]:
            counts: dict[str, int] = {}
            for ids in lists:
                for t in ids:
                    counts[t] = counts.get(t, 0) + 1
            return [t for t, c in counts.items() if c == n]

        num_groups = max((len(r.failed_block_ids) for r in present), default=0)
        failed: list[list[int]] = [[] for _ in range(num_groups)]
        for r in present:
            for g, ids in enumerate(r.failed_block_ids):
                failed[g].extend(i for i in ids if i not in failed[g])
        return KVConnectorReport(
            finished_loads=on_all([r.finished_loads for r in present]),
            finished_saves=on_all([r.finished_saves for r in present]),
            failed_block_ids=failed if any(failed) else [],
            failed_saves=sorted({t for r in present for t in r.failed_saves}),
            bytes_loaded=sum(r.bytes_loaded for r in present),
            bytes_stored=sum(r.bytes_stored for r in present),
            load_s=max((r.load_s for r in present), default=0.0),
            store_s=max((r.store_s for r in present), default=0.0),
        )


class KVConnectorLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The device KV cache as both halves see it (no tensors: the worker half gets those from
    its backend in :meth:`KVConnectorWorker.register_kv_caches`)."""

    num_blocks: int
    block_size: int
    kv_groups: list[list[int]]
    """Layer indices of each KV-cache group, in the order of the block tables."""
    group_kinds: list[str]
    """Per group: ``"full_attention"``, ``"sliding_attention"`` or ``"chunked_attention"``."""
    group_spans: list[int | None]
    """Per group: the window (chunk) size, None for full attention."""
    page_size_bytes: int
    """Bytes of one block (page) of one group: every layer of the group, K and V."""

    @property
    def num_groups(self) -> int:
        return len(self.kv_groups)


# -- the scheduler half --------------------------------------------------------------------------


class ConnectorRequest(Protocol):
    """What the scheduler half may read of a request (the core's ``Request``). Read only."""

    request_id: str
    all_token_ids: list[int]
    """Prompt then output tokens."""
    num_prompt_tokens: int
    num_computed_tokens: int
    block_keys: list[bytes]
    """Prefix-cache key of each full block (``engine_core._core.block_hash``): the same keys
    the device prefix cache uses, so ``cache_salt`` (and anything else the keys include)
    isolates a connector's index too."""
    cache_salt: str | None
    num_preemptions: int


class KVConnectorScheduler(abc.ABC):
    """The scheduler half. Called from the engine's scheduling thread only; must not block.

    A method that raises ends only the requests it was called for, with finish_reason "error"
    and the exception in the message (a raise in :meth:`build_metadata` or :meth:`on_report`
    ends every request with a transfer in flight); the engine keeps serving.
    """

    def __init__(self, config: EngineConfig, layout: KVConnectorLayout) -> None:
        self.config = config
        self.layout = layout

    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond the device hit (``num_computed_tokens``, a multiple of the block size)
        that the connector can supply, and whether the load is asynchronous. Whole blocks only,
        and never the request's last token (its logits are needed). ``(0, False)``: none.

        The core treats every load as asynchronous: the request waits
        (``WAITING_FOR_REMOTE_KVS``) until the load is reported, then runs."""

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[list[int]], num_external_tokens: int
    ) -> None:
        """The blocks allocated for the ``num_external_tokens`` tokens the connector offered
        (``block_ids[g]``: group ``g``'s blocks for them, in table order, starting at table
        position ``num_computed_tokens // block_size``); the next :meth:`build_metadata` should
        load into them. Called with ``num_external_tokens == 0`` when the core could not take
        the offer (no room, the parked-load bound): nothing to load."""

    @abc.abstractmethod
    def build_metadata(self, step: ConnectorStep) -> KVConnectorMetadata | None:
        """This step's metadata (None: nothing). ``step`` says what the core scheduled and what
        it cancelled; called once per step, after the batch is chosen."""

    @abc.abstractmethod
    def on_report(self, report: KVConnectorReport) -> None:
        """The worker half's report for a step, before the core acts on it (the core itself
        moves finished loads on and cuts failed ones back)."""

    def request_finished(
        self, request: ConnectorRequest, block_ids: list[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request`` ended (or was aborted): whether the core must keep its blocks until a
        save of its id (``transfer_id == request.request_id``) is reported finished (bounded
        by ``EngineConfig.kv_lease_s``), and transfer parameters to return to the client
        (``FinishedRequest.kv_transfer_params``). Default: ``(False, None)``."""
        return False, None

    def request_preempted(
        self, request: ConnectorRequest, block_ids: list[list[int]]
    ) -> tuple[str, list[list[int]]] | None:
        """``request`` is being preempted: its computed blocks are about to be freed. A
        connector that stores blocks saves what it has not stored yet in the next
        :meth:`build_metadata`, so that resuming the request is a load: it returns that save's
        transfer id and the blocks (per group) it will read, which the core keeps out of reuse
        until the save is reported (or ``kv_lease_s``). None (the default): nothing to keep.
        Blocks kept here are not free for the request that preempted this one, so keep few
        (those not stored yet)."""
        return None

    def load_cancelled(self, request: ConnectorRequest) -> None:  # noqa: B027
        """The core gave up on ``request``'s load (it held blocks the queue needed, its lease
        ran out, or the request was aborted); it will be listed in ``cancelled``."""

    def stats(self) -> dict[str, int | float]:
        """Connector counters for ``EngineStats`` (names without a prefix); ``{}`` by default."""
        return {}

    def reset(self) -> None:  # noqa: B027
        """Forget every stored block (``reset_prefix_cache``)."""

    def close(self) -> None:  # noqa: B027
        """Release everything; called once."""


class ConnectorStep:
    """What the core did in one step, as :meth:`KVConnectorScheduler.build_metadata` sees it."""

    __slots__ = ("scheduled", "num_computed_before", "cancelled", "_tables")

    def __init__(
        self,
        scheduled: list[Any],
        num_computed_before: list[int],
        tables: Any,
        cancelled: list[str],
    ) -> None:
        self.scheduled = scheduled
        """The requests of the batch (``ConnectorRequest``), in batch order."""
        self.num_computed_before = num_computed_before
        """Parallel to ``scheduled``: each request's computed tokens before the step (what
        earlier steps wrote: final KV)."""
        self.cancelled = cancelled
        """Loads the core cancelled since the previous step (their ids)."""
        self._tables = tables

    def block_table(self, index: int) -> list[list[int]]:
        """The whole block table, per group, of the ``index``-th scheduled request (device
        ids; -1: a released entry). Built on demand: call it only for requests it needs."""
        return self._tables(self.scheduled[index])


# -- the worker half -----------------------------------------------------------------------------


class KVConnectorWorker(abc.ABC):
    """The worker half, in the backend (one per tensor-parallel rank). The backend calls it
    from its step thread, in this order: :meth:`register_kv_caches` once after it allocated
    the KV cache; then per step :meth:`start_step` before the forward pass (with the step's
    metadata; None: nothing for the connector), :meth:`after_forward` once the forward pass is
    launched, and :meth:`get_finished` when the step's results are gathered (its report goes in
    ``ModelRunnerOutput.kv_connector_report``). A step that schedules no tokens still runs
    these three (the core runs such a step while transfers are in flight).

    An exception from any of them is a backend error: the engine dies with it as the cause
    (a worker half must never hang: give every wait a deadline, and report a transfer past
    it as failed).
    """

    def __init__(self, config: EngineConfig, layout: KVConnectorLayout, rank: int = 0) -> None:
        self.config = config
        self.layout = layout
        self.rank = rank

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: Any) -> None:
        """The backend's KV cache (its own representation: per-layer tensors on a device, a
        bookkeeping ledger in the mock)."""

    @abc.abstractmethod
    def start_step(self, metadata: KVConnectorMetadata | None) -> None:
        """Apply ``cancelled``, start ``saves`` and ``loads`` (see
        :class:`KVConnectorMetadata` for the order). Must not wait for transfers."""

    def after_forward(self) -> None:  # noqa: B027
        """The forward pass is launched (layer-wise connectors save per layer here)."""

    @abc.abstractmethod
    def get_finished(self) -> KVConnectorReport | None:
        """Transfers that ended since the last call (None: nothing to report)."""

    def close(self) -> None:  # noqa: B027
        """Release everything (buffers, streams, threads); called once."""


# -- discovery -----------------------------------------------------------------------------------


@runtime_checkable
class KVConnectorProvider(Protocol):
    """The cheap object a ``engine_core.kv_connectors`` entry point names."""

    name: str

    def scheduler(self, config: EngineConfig, layout: KVConnectorLayout) -> KVConnectorScheduler:
        """The scheduler half, in the engine process."""
        ...

    def worker(
        self, config: EngineConfig, layout: KVConnectorLayout, backend: str, rank: int
    ) -> KVConnectorWorker | None:
        """The worker half for ``backend`` on tensor-parallel ``rank``, or None when the
        backend brings its own implementation of this connector (the built-in host tier's
        worker halves live in the mock and CUDA backends)."""
        ...


BUILTIN_CONNECTORS = {
    "host": "engine_core._core.host_tier:HostTierProvider",
    "pd": "engine_core._core.pd_connector:PDProvider",
}
"""Connectors that ship with the engine, by name (``module:attribute`` of their provider)."""


def load_kv_connector(name: str) -> KVConnectorProvider:
    """The provider of connector ``name``: a built-in one, else the entry point of that name in
    ``engine_core.kv_connectors``. ``ValueError`` naming what is installed when there is none,
    or when the entry point does not name a :class:`KVConnectorProvider`."""
    import importlib
    from importlib.metadata import entry_points

    target = BUILTIN_CONNECTORS.get(name)
    if target is not None:
        module, _, attr = target.partition(":")
        provider = getattr(importlib.import_module(module), attr)()
    else:
        found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
        if name not in found:
            known = sorted(set(BUILTIN_CONNECTORS) | set(found))
            raise ValueError(
                f"unknown KV connector {name!r} (kv_connector): known are {', '.join(known)}; "
                f"a plugin registers one in the entry-point group {ENTRY_POINT_GROUP!r}"
            )
        provider = found[name].load()
        if isinstance(provider, type):
            provider = provider()
    if not isinstance(provider, KVConnectorProvider):
        raise ValueError(f"KV connector {name!r}: {provider!r} is not a KVConnectorProvider")
    return provider


def available_host_memory() -> int | None:
    """Bytes of memory this machine has available (``MemAvailable``), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def check_host_memory(requested: int, available: int | None = None) -> None:
    """``ValueError`` naming ``kv_offload_bytes`` (``--kv-offload-bytes``) and what is
    available when ``requested`` bytes of host memory are more than can be pinned here
    (``available``: the backend's own limit; None: this machine's available memory)."""
    if available is None:
        available = available_host_memory()
    if available is not None and requested > available:
        raise ValueError(
            f"kv_offload_bytes (--kv-offload-bytes) asks for {_gib(requested)} ({requested} "
            f"bytes) of host memory, but only {_gib(available)} ({available} bytes) can be "
            "pinned here; give a smaller size (or 0 to turn the host tier off)"
        )
