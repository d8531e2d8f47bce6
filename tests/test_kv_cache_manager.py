"""KVCacheManager: on-demand allocation, prefix hits (full and partial), salted and
collision-safe keys, LRU eviction of cached free blocks, contiguous reservation.

Block size 4 throughout, so block k holds tokens [4k, 4k+4)."""

from pagedserve.scheduler import CacheConfig, KVCacheManager, Request, SamplingParams
from pagedserve.scheduler.kv.kv_cache_utils import extend_block_hashes


def manager(num_blocks=8, **kw) -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_blocks=num_blocks, block_size=4, watermark=0.0, **kw),
                          max_model_len=64)


def req(rid, tokens, salt=None, max_tokens=8) -> Request:
    r = Request(rid, tokens, SamplingParams(max_tokens=max_tokens), cache_salt=salt)
    r.max_tokens = max_tokens
    return r


def compute(kv: KVCacheManager, r: Request, n: int) -> list[int]:
    """Allocate for n tokens, mark them computed (as schedule() does), cache full blocks."""
    new = kv.allocate_slots(r, n)
    assert new is not None
    r.num_computed_tokens += n
    kv.cache_full_blocks(r)
    return [b.block_id for b in new]


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def test_blocks_are_taken_only_as_tokens_need_them():
    kv = manager()
    r = req("a", list(range(10)))
    assert compute(kv, r, 10) == [0, 1, 2]  # 10 tokens -> 3 blocks, 2 slots spare
    r.append_output_token_ids(100)
    assert compute(kv, r, 1) == []  # token 10 fits block 2
    r.append_output_token_ids(101)
    assert compute(kv, r, 1) == []  # token 11 fills block 2
    r.append_output_token_ids(102)
    assert compute(kv, r, 1) == [3]  # token 12 opens block 3
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert kv.num_free_blocks == 4 and kv.usage == 0.5


def test_allocation_failure_is_none_and_changes_nothing():
    kv = manager(num_blocks=3)
    a = req("a", list(range(8)))
    assert compute(kv, a, 8) == [0, 1]
    b = req("b", list(range(50, 59)))  # needs 3 blocks, 1 free
    assert kv.allocate_slots(b, 9) is None
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 1


def test_watermark_only_applies_when_asked():
    kv = KVCacheManager(CacheConfig(num_blocks=10, block_size=4, watermark=0.2), max_model_len=64)
    assert kv.watermark_blocks == 2
    big = req("big", list(range(36)))  # 9 blocks: would leave 1 free < watermark 2
    assert kv.allocate_slots(big, 36, check_watermark=True) is None
    assert len(kv.allocate_slots(big, 36)) == 9


def test_free_returns_blocks_tail_first():
    kv = manager()
    r = req("a", list(range(10)))
    compute(kv, r, 10)  # [0, 1, 2]
    kv.free(r)
    assert free_ids(kv) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert kv.get_block_ids("a") == []


def test_prefix_hit_reuses_full_blocks_but_never_the_last_prompt_token():
    kv = manager()
    a = req("a", list(range(10)))
    compute(kv, a, 10)  # blocks 0, 1 full and cached; block 2 half full (not cached)
    assert len(a.block_hashes) == 2
    b = req("b", list(range(10)))
    hit, n = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit] == [0, 1] and n == 8
    # Exactly two full blocks of prompt: only the first may hit, the last token must run.
    c = req("c", list(range(8)))
    hit, n = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in hit] == [0] and n == 4
    # Admitting b takes references on the shared blocks and one new block for tokens 8, 9.
    new = kv.allocate_slots(b, 2, hit_b := kv.get_computed_blocks(b)[0], 8)
    assert [blk.block_id for blk in new] == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in hit_b] == [2, 2]


def test_partial_prefix_hit_stops_at_the_first_different_block():
    kv = manager()
    a = req("a", list(range(12)))
    compute(kv, a, 12)  # blocks 0, 1, 2 cached
    b = req("b", [0, 1, 2, 3, 4, 5, 99, 7, 8, 9, 10, 11, 12])  # differs inside block 1
    hit, n = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit] == [0] and n == 4
    # Same block-2 tokens after a different block 1 must not hit either (chained keys).
    assert kv.block_pool.get_cached_block((hit[0].node_id, (4, 5, 99, 7), None)) is None


def test_cache_salt_separates_tenants():
    kv = manager()
    compute(kv, req("a", list(range(9)), salt="tenant-1"), 9)
    assert kv.get_computed_blocks(req("b", list(range(9)), salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(req("c", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(req("d", list(range(9)), salt="tenant-1"))[1] == 8
    # The salt is part of the content hash too (block 0's extra key).
    h1 = extend_block_hashes(req("x", list(range(8)), salt="tenant-1"), 4)
    h2 = extend_block_hashes(req("y", list(range(8)), salt="tenant-2"), 4)
    assert h1[0] != h2[0] and h1[1] != h2[1]


def test_equal_content_hashes_do_not_make_a_wrong_hit():
    # Python hashes ints modulo 2**61 - 1, so these two blocks have the same content
    # hash, but different tokens: the trie key compares the tokens themselves.
    big = 2 ** 61 - 1
    kv = manager()
    a = req("a", [5, 6, 7, 8, 1])
    compute(kv, a, 5)
    b = req("b", [5 + big, 6, 7, 8, 1])
    assert extend_block_hashes(b, 4) == a.block_hashes  # a real collision
    assert kv.get_computed_blocks(b) == ([], 0)


def test_lru_eviction_of_cached_free_blocks():
    kv = manager(num_blocks=6)
    a = req("a", list(range(9)))
    compute(kv, a, 9)  # [0, 1, 2]; 0 and 1 cached
    b = req("b", list(range(100, 109)))
    compute(kv, b, 9)  # [3, 4, 5]; 3 and 4 cached
    kv.free(a)
    kv.free(b)
    assert free_ids(kv) == [2, 1, 0, 5, 4, 3]
    # A new 8-token request takes the two oldest free blocks: a's uncached tail 2, then
    # a's block 1 (evicted from the cache). a's block 0 and all of b stay cached.
    c = req("c", list(range(200, 208)))
    assert compute(kv, c, 8) == [2, 1]
    assert kv.get_computed_blocks(req("a2", list(range(9))))[1] == 4  # block 0 only
    assert kv.get_computed_blocks(req("b2", list(range(100, 109))))[1] == 8
    # The hit on a free cached block pulls it out of the free queue (ref_cnt 0 -> 1).
    b2 = req("b2", list(range(100, 109)))
    hit, n = kv.get_computed_blocks(b2)
    kv.allocate_slots(b2, 1, hit, n)
    assert kv.get_block_ids("b2") == [3, 4, 0]  # 0: the oldest free block, a's old head
    assert free_ids(kv) == [5]


def test_contiguous_reserves_prompt_plus_max_tokens_and_never_shares():
    kv = manager(num_blocks=8, kv_allocation="contiguous")
    a = req("a", list(range(6)), max_tokens=7)  # cdiv(6 + 7, 4) = 4 blocks up front
    assert compute(kv, a, 6) == [0, 1, 2, 3]
    for t in range(7):
        a.append_output_token_ids(t)
        assert compute(kv, a, 1) == []
    b = req("b", list(range(6)), max_tokens=7)
    assert kv.get_computed_blocks(b) == ([], 0)  # no prefix sharing in this baseline
    assert compute(kv, b, 6) == [4, 5, 6, 7]
    assert kv.allocate_slots(req("c", [1], max_tokens=1), 1) is None  # pool exhausted
