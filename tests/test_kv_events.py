"""KV events (scheduler/kv/kv_events.py): a subscriber that applies a replica's batches holds
exactly the prefixes the replica's cache holds, and matches a prompt's leading blocks as
the replica's own lookup does. Block size 4, as in test_kv_cache_manager."""

import random

import pytest

from pagedserve.scheduler import CacheConfig, KVCacheManager, Request, SamplingParams
from pagedserve.scheduler.kv.kv_cache_utils import extend_block_hashes
from pagedserve.scheduler.kv.kv_events import REMOVED, STORED, KVEventBatch, KVEventLog, KVView


def manager(num_blocks=8) -> KVCacheManager:
    kv = KVCacheManager(CacheConfig(num_blocks=num_blocks, block_size=4, watermark=0.0), max_model_len=64)
    kv.block_pool.kv_events = KVEventLog()
    return kv


def req(rid, tokens, salt=None, tenant=None) -> Request:
    r = Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)
    r.cache_tenant = tenant
    return r


def compute(kv: KVCacheManager, r: Request, n: int) -> None:
    assert kv.allocate_slots(r, n) is not None
    r.num_computed_tokens += n
    kv.cache_full_blocks(r)


def cached_hashes(kv: KVCacheManager) -> set[int]:
    return {b.block_hash for b in kv.block_pool.cached_block_hash_to_block.values()}


def test_stores_and_evictions_arrive_in_order_and_a_reset_clears():
    kv = manager(num_blocks=4)
    log = kv.block_pool.kv_events
    assert log.take() is None  # nothing happened
    a = req("a", list(range(9)))
    compute(kv, a, 9)  # blocks 0, 1 full and cached, 2 partial
    batch = log.take()
    assert batch.seq == 1 and not batch.cleared
    assert batch.events == [(STORED, a.block_hashes[0]), (STORED, a.block_hashes[1])]
    kv.free(a)
    b = req("b", list(range(100, 116)))
    compute(kv, b, 16)  # takes all 4 blocks: a's two cached blocks are evicted
    batch = log.take()
    assert batch.seq == 2
    removed = [h for kind, h in batch.events if kind == REMOVED]
    stored = [h for kind, h in batch.events if kind == STORED]
    assert sorted(removed) == sorted(a.block_hashes[:2]) and stored == b.block_hashes[:4]
    kv.free(b)
    assert kv.block_pool.reset_prefix_cache()
    batch = log.take()
    assert batch.seq == 3 and batch.cleared and batch.events == []


def test_a_subscriber_follows_a_random_workload_exactly_and_resyncs_after_a_gap():
    rng = random.Random(0)
    kv = manager(num_blocks=12)
    log = kv.block_pool.kv_events
    view = KVView()
    assert not view.apply(KVEventBatch(seq=1))  # no snapshot yet: every batch is a gap
    view.reset(log.snapshot(kv.block_pool))
    live: list[Request] = []
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    for i in range(200):
        if live and (len(live) > 2 or rng.random() < 0.4):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            r = req(f"r{i}", tokens, salt=rng.choice([None, "s"]))
            hit, n = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, len(tokens) - n, hit, n) is None:
                continue
            r.num_computed_tokens = len(tokens)
            kv.cache_full_blocks(r)
            live.append(r)
        batch = log.take()
        if batch is not None and i % 37 != 5:  # every 37th batch is lost on the way
            if not view.apply(batch):
                view.reset(log.snapshot(kv.block_pool))  # the gap is seen at the next batch
        if view.seq == log.seq:
            assert view.hashes == cached_hashes(kv), i
            # The view matches a prompt's leading blocks as the replica's lookup does.
            probe = req("p", rng.choice(prefixes) + [1, 2, 3, 4, 5], salt=rng.choice([None, "s"]))
            full = (len(probe.all_token_ids) - 1) // 4
            assert view.matched_blocks(extend_block_hashes(probe, 4)[:full]) * 4 == kv.get_computed_blocks(probe)[1]


