"""The hybrid KV cache (scheduler/kv/kv_groups.py, scheduler/kv/hybrid.py): groups of layers
by attention type, sliding groups freeing the blocks their window no longer reaches,
prefix hits that need only the window's blocks, and a scheduler that runs on it.

Block size 4 throughout (block k holds tokens [4k, 4k + 4)); window 6 unless said: the
next token at position p reads keys p - 5 .. p, so a sliding group needs the blocks from
(p - 5) // 4 on."""

from __future__ import annotations

import pytest

from pagedserve.scheduler import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig
from pagedserve.scheduler.kv.hybrid import NULL_BLOCK, HybridKVCacheManager
from pagedserve.scheduler.kv.kv_groups import FULL_ATTENTION as F
from pagedserve.scheduler.kv.kv_groups import SLIDING_ATTENTION as S
from pagedserve.scheduler.kv.kv_groups import KVCacheGroups, kv_cache_groups

from _sched_helpers import step


def test_groups_follow_vllms_layout():
    gemma3_1b = [S if (i + 1) % 6 else F for i in range(26)]  # 22 local, 4 global
    g = kv_cache_groups(gemma3_1b, 512)
    assert g.group_size == 4 and g.windows == (None,) + (512,) * 6
    assert g.layers[0] == (5, 11, 17, 23) and g.layers[1] == (0, 1, 2, 3) and g.layers[-1] == (24, 25)
    assert (g.layer_group(25), g.layer_slot(25), g.layer_slot(23)) == (6, 1, 3)
    gemma2 = [S, F] * 13  # 13 and 13: one group each
    assert kv_cache_groups(gemma2, 4096).layers == (tuple(range(1, 26, 2)), tuple(range(0, 26, 2)))
    near = [S] * 11 + [F] * 9  # within 25%: the larger count, one group each, 2 slots idle
    assert kv_cache_groups(near, 8).group_size == 11
    # 7 groups of 4 slots for 26 layers: at 512 tokens (the window) the idle slots cost more
    # than nothing saved; at 8K the local groups keep 33 blocks each instead of 512.
    assert kv_cache_groups(gemma3_1b, 512, max_model_len=512) is None
    assert kv_cache_groups(gemma3_1b, 512, max_model_len=8192) == g
    for types, window, alloc in (([F] * 4, None, "paged"), (gemma2, None, "paged"), (gemma2, 8, "contiguous")):
        assert kv_cache_groups(types, window, alloc) is None  # one group: every layer keeps every block
    # Every layer sliding (Mistral's window): one sliding group of them all.
    assert kv_cache_groups([S] * 4, 8) == KVCacheGroups(4, (8,), ((0, 1, 2, 3),))


def manager(num_blocks=32, layer_types=(S, S, F, S), window=6, caching=True) -> HybridKVCacheManager:
    cfg = CacheConfig(num_blocks=num_blocks, block_size=4, watermark=0.0, enable_prefix_caching=caching,
                      kv_groups=kv_cache_groups(list(layer_types), window))
    return HybridKVCacheManager(cfg, 64, cfg.kv_groups)


def req(rid, tokens) -> Request:
    r = Request(rid, list(tokens), SamplingParams(max_tokens=64))
    r.max_tokens = 64
    return r


def compute(kv, r: Request, n: int, hit=(), num_hit=0) -> list[int]:
    new = kv.allocate_slots(r, n, hit, num_hit)
    assert new is not None
    r.num_computed_tokens += num_hit + n
    kv.cache_full_blocks(r)
    return [b.block_id for b in new]


