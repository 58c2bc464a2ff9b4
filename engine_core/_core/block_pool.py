"""The pool of physical KV blocks: ref counts, an O(1) free queue and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from engine_core._core.kv_events import KVEventLog

__all__ = ["BlockPool", "FreeBlockQueue", "KVCacheBlock"]


class KVCacheBlock:
    """One physical block. ``key`` is set while the block is registered in the prefix cache."""

    __slots__ = ("block_id", "ref_cnt", "key", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.key is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels: O(1) pop, push and removal anywhere.

    The front is evicted first. Links live in the blocks themselves, so no operation allocates.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Mutation testing: the sentinels' ids are never read, and an empty queue whose head
        # links to None instead of the tail behaves the same (popleft and iteration stop at
        # either), so those mutants are equivalent.
        self._head = KVCacheBlock(-1)  # pragma: no mutate
        self._tail = KVCacheBlock(-1)  # pragma: no mutate
        self._head.next_free = self._tail  # pragma: no mutate
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        # A block's two links are set and cleared together, so `and` would do as well as `or`.
        if prev is None or nxt is None:  # pragma: no mutate
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Evicted last."""
        last = self._tail.prev_free
        assert last is not None
        self._insert(block, last, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Reused first."""
        first = self._head.next_free
        assert first is not None
        self._insert(block, self._head, first)

    def _insert(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    """All KV blocks of the engine.

    Free blocks are ordered for eviction: blocks holding no cached prefix are reused first (they
    are worth nothing); cached blocks are reused least-recently-freed first, and a request frees
    its blocks tail first, so within one request the longest-prefix blocks are evicted before the
    head blocks (which more future requests share). A cached block stays in the map while free
    and is evicted lazily when it is handed out again.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.events: KVEventLog | None = None
        """Where the blocks that start and stop being cached are recorded (data parallelism
        sets it; None records nothing)."""

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0..1)."""
        return 1.0 - self.free_queue.num_free_blocks / self.num_blocks

    def lookup(self, key: bytes) -> KVCacheBlock | None:
        return self.cached.get(key)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free hit leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks (ref count 1), evicting their cached prefixes."""
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks, {self.free_queue.num_free_blocks} free"
            )
        popleft = self.free_queue.popleft
        out = []
        for _ in range(num_blocks):
            block = popleft()
            if block.key is not None:
                self.uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def uncache(self, block: KVCacheBlock) -> None:
        """Take a registered block out of the prefix cache."""
        key = block.key
        assert key is not None
        if self.cached.get(key) is block:
            del self.cached[key]
            if self.events is not None:
                self.events.removed(key)
        block.key = None

    def cache_block(self, block: KVCacheBlock, key: bytes) -> None:
        """Register a full block. An equal prefix already cached keeps its block (no dedup, so
        block tables stay append-only)."""
        if key not in self.cached:
            self.cached[key] = block
            block.key = key
            if self.events is not None:
                self.events.stored(key)

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference on each block; pass a request's blocks tail first."""
        queue = self.free_queue
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.key is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)
            # Mutation testing: `<= 0` and `< 1` are equivalent here (0 is handled above).
            elif block.ref_cnt < 0:  # pragma: no mutate
                raise RuntimeError(f"{block!r} freed more often than referenced")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if self.free_queue.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached.values():
            block.key = None
        self.cached.clear()
        if self.events is not None:
            self.events.clear()
        return True