def test_a_tenant_never_matches_another_tenants_prefix():
    kv = manager()
    compute(kv, req("a", list(range(12)), tenant="acme"), 12)
    view = KVView()
    view.reset(kv.block_pool.kv_events.snapshot(kv.block_pool))
    same = extend_block_hashes(req("x", list(range(12)), tenant="acme"), 4)
    other = extend_block_hashes(req("y", list(range(12)), tenant="globex"), 4)
    untenanted = extend_block_hashes(req("z", list(range(12))), 4)
    assert view.matched_blocks(same) == 3
    assert view.matched_blocks(other) == 0 and view.matched_blocks(untenanted) == 0



def test_over_zmq_a_late_subscriber_and_one_that_misses_a_batch_both_converge():
    """The wire (cluster/wire/kv_events.py), real sockets on 127.0.0.1: a subscriber that
    joins mid-run gets a snapshot, and one whose batch was lost resubscribes and gets one."""
    import time

    from pagedserve.cluster.wire.kv_events import (KVEventPublisher, KVEventSubscriber, ReplicaStats, decode,
                                                   encode_batch)

    kv = manager(num_blocks=12)
    log = kv.block_pool.kv_events
    pub = KVEventPublisher("127.0.0.1")
    subs = [KVEventSubscriber(pub.address)]
    rng = random.Random(1)
    live: list[Request] = []

    def step(i):
        if live and rng.random() < 0.4:
            kv.free(live.pop(0))
        else:
            r = req(f"r{i}", [rng.randrange(20) for _ in range(rng.randrange(4, 14))])
            hit, n = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, len(r.all_token_ids) - n, hit, n) is not None:
                r.num_computed_tokens = len(r.all_token_ids)
                kv.cache_full_blocks(r)
                live.append(r)

    def settle():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pub.pump(kv.block_pool, lambda: ReplicaStats(7))
            for s in subs:
                s.poll()
            if all(s.view.seq == log.seq and s.view.hashes == cached_hashes(kv) for s in subs):
                return
            time.sleep(0.01)
        raise AssertionError([(s.view.seq, log.seq) for s in subs])

    try:
        for i in range(30):
            step(i)
            pub.pump(kv.block_pool, lambda: ReplicaStats(7))
        settle()  # the first subscriber's snapshot came at a pump after it joined
        subs.append(KVEventSubscriber(pub.address))  # a late joiner
        for i in range(30, 60):
            step(i)
            pub.pump(kv.block_pool, lambda: ReplicaStats(7))
            for s in subs:
                s.poll()
        settle()
        step(60)
        while log.take() is None:  # a batch that never arrives
            step(61)
        for i in range(62, 70):
            step(i)
            pub.pump(kv.block_pool, lambda: ReplicaStats(7))
        settle()
        assert subs[0].stats.waiting_prefill_tokens == 7 and subs[0].heard_at is not None
    finally:
        for s in subs:
            s.close()
        pub.close()
    # A message that is not the replica's is refused before it touches a view.
    with pytest.raises(ValueError):
        decode(b"\x00" * 5)
    with pytest.raises(ValueError):
        decode(encode_batch(KVEventBatch(1, False, [(STORED, 5)]), ReplicaStats())[:-1])


