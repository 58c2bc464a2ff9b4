"""The block pool: ref counts, the O(1) free queue, lazy eviction of cached prefixes."""

from __future__ import annotations

import pytest

from engine_core._core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# -- FreeBlockQueue -------------------------------------------------------------------------------


def test_queue_starts_in_block_id_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 5
    assert queue.block_ids() == [0, 1, 2, 3, 4]


def test_queue_pop_append_appendleft_remove() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[3])  # from the middle
    assert queue.block_ids() == [1, 2, 4]
    queue.append(blocks[3])
    queue.appendleft(blocks[0])
    assert queue.block_ids() == [0, 1, 2, 4, 3]
    assert len(queue) == 5
    queue.remove(blocks[0])  # the first
    queue.remove(blocks[3])  # the last
    assert queue.block_ids() == [1, 2, 4]
    assert queue.num_free_blocks == 3
    assert blocks[0].prev_free is None and blocks[0].next_free is None


def test_a_new_block_is_in_no_queue() -> None:
    block = KVCacheBlock(7)
    assert (block.block_id, block.ref_cnt, block.key) == (7, 0, None)
    assert block.prev_free is None and block.next_free is None
    with pytest.raises(ValueError, match="not in the free queue"):
        FreeBlockQueue([]).remove(block)


def test_block_repr_says_whether_it_is_cached() -> None:
    block = KVCacheBlock(3)
    assert repr(block) == "KVCacheBlock(3, ref=0, cached=False)"
    block.key = b"k"
    block.ref_cnt = 2
    assert repr(block) == "KVCacheBlock(3, ref=2, cached=True)"


def test_queue_errors() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[0])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[0])
    queue.popleft()
    with pytest.raises(IndexError, match="^no free block$"):
        queue.popleft()
    assert len(queue) == 0
    assert queue.block_ids() == []


# -- BlockPool ------------------------------------------------------------------------------------


def test_pool_has_no_null_block() -> None:
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4
    assert ids(pool.allocate(4)) == [0, 1, 2, 3]
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0
    with pytest.raises(ValueError, match="num_blocks must be > 0, got 0"):
        BlockPool(0)
    assert ids(BlockPool(1).allocate(1)) == [0]


def test_allocate_sets_ref_count_and_rejects_overdraw() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.usage == 0.75
    with pytest.raises(ValueError, match="cannot allocate 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_free_order_unkeyed_first_keyed_lru_tail_first() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)  # 0, 1, 2
    b = pool.allocate(2)  # 3, 4
    pool.cache_block(a[0], b"k0")
    pool.cache_block(a[1], b"k1")
    pool.cache_block(b[0], b"k3")
    # Free tail first, as the manager does.
    pool.free(list(reversed(a)))
    assert pool.free_queue.block_ids() == [2, 5, 1, 0]
    pool.free(list(reversed(b)))
    assert pool.free_queue.block_ids() == [4, 2, 5, 1, 0, 3]
    assert all(blk.ref_cnt == 0 for blk in pool.blocks)
    assert pool.num_free_blocks == 6


def test_shared_block_returns_to_the_queue_with_the_last_reference() -> None:
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"k")
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1
    assert pool.free_queue.block_ids() == [1, 2]
    pool.free([block])
    assert block.ref_cnt == 0
    assert pool.free_queue.block_ids() == [1, 2, 0]


def test_touch_takes_a_free_hit_out_of_the_queue() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], b"k0")
    pool.free(list(reversed(blocks)))
    assert pool.free_queue.block_ids() == [1, 2, 0]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1
    assert pool.free_queue.block_ids() == [1, 2]
    assert pool.num_free_blocks == 2
    assert pool.lookup(b"k0") is blocks[0]


def test_lazy_eviction_when_a_cached_block_is_reused() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], b"k0")
    pool.cache_block(blocks[1], b"k1")
    pool.free(list(reversed(blocks)))
    # Still cached while free.
    assert pool.lookup(b"k0") is blocks[0]
    assert pool.lookup(b"k1") is blocks[1]
    assert pool.free_queue.block_ids() == [1, 0]
    (reused,) = pool.allocate(1)
    assert reused is blocks[1]
    assert reused.key is None
    assert pool.lookup(b"k1") is None
    assert pool.lookup(b"k0") is blocks[0]
    assert set(pool.cached) == {b"k0"}


def test_cache_block_keeps_the_first_block_of_a_prefix() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"k")
    pool.cache_block(b, b"k")
    assert pool.lookup(b"k") is a
    assert a.key == b"k"
    assert b.key is None


def test_freeing_more_often_than_referenced_raises() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed more often than referenced"):
        pool.free([block])


def test_reset_prefix_cache_only_when_nothing_is_in_use() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], b"k0")
    pool.cache_block(blocks[1], b"k1")
    pool.free([blocks[1]])
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(b"k0") is blocks[0]
    assert pool.lookup(b"k1") is blocks[1]
    pool.free([blocks[0]])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert all(b.key is None for b in pool.blocks)
    assert pool.num_free_blocks == 3
