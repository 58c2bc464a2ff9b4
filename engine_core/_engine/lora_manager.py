"""The engine core's LoRA adapters: which are loaded, loading, pinned; loads off the step path.

Adapters load on one loader thread (``Backend.add_lora`` and ``remove_lora`` run there, while
steps run in theirs; ``docs/lora.md``). Everything else here runs in the engine's thread: a
finished load becomes visible to the scheduler (:attr:`LoRAManager.loaded`, the scheduler's
``lora_ready``) only when :meth:`LoRAManager.poll` sees it, between steps.

At most ``EngineConfig.max_cpu_loras`` adapters are kept; to make room the least recently used
one that no live request uses and that is not pinned is removed, once the new one has loaded
(so a load that fails costs no adapter; meanwhile one more may be in host memory). An adapter
asked for while every kept one is in use waits until one is free.
"""

from __future__ import annotations

import concurrent.futures
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine_core.lora import LoRAError, LoRARequest, LoRASupport, check_adapter, read_adapter_config

if TYPE_CHECKING:
    from engine_core.abc import Backend
    from engine_core.config import EngineConfig

__all__ = ["LoRAManager"]


class LoRAManager:
    """Loads, keeps and removes the adapters of one engine (see the module's docs)."""

    def __init__(
        self,
        config: EngineConfig,
        backend: Backend,
        support: LoRASupport,
        users: dict[int, int],
    ) -> None:
        self.backend = backend
        self.support = support
        self.max_lora_rank = config.max_lora_rank
        self.capacity = config.lora_capacity
        self.users = users
        """Live requests per adapter (the scheduler's ``lora_users``)."""
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()
        """Adapters whose ``add_lora`` returned, least recently used first."""
        self.loading: dict[int, tuple[LoRARequest, concurrent.futures.Future[None]]] = {}
        self.wanted: dict[int, LoRARequest] = {}
        """Adapters requests wait for that could not start loading yet (no room)."""
        self.pinned: set[int] = set()
        self.removing: set[int] = set()
        """Adapters removed while requests still use them: removed once those end."""
        self.failed: list[tuple[int, LoRAError]] = []
        """Loads that failed since the last :meth:`take_failed` (their requests fail)."""
        self.num_loads = 0
        self.num_evictions = 0
        self._waiters: list[tuple[LoRARequest, concurrent.futures.Future[None]]] = []
        """Control calls (``add_lora``) waiting for a load to end."""
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine-core-lora"
        )
        self.waker: Callable[[], None] | None = None
        """Called from the loader thread when a load ends (must not block)."""

    # -- from the engine's thread ---------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a load runs or waits for room (the engine then has something to wait for)."""
        return bool(self.loading or self.wanted)

    def name_of(self, lora_id: int) -> str:
        """The name of a known adapter (else its id as text)."""
        known = self.loaded.get(lora_id) or self.wanted.get(lora_id)
        if known is None and lora_id in self.loading:
            known = self.loading[lora_id][0]
        return known.lora_name if known is not None else str(lora_id)

    def identity_conflict(self, lora: LoRARequest) -> str | None:
        """Why ``lora`` cannot run under its id (another adapter is known by it), or None."""
        known = self.loaded.get(lora.lora_int_id)
        if known is None:
            entry = self.loading.get(lora.lora_int_id)
            known = entry[0] if entry is not None else self.wanted.get(lora.lora_int_id)
        if known is None or known == lora:
            return None
        return (
            f"lora_int_id {lora.lora_int_id} is in use by adapter {known.lora_name!r} "
            f"({known.lora_path}); give each adapter its own id"
        )

    def request_arrived(self, lora: LoRARequest) -> None:
        """A request of ``lora`` was queued (its count is in :attr:`users` already): load it if
        it is not, else mark it used."""
        lora_id = lora.lora_int_id
        self.removing.discard(lora_id)  # asked for again: kept
        if lora_id in self.loaded:
            self.loaded.move_to_end(lora_id)
        elif lora_id not in self.loading and lora_id not in self.wanted:
            self.wanted[lora_id] = lora
            self._start_wanted()

    def poll(self) -> None:
        """Take the loads that ended, remove adapters removed while in use once free, and
        start waiting loads where there is room. Cheap when nothing is going on."""
        if self.loading:
            for lora_id, (lora, future) in list(self.loading.items()):
                if not future.done():
                    continue
                del self.loading[lora_id]
                error = future.exception()
                if error is None:
                    self.loaded[lora_id] = lora
                    self.num_loads += 1
                    self._trim()
                else:
                    if not isinstance(error, LoRAError):
                        error = LoRAError(lora.lora_name, f"{type(error).__name__}: {error}")
                    self.failed.append((lora_id, error))
                self._answer_waiters(lora, error)
        if self.removing:
            for lora_id in [i for i in self.removing if not self.users.get(i)]:
                self.removing.discard(lora_id)
                self._remove_now(lora_id)
        if self.wanted:
            self._start_wanted()

    def take_failed(self) -> list[tuple[int, LoRAError]]:
        failed, self.failed = self.failed, []
        return failed

    def add(self, lora: LoRARequest) -> concurrent.futures.Future[None]:
        """Load ``lora`` (a control call): a future that ends when it is loaded, or with the
        :class:`LoRAError` that stopped it."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        conflict = self.identity_conflict(lora)
        if conflict is not None:
            future.set_exception(LoRAError(lora.lora_name, conflict))
            return future
        lora_id = lora.lora_int_id
        self.removing.discard(lora_id)
        if lora_id in self.loaded:
            self.loaded.move_to_end(lora_id)
            future.set_result(None)
            return future
        if lora_id not in self.loading:
            if not self._has_room():
                future.set_exception(LoRAError(lora.lora_name, self._no_room_reason()))
                return future
            self.wanted.pop(lora_id, None)
            self._load(lora)
        self._waiters.append((lora, future))
        return future

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter: at once when no live request uses it, else once they ended (they
        finish with it). False when it is not loaded."""
        if lora_int_id not in self.loaded and lora_int_id not in self.loading:
            return False
        self.pinned.discard(lora_int_id)
        if self.users.get(lora_int_id) or lora_int_id in self.loading:
            self.removing.add(lora_int_id)
        else:
            self._remove_now(lora_int_id)
        return True

    def pin(self, lora_int_id: int) -> bool:
        """Keep an adapter loaded until it is removed (never evicted)."""
        if lora_int_id not in self.loaded or lora_int_id in self.removing:
            raise ValueError(f"no adapter with lora_int_id {lora_int_id} is loaded")
        self.pinned.add(lora_int_id)
        return True

    def list(self) -> list[int]:
        """The ids of the loaded adapters (not those being removed), ascending."""
        return sorted(i for i in self.loaded if i not in self.removing)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    # -- internals ------------------------------------------------------------------------------

    def _has_room(self) -> bool:
        """Whether one more adapter may start loading: the kept ones are evicted only once a
        load succeeded (:meth:`_trim`), so a failed load costs no adapter."""
        over = len(self.loaded) + len(self.loading) - self.capacity
        if over < 0:
            return True
        free = sum(1 for i in self.loaded if i not in self.pinned and not self.users.get(i))
        return free > over

    def _trim(self) -> None:
        """Evict least recently used free adapters while more than ``capacity`` are kept or
        loading."""
        while len(self.loaded) + len(self.loading) > self.capacity and self._evict_one():
            pass

    def _no_room_reason(self) -> str:
        if len(self.pinned) >= self.capacity:
            return (
                f"every one of the max_cpu_loras ({self.capacity}) kept adapters is pinned; "
                "remove one first"
            )
        return (
            f"all max_cpu_loras ({self.capacity}) kept adapters are in use by requests; "
            "retry once they end"
        )

    def _evict_one(self) -> bool:
        """Remove the least recently used adapter that is free (no user, not pinned)."""
        for lora_id in self.loaded:
            if lora_id not in self.pinned and not self.users.get(lora_id):
                self.num_evictions += 1
                self._remove_now(lora_id)
                return True
        return False

    def _remove_now(self, lora_id: int) -> None:
        if self.loaded.pop(lora_id, None) is not None:
            self._executor.submit(self.backend.remove_lora, lora_id)

    def _start_wanted(self) -> None:
        for lora_id, lora in list(self.wanted.items()):
            if not self.users.get(lora_id):
                del self.wanted[lora_id]  # its requests ended before it could load
                continue
            if not self._has_room():
                if len(self.pinned) >= self.capacity:
                    del self.wanted[lora_id]
                    self.failed.append((lora_id, LoRAError(lora.lora_name, self._no_room_reason())))
                    continue
                return
            del self.wanted[lora_id]
            self._load(lora)

    def _load(self, lora: LoRARequest) -> None:
        future = self._executor.submit(self._add_on_loader, lora)
        self.loading[lora.lora_int_id] = (lora, future)
        future.add_done_callback(self._wake)

    def _wake(self, _future: object) -> None:
        waker = self.waker
        if waker is not None:
            waker()

    def _add_on_loader(self, lora: LoRARequest) -> None:
        """On the loader thread: check the adapter's config, then the backend loads it."""
        config = read_adapter_config(lora)
        check_adapter(lora, config, self.support, self.max_lora_rank)
        self.backend.add_lora(lora)

    def _answer_waiters(self, lora: LoRARequest, error: BaseException | None) -> None:
        if not self._waiters:
            return
        keep = []
        for waiting, future in self._waiters:
            if waiting.lora_int_id != lora.lora_int_id:
                keep.append((waiting, future))
            elif error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
        self._waiters = keep