def test_the_header_carries_the_replicas_load_and_rates_and_refuses_what_is_not_its():
    """The wire's header (cluster/wire/kv_events.py): every field round-trips on each kind of
    message; a header of another version, a bad rate, a STATS message with a body, an
    unknown kind are refused before they touch a view."""
    import math
    import struct

    from pagedserve.cluster.wire.kv_events import (_HEAD, STATS, WIRE_VERSION, ReplicaStats, decode, encode_batch,
                                                   encode_snapshot, encode_stats)
    from pagedserve.scheduler.kv.kv_events import KVSnapshot

    stats = ReplicaStats(waiting_prefill_tokens=1234, running_prefill_tokens=567, num_waiting_reqs=3,
                         num_running_reqs=9, num_decoding_reqs=7, num_batched_tokens=2048, prefill_tok_s=3456.5,
                         decode_step_s=0.0375, lora_load_s=0.125, lora_adapters=(2**62, 1, 77))
    batch = KVEventBatch(4, True, [(STORED, -5), (REMOVED, 2**62)])
    msg, got = decode(encode_batch(batch, stats))
    assert (msg.seq, msg.cleared, msg.events) == (4, True, [(STORED, -5), (REMOVED, 2**62)]) and got == stats
    msg, got = decode(encode_snapshot(KVSnapshot(9, [1, 2, 3]), stats))
    assert (msg.seq, msg.block_hashes) == (9, [1, 2, 3]) and got == stats
    assert decode(encode_stats(9, stats)) == (None, stats)
    assert decode(encode_stats(0, ReplicaStats())) == (None, ReplicaStats())  # nothing measured yet: zeros
    # Counts that do not fit the header saturate instead of failing the replica's step
    big = decode(encode_stats(1, ReplicaStats(num_running_reqs=2**40, num_waiting_reqs=-3)))[1]
    assert (big.num_running_reqs, big.num_waiting_reqs) == (2**32 - 1, 0)

    good = encode_stats(1, stats)

    def with_head(**fields):
        values = list(_HEAD.unpack_from(good))
        names = ["version", "kind", "seq", "w", "r", "nw", "nr", "nd", "budget", "prefill", "decode", "lora_s",
                 "num_adapters"]
        for k, v in fields.items():
            values[names.index(k)] = v
        return _HEAD.pack(*values) + good[_HEAD.size:]

    assert with_head(version=WIRE_VERSION)[:1] == bytes([WIRE_VERSION])
    for bad in (with_head(version=0), with_head(version=2),  # the old header's first byte is its kind
                with_head(prefill=math.nan), with_head(decode=math.inf), with_head(prefill=-1.0),
                with_head(lora_s=-0.5), with_head(lora_s=math.nan),
                with_head(num_adapters=4),  # more adapters than the message holds
                with_head(kind=7), with_head(kind=STATS) + b"\x00" * 9, good[:-1], b"",
                struct.pack("<BqQ", 0, 1, 7)):  # a message of the old layout
        with pytest.raises(ValueError):
            decode(bad)


def test_a_quiet_replica_still_sends_its_stats_and_the_subscriber_notes_when(monkeypatch):
    """No block changes (an idle replica's heartbeat, a decode step): a header alone goes out,
    at most every STATS_INTERVAL_S; the subscriber's view is untouched and ``heard_at``
    moves."""
    import time

    from pagedserve.cluster.wire import kv_events as wire

    kv = manager()
    pub = wire.KVEventPublisher("127.0.0.1")
    sub = wire.KVEventSubscriber(pub.address)
    calls = []

    def stats():
        calls.append(1)
        return wire.ReplicaStats(num_decoding_reqs=len(calls), prefill_tok_s=1000.0)

    try:
        deadline = time.monotonic() + 10
        while sub.view.seq < 0:  # the snapshot that answers the subscription
            assert time.monotonic() < deadline
            pub.pump(kv.block_pool, stats)
            sub.poll()
            time.sleep(0.01)
        seq, hashes, before = sub.view.seq, set(sub.view.hashes), sub.heard_at
        n = len(calls)
        monkeypatch.setattr(wire, "STATS_INTERVAL_S", 3600.0)
        pub.pump(kv.block_pool, stats)  # within STATS_INTERVAL_S of the last send: nothing
        assert len(calls) == n
        monkeypatch.setattr(wire, "STATS_INTERVAL_S", 0.0)
        pub.pump(kv.block_pool, stats)
        assert len(calls) == n + 1
        while sub.stats.num_decoding_reqs != n + 1:
            assert time.monotonic() < deadline
            sub.poll()
            time.sleep(0.01)
        assert sub.heard_at > before and sub.stats.prefill_tok_s == 1000.0
        assert (sub.view.seq, sub.view.hashes) == (seq, hashes)
    finally:
        sub.close()
        pub.close()
