"""What a block pool reports of its prefix cache: the blocks it starts and stops caching.

A data-parallel front end routes requests to the engine that already holds their prefix; it
learns what each engine holds from these events, which travel with the step's outputs (so the
events and the tokens of a step arrive together and in order). Within a step only each block's
last change matters: the router's view before the step equals the pool's, so applying the last
change of every block touched in the step makes them equal again.
"""

from __future__ import annotations

from collections.abc import Iterable

from xxhash import xxh3_128_digest

from engine_core._core.engine_io import KVEvents

__all__ = ["KVEventLog", "block_digest", "snapshot"]


def block_digest(key: bytes) -> bytes:
    """The 16-byte digest that names a cached block (of its prefix-cache key) on the wire."""
    return xxh3_128_digest(key)


class KVEventLog:
    """The prefix-cache changes of the current step, keyed by block key (digested when
    drained, so recording costs one dict store)."""

    __slots__ = ("changes", "cleared")

    def __init__(self) -> None:
        self.changes: dict[bytes, bool] = {}
        """Block key -> whether it is cached after its last change."""
        self.cleared = False

    def stored(self, key: bytes) -> None:
        self.changes[key] = True

    def removed(self, key: bytes) -> None:
        self.changes[key] = False

    def clear(self) -> None:
        """Everything cached so far is forgotten (earlier changes of the step with it)."""
        self.changes.clear()
        self.cleared = True

    def drain(self) -> KVEvents | None:
        """The changes since the last drain, or None when there were none."""
        if not self.changes and not self.cleared:
            return None
        stored = [block_digest(k) for k, cached in self.changes.items() if cached]
        removed = [block_digest(k) for k, cached in self.changes.items() if not cached]
        events = KVEvents(stored, removed, self.cleared)
        self.changes = {}
        self.cleared = False
        return events


def snapshot(keys: Iterable[bytes]) -> list[bytes]:
    """Digests of every cached block (for a router that starts with an empty index)."""
    return [block_digest(k) for k in keys]
