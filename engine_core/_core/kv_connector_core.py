"""The core's side of a KV connector: parked loads, pinned blocks, leases, failures.

The scheduler calls these hooks (``docs/kv_connector.md``, "What the core does"):

- :meth:`ConnectorCore.try_park` at admission, after the device prefix hit: a request whose
  connector offers tokens gets its blocks and parks in ``WAITING_FOR_REMOTE_KVS`` with a
  provisional computed-token count; the loaded blocks stay out of the device prefix cache;
- :meth:`ConnectorCore.release_for` when the head of the queue cannot get blocks and nothing
  runs: the newest parked load is cancelled (or a loaded request waiting behind the head gives
  its blocks back) so the queue never stalls;
- :meth:`ConnectorCore.build` once per step: the connector's metadata; the blocks of its saves
  are pinned (an extra reference) until the save is reported;
- :meth:`ConnectorCore.apply_report` with each step's results: finished loads go back to the
  front of the queue, cut back to their first failed block (then ``kv_load_failure_policy``);
- :meth:`ConnectorCore.request_finished`: a finished request's blocks are held (pinned) while
  the connector saves them, under a lease.

A connector's scheduler half that raises ends only the requests it was called for; they are
collected in :attr:`ConnectorCore.ended` and reported with the next outputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine_core._core.block_pool import KVCacheBlock
from engine_core._core.engine_io import FinishedRequest
from engine_core._core.request import Request, RequestStatus
from engine_core.kv_connector import (
    ConnectorStep,
    KVConnectorMetadata,
    KVConnectorReport,
    KVConnectorScheduler,
)

if TYPE_CHECKING:
    from engine_core._core.kv_cache_manager import KVCacheManager
    from engine_core._core.request_queue import RequestQueue

__all__ = ["ConnectorCore", "ConnectorCounters"]

logger = logging.getLogger(__name__)

_WAITING = RequestStatus.WAITING
_PARKED = RequestStatus.WAITING_FOR_REMOTE_KVS
_ERROR = RequestStatus.FINISHED_ERROR

PARKED = 1
""":meth:`ConnectorCore.try_park`: the request parked (taken out of the queue)."""
ENDED = 2
"""The connector raised or misbehaved for it: it ended with an error (taken out of the queue)."""
NO_ROOM = 3
"""The blocks for the load did not fit: the queue waits, as for any request."""


class ConnectorCounters:
    """What the connector did, for ``EngineStats``."""

    __slots__ = (
        "parked_requests",
        "loads_finished",
        "loads_failed",
        "loads_cancelled",
        "failed_blocks",
        "bytes_loaded",
        "bytes_stored",
        "load_s",
        "store_s",
        "external_tokens",
        "lease_expired",
        "connector_errors",
    )

    def __init__(self) -> None:
        self.parked_requests = 0
        """Requests that parked for a load (cumulative)."""
        self.loads_finished = 0
        self.loads_failed = 0
        """Loads with at least one failed block."""
        self.loads_cancelled = 0
        self.failed_blocks = 0
        self.bytes_loaded = 0
        self.bytes_stored = 0
        self.load_s = 0.0
        self.store_s = 0.0
        self.external_tokens = 0
        """Tokens the connector delivered (loads, after cutting failed blocks)."""
        self.lease_expired = 0
        self.connector_errors = 0


class _Parked:
    __slots__ = ("request", "since", "local_tokens", "num_blocks")

    def __init__(self, request: Request, since: float, local_tokens: int, num_blocks: int) -> None:
        self.request = request
        self.since = since
        self.local_tokens = local_tokens
        """The device hit before the load (the cut never goes below it)."""
        self.num_blocks = num_blocks


class ConnectorCore:
    """The hooks between the scheduler and a connector's scheduler half (see the module)."""

    def __init__(
        self,
        connector: KVConnectorScheduler,
        kv: KVCacheManager,
        *,
        block_size: int,
        failure_policy: str = "recompute",
        lease_s: float = 30.0,
        max_parked_fraction: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        name: str = "connector",
    ) -> None:
        self.connector = connector
        self.kv = kv
        self.block_size = block_size
        self.failure_policy = failure_policy
        self.lease_s = lease_s
        self.max_parked_blocks = max(1, int(kv.num_blocks * max_parked_fraction))
        self.stall_s = min(lease_s, 0.5)
        """How long a parked load may hold blocks the head of the queue needs while nothing
        runs, before it is cancelled."""
        self.clock = clock
        self.name = name
        self.parked: dict[str, _Parked] = {}
        """Requests in WAITING_FOR_REMOTE_KVS, in park order."""
        self.parked_blocks = 0
        self.loaded: set[str] = set()
        """Requests whose load was reported, waiting in the queue with their blocks."""
        self.no_load: set[str] = set()
        """Requests whose load was cancelled: they compute instead (until admitted)."""
        self.pins: dict[str, list[tuple[list[list[KVCacheBlock]], float]]] = {}
        """Blocks kept out of reuse for transfers in flight (saves, late free), by id."""
        self.cancelled: list[str] = []
        """Loads cancelled since the last metadata."""
        self.ended: list[FinishedRequest] = []
        """Requests the connector ended (errors), to report with the next outputs."""
        self.counters = ConnectorCounters()
        self._failed: set[str] = set()
        """Requests the connector's errors ended: it is not called for them again."""
        self._closed = False

    # -- state ----------------------------------------------------------------------------------

    @property
    def needs_step(self) -> bool:
        """Whether a step must run (even with no tokens) so that reports keep arriving."""
        return bool(self.parked or self.pins or self.cancelled)

    @property
    def num_pinned_transfers(self) -> int:
        return len(self.pins)

    def tables(self, request: Request) -> list[list[int]]:
        """The request's whole block table per group (ids; -1: released)."""
        ids = self.kv.table_ids(request)
        if self.kv.nested:
            return ids
        return [ids]

    def _range_ids(self, request: Request, start: int, end: int) -> list[list[int]]:
        return [table[start:end] for table in self.tables(request)]

    def _error(self, request: Request, message: str) -> None:
        """End ``request`` with finish_reason "error" (it holds no connector state after)."""
        self.counters.connector_errors += 1
        self._failed.add(request.request_id)
        request.error = message
        self.ended.append(FinishedRequest(request.request_id, "error", None, message))

    def _guard(self, what: str, call: Callable[[], Any]) -> tuple[bool, Any]:
        try:
            return True, call()
        except Exception as exc:  # a plugin's bug must end only its requests
            logger.warning("KV connector %r: %s raised %r", self.name, what, exc)
            return False, f"KV connector {self.name!r}: {what} raised {type(exc).__name__}: {exc}"

    # -- admission ------------------------------------------------------------------------------

    def try_park(
        self,
        request: Request,
        hits: Any,
        num_hit_tokens: int,
        *,
        keep_free: int = 0,
    ) -> int | None:
        """Ask the connector for tokens beyond the device hit (``request`` is the head of the
        queue). PARKED: it parked (the caller takes it out of the queue); ENDED: the connector
        raised or offered what it cannot, its error is reported (the caller takes it out of
        the queue and ends it: it holds nothing); NO_ROOM: the blocks do not fit; None: go on
        without a load."""
        req_id = request.request_id
        if req_id in self.no_load:
            return None
        connector = self.connector
        ok, result = self._guard(
            "get_num_new_matched_tokens",
            lambda: connector.get_num_new_matched_tokens(request, num_hit_tokens),
        )
        if not ok:
            self._error(request, result)
            return ENDED
        bad = None
        try:
            num_external, _ = result
        except (TypeError, ValueError):
            bad = f"returned {result!r}, not (tokens, is_async)"
            num_external = 0
        if bad is None and (
            not isinstance(num_external, int)
            or num_external < 0
            or num_external % self.block_size
            or num_hit_tokens + num_external > len(request.all_token_ids) - 1
        ):
            bad = (
                f"offered {num_external!r} tokens after a hit of {num_hit_tokens} for a request "
                f"of {len(request.all_token_ids)} tokens (whole blocks, never the last token)"
            )
        if bad is not None:
            self._error(request, f"KV connector {self.name!r}: get_num_new_matched_tokens {bad}")
            return ENDED
        if num_external == 0:
            return None
        kv = self.kv
        num_blocks = -(-(num_hit_tokens + num_external) // self.block_size) * kv.num_groups
        # The bound holds whenever another load is parked (one load alone may take what its
        # request could hold anyway).
        # Past it the queue waits for the parked loads (they end soon, or are cancelled).
        if self.parked and self.parked_blocks + num_blocks > self.max_parked_blocks:
            return NO_ROOM if self._tell_alloc(request, [], 0) else ENDED
        if not kv.allocate_slots(
            request, num_external, hits, full_sequence_must_fit=True, keep_free=keep_free
        ):
            return NO_ROOM if self._tell_alloc(request, [], 0) else ENDED
        # No other request may hit a block still loading: registered once it is reported.
        kv.uncache_uncomputed(request, num_hit_tokens)
        request.set_status(_PARKED)
        request.num_computed_tokens = num_hit_tokens + num_external
        start = num_hit_tokens // self.block_size
        block_ids = self._range_ids(request, start, start + num_external // self.block_size)
        self.parked[req_id] = _Parked(request, self.clock(), num_hit_tokens, num_blocks)
        self.parked_blocks += num_blocks
        self.counters.parked_requests += 1
        if not self._tell_alloc(request, block_ids, num_external):
            self._unpark(request)
            kv.free(request)
            request.num_computed_tokens = 0
            request.set_status(_WAITING)
            return ENDED
        return PARKED

    def _tell_alloc(self, request: Request, block_ids: list[list[int]], num_external: int) -> bool:
        connector = self.connector
        ok, result = self._guard(
            "update_state_after_alloc",
            lambda: connector.update_state_after_alloc(request, block_ids, num_external),
        )
        if not ok:
            self._error(request, result)
        return ok

    def admitted(self, request: Request) -> None:
        """``request`` is running now (with or without a load)."""
        req_id = request.request_id
        self.loaded.discard(req_id)
        self.no_load.discard(req_id)

    def _unpark(self, request: Request) -> _Parked | None:
        entry = self.parked.pop(request.request_id, None)
        if entry is not None:
            self.parked_blocks -= entry.num_blocks
            request.num_computed_tokens = entry.local_tokens
        return entry

    def cancel(self, request: Request, *, reason: str) -> None:
        """Give up on a parked load: the request recomputes from scratch (its blocks freed)."""
        if self._unpark(request) is None:
            return
        self.counters.loads_cancelled += 1
        self.cancelled.append(request.request_id)
        logger.info("KV load of %r cancelled: %s", request.request_id, reason)
        self._guard("load_cancelled", lambda: self.connector.load_cancelled(request))
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.set_status(_WAITING)
        self.no_load.add(request.request_id)

    def release_for(self, head: Request, waiting: RequestQueue) -> bool:
        """The head of the queue cannot get blocks and nothing runs: cancel the newest parked
        load parked for longer than ``stall_s`` (a load still on its way gets that long), or
        let a loaded request behind the head give its blocks back. Returns whether anything
        was released."""
        stuck_since = self.clock() - self.stall_s
        for entry in reversed(list(self.parked.values())):
            request = entry.request
            if request is head or entry.since > stuck_since:
                continue
            self.cancel(request, reason="its blocks are needed by the head of the queue")
            waiting.add(request)
            return True
        for req_id in list(self.loaded):
            if req_id == head.request_id:
                continue
            found = next((r for r in waiting if r.request_id == req_id), None)
            self.loaded.discard(req_id)
            if found is None:
                continue
            self.kv.free(found)
            found.num_computed_tokens = 0
            self.no_load.add(req_id)
            return True
        return False

    def expire(self, waiting: RequestQueue) -> None:
        """Cancel parked loads and drop pins older than the lease."""
        now = self.clock()
        limit = now - self.lease_s
        renewals = getattr(self.connector, "lease_renewals", None)
        renewed: dict[str, float] = {}
        if renewals is not None:
            # A connector whose transfer is still under way renews its lease (disaggregation).
            ok, result = self._guard("lease_renewals", renewals)
            renewed = result if ok and isinstance(result, dict) else {}
        for req_id, at in renewed.items():
            parked = self.parked.get(req_id)
            if parked is not None:
                parked.since = max(parked.since, at)
            held = self.pins.get(req_id)
            if held:
                self.pins[req_id] = [(blocks, max(t, at)) for blocks, t in held]
        for entry in list(self.parked.values()):
            if entry.since < limit:
                self.counters.lease_expired += 1
                request = entry.request
                self.cancel(request, reason=f"not reported within kv_lease_s ({self.lease_s} s)")
                waiting.add_front(request)
        expired = [t for t, pins in self.pins.items() if pins[0][1] < limit]
        for transfer_id in expired:
            self.counters.lease_expired += 1
            logger.warning(
                "KV transfer %r not reported within kv_lease_s: cancelled, its blocks freed",
                transfer_id,
            )
            # The worker half drops it before the next forward pass (the blocks may be reused
            # in that step); the scheduler half hears of it as a failed save.
            self._unpin(transfer_id)
            self.cancelled.append(transfer_id)
        if expired:
            report = KVConnectorReport(failed_saves=expired)
            self._guard("on_report", lambda: self.connector.on_report(report))

    # -- pins -----------------------------------------------------------------------------------

    def _pin_ids(self, transfer_id: str, block_ids: list[list[int]]) -> None:
        """Take an extra reference on each block (per group, keeping the grouped manager's
        per-group counts right: a pin may outlive its request's reference)."""
        pool = self.kv.pool
        in_use = getattr(self.kv, "blocks_in_use", None)
        by_group: list[list[KVCacheBlock]] = []
        for g, ids in enumerate(block_ids):
            blocks = [pool.blocks[i] for i in ids if i >= 0]
            free_before = pool.num_free_blocks
            pool.touch(blocks)
            if in_use is not None and g < len(in_use):
                in_use[g] += free_before - pool.num_free_blocks
            by_group.append(blocks)
        if any(by_group):
            self.pins.setdefault(transfer_id, []).append((by_group, self.clock()))

    def _unpin(self, transfer_id: str) -> None:
        pins = self.pins.pop(transfer_id, None)
        if not pins:
            return
        pool = self.kv.pool
        in_use = getattr(self.kv, "blocks_in_use", None)
        for by_group, _ in pins:
            for g, blocks in enumerate(by_group):
                free_before = pool.num_free_blocks
                pool.free(list(reversed(blocks)))
                if in_use is not None and g < len(in_use):
                    in_use[g] -= pool.num_free_blocks - free_before

    # -- steps ----------------------------------------------------------------------------------

    def build(
        self,
        scheduled: list[Request],
        computed_before: list[int],
        end_request: Callable[[Request], None],
    ) -> KVConnectorMetadata | None:
        """The step's metadata (None: nothing); pins the blocks of its saves."""
        cancelled, self.cancelled = self.cancelled, []
        step = ConnectorStep(scheduled, computed_before, self.tables, cancelled)
        ok, result = self._guard("build_metadata", lambda: self.connector.build_metadata(step))
        if not ok:
            self._fail_in_flight(result, end_request)
            return KVConnectorMetadata(cancelled=cancelled) if cancelled else None
        meta: KVConnectorMetadata | None = result
        if meta is None:
            if cancelled:
                return KVConnectorMetadata(cancelled=cancelled)
            return None
        if meta.saves:
            saves = []
            for save in meta.saves:
                if any(save.block_ids):
                    self._pin_ids(save.transfer_id, save.block_ids)
                    saves.append(save)
                else:
                    # A save of nothing (a finished request with nothing left to store) ends
                    # now: the blocks held for it are freed.
                    self._unpin(save.transfer_id)
            meta.saves = saves
        if cancelled and not meta.cancelled:
            meta.cancelled = cancelled
        return meta

    def _fail_in_flight(self, message: str, end_request: Callable[[Request], None]) -> None:
        for entry in list(self.parked.values()):
            request = entry.request
            self._unpark(request)
            self._error(request, message)
            end_request(request)

    def apply_report(
        self,
        report: KVConnectorReport | None,
        waiting: RequestQueue,
        end_request: Callable[[Request], None],
    ) -> None:
        """Apply a step's report: finished loads (cut back to their first failed block, then
        the failure policy) back to the front of the queue; finished saves unpinned."""
        if report is None:
            return
        counters = self.counters
        counters.bytes_loaded += report.bytes_loaded
        counters.bytes_stored += report.bytes_stored
        counters.load_s += report.load_s
        counters.store_s += report.store_s
        ok, result = self._guard("on_report", lambda: self.connector.on_report(report))
        if not ok:
            self._fail_in_flight(result, end_request)
        failed = [set(ids) for ids in report.failed_block_ids]
        resumed: list[Request] = []
        for req_id in report.finished_loads:
            entry = self.parked.get(req_id)
            if entry is None:
                continue  # cancelled or ended meanwhile
            request = entry.request
            provisional = request.num_computed_tokens
            cut = self._first_failed(request, entry.local_tokens, provisional, failed)
            self._unpark(request)
            counters.loads_finished += 1
            if cut is None:
                request.num_computed_tokens = provisional
            else:
                counters.loads_failed += 1
                counters.failed_blocks += (provisional - cut) // self.block_size
                request.num_computed_tokens = cut
                if self.failure_policy == "fail":
                    self._error(
                        request,
                        f"the KV load of {req_id!r} failed from position {cut} "
                        "(kv_load_failure_policy 'fail')",
                    )
                    end_request(request)
                    continue
            counters.external_tokens += request.num_computed_tokens - entry.local_tokens
            request.set_status(_WAITING)
            self.loaded.add(req_id)
            resumed.append(request)
        for request in reversed(resumed):
            waiting.add_front(request)
        for transfer_id in report.finished_saves:
            self._unpin(transfer_id)
        for transfer_id in report.failed_saves:
            self._unpin(transfer_id)

    def _first_failed(
        self, request: Request, local: int, provisional: int, failed: list[set[int]]
    ) -> int | None:
        """The first position of a failed block among those the load delivered (None: none
        failed), in any group."""
        if not any(failed):
            return None
        bs = self.block_size
        start, end = local // bs, provisional // bs
        first = None
        for g, table in enumerate(self.tables(request)):
            bad = failed[g] if g < len(failed) else set()
            if not bad:
                continue
            for i in range(start, min(end, len(table))):
                if table[i] in bad:
                    first = i if first is None else min(first, i)
                    break
        return None if first is None else first * bs

    # -- ends -----------------------------------------------------------------------------------

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """``request`` ended (its blocks are about to be freed): cancel its load, hold its
        blocks when the connector asks. Returns the transfer parameters for the client."""
        req_id = request.request_id
        was_parked = req_id in self.parked
        if was_parked:
            self._unpark(request)
            self.counters.loads_cancelled += 1
            self.cancelled.append(req_id)
            self._guard("load_cancelled", lambda: self.connector.load_cancelled(request))
        self.loaded.discard(req_id)
        self.no_load.discard(req_id)
        if req_id in self._failed:
            self._failed.discard(req_id)
            if request.error is None or "KV connector" in request.error:
                return None  # the connector failed it: do not call it again for it
        tables = self.tables(request)
        ok, result = self._guard(
            "request_finished", lambda: self.connector.request_finished(request, tables)
        )
        if not ok:
            self.counters.connector_errors += 1
            return None
        try:
            hold, params = result
        except (TypeError, ValueError):
            return None
        if hold and not was_parked:
            self._pin_ids(req_id, tables)
        return params if isinstance(params, dict) else None

    def request_preempted(self, request: Request) -> None:
        """Before a preempted request's blocks are freed: keep those the connector will save."""
        tables = self.tables(request)
        ok, result = self._guard(
            "request_preempted", lambda: self.connector.request_preempted(request, tables)
        )
        if not ok or result is None:
            return
        try:
            transfer_id, block_ids = result
        except (TypeError, ValueError):
            return
        if isinstance(transfer_id, str) and isinstance(block_ids, list):
            self._pin_ids(transfer_id, block_ids)

    def reset(self) -> None:
        self._guard("reset", self.connector.reset)

    def close(self) -> None:
        """Shutdown: the connector's scheduler half releases what it holds (once)."""
        if not self._closed:
            self._closed = True
            self._guard("close", self.connector.close)

    def stats(self) -> dict[str, int | float]:
        ok, result = self._guard("stats", self.connector.stats)
        return result if ok and isinstance(result, dict) else {}
