"""BlockPool and its free queue: exact block ids, ref counts and eviction order."""

import pytest

from pagedserve.scheduler.kv.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_free_queue_pops_in_order_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])  # O(1) from the middle (a prefix hit on a free block)
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[0])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 4, 0]
    assert queue.num_free_blocks == 4
    with pytest.raises(ValueError):
        queue.remove(blocks[2])  # not in the queue any more


def test_allocation_takes_lowest_ids_first_and_sets_ref_cnt():
    pool = BlockPool(num_blocks=6)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.num_free_blocks == 3 and pool.get_usage() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)


def test_free_in_reverse_order_evicts_a_sequence_tail_first():
    pool = BlockPool(num_blocks=6)
    seq = pool.get_new_blocks(3)  # [0, 1, 2]
    pool.get_new_blocks(3)  # [3, 4, 5]: the pool is full
    pool.free_blocks(reversed(seq))
    assert free_ids(pool) == [2, 1, 0]
    # The next allocation evicts the tail block 2, then 1; the head block 0 survives longest.
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 1]
    assert free_ids(pool) == [0]


def test_shared_block_is_freed_only_when_its_last_holder_lets_go():
    pool = BlockPool(num_blocks=4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])  # a second table takes it (a prefix hit)
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and 0 not in free_ids(pool)
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and free_ids(pool)[-1] == 0
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def test_cached_free_block_is_reusable_until_it_is_the_oldest_free_block():
    pool = BlockPool(num_blocks=4)
    a, b, c, d = pool.get_new_blocks(4)
    key_a, key_b = (0, (1, 2), None), (0, (3, 4), None)
    pool.cache_block(a, key_a, block_hash=111)
    pool.cache_block(b, key_b, block_hash=222)
    pool.free_blocks([a, c, b, d])  # queue: a c b d
    # A hit on b pulls it out of the middle of the queue.
    assert pool.get_cached_block(key_b) is b
    pool.touch([b])
    assert free_ids(pool) == [0, 2, 3] and b.ref_cnt == 1
    # Allocating one block evicts the LRU block a: its cache entry goes with it.
    (got,) = pool.get_new_blocks(1)
    assert got is a and a.block_key is None and a.block_hash is None
    assert pool.get_cached_block(key_a) is None
    assert pool.get_cached_block(key_b) is b  # still cached (and in use)


def test_second_copy_of_a_cached_prefix_stays_uncached():
    pool = BlockPool(num_blocks=3)
    first, second, _ = pool.get_new_blocks(3)
    key = (0, (7, 7), None)
    node = pool.cache_block(first, key, block_hash=5)
    # Two requests computed the same prefix at once: the copy reports the same node.
    assert pool.cache_block(second, key, block_hash=5) == node
    assert second.block_key is None and pool.get_cached_block(key) is first


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(num_blocks=2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, (0, (1,), None), block_hash=1)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block((0, (1,), None)) is None and a.block_key is None