def test_sliding_groups_free_what_the_window_left_behind():
    kv = manager()  # groups: full [2], sliding [0], [1], [3]
    r = req("a", range(10))
    assert compute(kv, r, 10) == list(range(12))  # 3 logical blocks x 4 groups, interleaved
    assert kv.held_blocks("a") == [3, 3, 3, 3] and len(kv.req_to_blocks["a"]) == 12
    for t in range(40):  # decode to 50 tokens
        r.append_output_token_ids(100 + t)
        compute(kv, r, 1)
        full, *local = kv.held_blocks("a")
        assert full == -(-r.num_computed_tokens // 4)
        # the window's first key's block .. the newest: at most 3 with window 6, block 4
        assert all(n <= 3 for n in local)
    assert kv.held_blocks("a") == [13, 2, 2, 2] and kv.num_free_blocks == 32 - 19
    ids, table = kv.get_block_ids("a"), kv.req_tables["a"]
    assert len(ids) == 4 * 13 and ids[1::4][:10] == [0] * 10  # freed: id 0, never read by a kernel
    assert table[1][:10] == [NULL_BLOCK] * 10 and len(kv.req_to_logical_blocks["a"]) == 13
    kv.free(r)
    assert kv.num_free_blocks == 32 and not kv.req_tables


def test_a_new_logical_block_needs_a_block_in_every_group():
    kv = manager(num_blocks=11)
    a = req("a", range(8))
    assert compute(kv, a, 8) == list(range(8))
    b = req("b", range(100, 103))
    assert kv.allocate_slots(b, 3) is None  # 1 logical block = 4 blocks; 3 free
    assert kv.num_free_blocks == 3 and "b" not in kv.req_tables
    kv.free(a)
    assert kv.allocate_slots(b, 3) is not None and kv.held_blocks("b") == [1, 1, 1, 1]


def test_a_prefix_hit_needs_only_the_windows_blocks():
    kv = manager()
    a = req("a", range(20))
    compute(kv, a, 20)  # 5 full blocks in every group, all cached
    for t in range(12):  # decode on: the sliding groups free blocks 0 .. 5 as they go (cached first)
        a.append_output_token_ids(500 + t)
        compute(kv, a, 1)
    assert kv.held_blocks("a") == [8, 2, 2, 2]  # token 31 reads keys 26 .. 31: blocks 6, 7
    kv.free(a)
    b = req("b", list(range(20)) + [99])
    hit, n = kv.get_computed_blocks(b)
    # 20 tokens: the next one (position 20) reads keys 15 .. 20, blocks 3 and 4
    assert n == 20 and len(hit) == 5 + 3 * 2
    assert [len(g) for g in hit.per_group] == [5] * 4 and hit.per_group[1][:3] == [NULL_BLOCK] * 3
    # without group 1's block 4 the longest hit is 16 tokens (blocks 2, 3 in the sliding groups)
    node4 = kv.block_pool.cached_block_hash_to_block.pop((1, hit.per_group[0][4].node_id))
    node4.block_key = None
    hit, n = kv.get_computed_blocks(b)
    assert n == 16 and hit.per_group[2][:2] == [NULL_BLOCK] * 2
    assert compute(kv, b, 5, hit, n) == list(kv.get_block_ids("b")[16:])  # blocks 4, 5 of every group, new
    ids = kv.get_block_ids("b")
    assert ids[1:8:4] == [0, 0] and kv.held_blocks("b") == [6, 4, 4, 4]
    assert len(kv.req_to_blocks["b"]) == 18


def test_every_layer_sliding_one_group_keys_the_cache_itself():
    """Mistral's window: one sliding group, whose own blocks key the trie. Decoding frees
    them as the window moves on; a hit walks every cached block of the prefix and takes only
    the window's; a block freed before its step's result came back ends the trie there."""
    kv = manager(layer_types=(S, S), window=6)
    a = req("a", range(20))
    compute(kv, a, 20)  # blocks 0 .. 4, all cached
    for t in range(12):
        a.append_output_token_ids(500 + t)
        compute(kv, a, 1)
    assert kv.held_blocks("a") == [2] and kv.get_block_ids("a")[:6] == [0] * 6
    kv.free(a)
    b = req("b", list(range(20)) + [99])
    hit, n = kv.get_computed_blocks(b)
    assert n == 20 and len(hit) == 2 and hit.per_group[0][:3] == [NULL_BLOCK] * 3
    assert len(compute(kv, b, 1, hit, n)) == 1 and kv.held_blocks("b") == [3]  # blocks 3, 4 and a new 5
    assert kv.req_to_node_ids["b"] == hit.node_ids and len(hit.node_ids) == 5
    # A plan that ran ahead: 12 tokens scheduled and the next plan freeing block 0 before
    # the first step's result offers the full blocks to the cache.
    c = req("c", range(1000, 1012))
    kv.allocate_slots(c, 12)
    c.num_computed_tokens = 12
    kv.allocate_slots(c, 1)  # frees block 0 (token 12 reads keys 7 .. 12)
    kv.cache_full_blocks(c)
    assert kv.req_tables["c"][0][0] is NULL_BLOCK and kv.req_to_node_ids["c"] == []
    assert kv.get_computed_blocks(req("d", range(1000, 1013))) == ([], 0)


def test_no_caching_and_prompt_logprobs_take_no_hit():
    kv = manager(caching=False)
    a = req("a", range(12))
    compute(kv, a, 12)
    kv.free(a)
    assert kv.get_computed_blocks(req("b", range(13))) == ([], 0)


def _mirror(tables, plan):
    """The worker's tables, from the plan's diffs alone (worker/model_runner._update_states)."""
    for rid in plan.finished_req_ids:
        tables.pop(rid, None)
    for rid in plan.preempted_req_ids:
        tables[rid] = []
    for new in plan.scheduled_new_reqs:
        tables[new.req_id] = list(new.block_ids)
    c = plan.scheduled_cached_reqs
    for rid, resumed, ids in zip(c.req_ids, c.resumed_from_preemption, c.new_block_ids):
        tables[rid] = list(ids) if resumed else tables[rid] + list(ids)


@pytest.mark.parametrize("num_blocks", [200, 36])  # 36: preemptions
def test_a_scheduler_on_the_hybrid_cache_sends_the_worker_every_block_it_reads(num_blocks):
    """Requests of 3..30 prompt tokens decoding 30 each, prefix hits, chunked prefill, and
    (with 36 blocks) preemption: after every step, for every scheduled request and every
    group, the worker's table (rebuilt from the plans' diffs) holds the manager's blocks
    at every position its next rows read, each held by every request that reads it."""
    from _sched_helpers import add, make_scheduler

    groups = kv_cache_groups([S, S, F, S], 6)
    sched = make_scheduler(num_blocks=num_blocks, budget=16, max_model_len=64, kv_groups=groups)
    kv, G, tables = sched.kv_cache_manager, groups.num_groups, {}
    shared = list(range(1, 13))
    for i, n in enumerate([3, 30, 17, 12, 25]):
        add(sched, f"r{i}", (shared + list(range(100 + 40 * i, 140 + 40 * i)))[:n] if i % 2 else
            list(range(1000 + 40 * i, 1000 + 40 * i + n)), max_tokens=30)
    while sched.has_unfinished_requests():
        plan, _ = step(sched, token=5)
        _mirror(tables, plan)
        readers = {}
        for rid in plan.num_scheduled_tokens:
            if rid not in kv.req_tables:
                continue
            r = sched.requests[rid]
            first_row = r.num_computed_tokens - plan.num_scheduled_tokens[rid]
            for g in range(G):
                row = kv.req_tables[rid][g]
                lo = kv._first_needed(g, first_row)
                for i in range(lo, len(row)):
                    assert row[i] is not NULL_BLOCK and tables[rid][i * G + g] == row[i].block_id, (rid, g, i)
                    readers.setdefault(row[i].block_id, set()).add(rid)
        for block_id, rids in readers.items():  # several only through a shared prefix, each holding it
            assert kv.block_pool.blocks[block_id].ref_cnt >= len(rids)
        held = {b.block_id for t in kv.req_tables.values() for row in t for b in row if b is not NULL_BLOCK}
        assert kv.num_blocks - kv.num_free_blocks == len(held)  # a shared prefix's blocks count once
    assert kv.num_free_blocks == num_blocks
    if num_blocks == 36:
        assert sched.num_preemptions > 0
    else:
        assert sched.num_preemptions == 0 and sched.prefix_cache_hits >= 8  # r3's 12 tokens on r1's: 2 blocks
