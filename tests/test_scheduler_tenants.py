"""Tenants in the scheduler (scheduler/fair_queue.py, scheduler/tenancy.py), with exact
plans: the Virtual Token Counter's fair share, reserved capacity, why-waiting reasons,
per-tenant prefix-cache isolation, and preemption hysteresis."""

from __future__ import annotations

from pagedserve.scheduler import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig
from pagedserve.scheduler.config import Reservation
from pagedserve.scheduler.kv.kv_cache_utils import hash_cache_salt

from _sched_helpers import block_ids, step


def sched(num_blocks=64, block_size=4, budget=64, max_seqs=4, max_model_len=128, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len, **cfg),
                     CacheConfig(num_blocks=num_blocks, block_size=block_size, watermark=0.0))


def add(s, rid, prompt, tenant=None, arrival=0.0, max_tokens=8, salt=None, priority=0) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=arrival,
                tenant=tenant, cache_salt=salt, priority=priority)
    s.add_request(r)
    return r


def test_one_tenant_is_plain_fcfs():
    s = sched(max_seqs=2)
    for i in range(4):
        add(s, f"r{i}", range(10 * i, 10 * i + 5), arrival=i)
    plan, _ = step(s)
    assert [n.req_id for n in plan.scheduled_new_reqs] == ["r0", "r1"]
    assert [r.req_id for r in s.waiting] == ["r2", "r3"]


def test_flooding_tenant_gets_half_the_tokens_when_both_are_backlogged():
    # 10:1 offered load: "flood" queues 40 requests, "steady" 4, identical shapes.
    s = sched(max_seqs=4, num_blocks=256)
    for i in range(40):
        add(s, f"f{i}", range(i * 8, i * 8 + 8), tenant="flood", arrival=i * 0.01, max_tokens=8)
    for i in range(4):
        add(s, f"s{i}", range(1000 + i * 8, 1008 + i * 8), tenant="steady", arrival=0.5 + i * 0.01, max_tokens=8)
    tokens = {"flood": 0, "steady": 0}
    while s.waiting.num_waiting("steady") or any(r.tenant == "steady" for r in s.running):
        plan, _ = step(s)
        for rid, n in plan.num_scheduled_tokens.items():
            tokens["steady" if rid.startswith("s") else "flood"] += n
    share = tokens["steady"] / sum(tokens.values())
    assert 0.45 <= share <= 0.55, tokens  # within 10% of 50/50 while both are backlogged
    assert len(s.waiting) > 20  # the flood is still queued: it did not get served first


def test_an_occasional_request_does_not_wait_behind_a_flood():
    s = sched(max_seqs=2, num_blocks=256)
    for i in range(30):
        add(s, f"f{i}", range(i * 8, i * 8 + 8), tenant="flood", arrival=i * 0.01)
    for _ in range(5):
        step(s)
    add(s, "late", range(900, 908), tenant="steady", arrival=99.0)
    info = s.waiting_info("late")
    # Next in line at the flood's counter (ties go to the earlier head: one flood request),
    # ahead of 25 other queued flood requests.
    assert info["position"] <= 1
    started = None
    for k in range(20):
        plan, _ = step(s)
        if any(n.req_id == "late" for n in plan.scheduled_new_reqs):
            started = k
            break
    assert started is not None and started <= 8  # admitted at the first free slot


def test_weights_skew_the_share():
    s = sched(max_seqs=2, num_blocks=256, tenant_weights={"gold": 3.0})
    for i in range(20):
        add(s, f"g{i}", range(i * 8, i * 8 + 8), tenant="gold", arrival=i * 0.01)
        add(s, f"b{i}", range(500 + i * 8, 508 + i * 8), tenant="bronze", arrival=i * 0.01)
    tokens = {"g": 0, "b": 0}
    for _ in range(60):
        plan, _ = step(s)
        for rid, n in plan.num_scheduled_tokens.items():
            tokens[rid[0]] += n
    assert 2.3 <= tokens["g"] / tokens["b"] <= 3.7, tokens


def test_reserved_class_is_admitted_at_once_into_a_full_pool():
    # 12 blocks of 4 tokens; "gold" reserves 4 blocks and 1 slot. "bulk" fills the rest.
    s = sched(num_blocks=12, max_seqs=4, reservations={"gold": Reservation(blocks=4, seqs=1)})
    for i in range(6):
        add(s, f"bulk{i}", range(i * 12, i * 12 + 12), tenant="bulk", max_tokens=40)
    step(s)
    assert [r.req_id for r in s.running] == ["bulk0", "bulk1"]  # 3 blocks each; 4 + 1 slot held back
    assert s.waiting_info("bulk2")["reason"] == "reserved"
    for _ in range(8):  # bulk grows, into gold's free blocks too while gold is absent
        step(s)
    add(s, "vip", range(700, 712), tenant="gold")
    plan, _ = step(s)
    assert [n.req_id for n in plan.scheduled_new_reqs] == ["vip"]  # at once
    assert len(block_ids(s, "vip")) == 3


def test_reserved_class_preempts_others_when_the_pool_is_full():
    s = sched(num_blocks=12, max_seqs=4, reservations={"gold": Reservation(blocks=4, seqs=1)})
    for i in range(3):
        add(s, f"bulk{i}", range(i * 14, i * 14 + 14), tenant="bulk", arrival=i, max_tokens=60)
    step(s)
    # 4 blocks each; the third would only fit into gold's 4 reserved blocks.
    assert [r.req_id for r in s.running] == ["bulk0", "bulk1"]
    while s.kv_cache_manager.num_free_blocks:  # gold is absent: bulk may grow into them
        step(s)
    gold = add(s, "vip", range(700, 712), tenant="gold")
    plan, _ = step(s)
    assert [n.req_id for n in plan.scheduled_new_reqs] == ["vip"] and gold.status.name == "RUNNING"
    assert plan.preempted_req_ids == ["bulk1"]  # the cheaper of the two to recompute
    assert len(block_ids(s, "vip")) == 3


def test_priority_class_reservation():
    s = sched(num_blocks=8, max_seqs=2, reservations={"priority:0": Reservation(seqs=1)})
    for i in range(3):
        add(s, f"low{i}", range(i * 4, i * 4 + 4), priority=5)
    step(s)
    assert [r.req_id for r in s.running] == ["low0"]  # one slot is held for priority 0
    add(s, "urgent", range(100, 104), priority=0)
    plan, _ = step(s)
    assert [n.req_id for n in plan.scheduled_new_reqs] == ["urgent"]


def test_why_waiting_reasons():
    # max_seqs: two running, the rest wait; behind the head of its tenant: queue_order.
    s = sched(max_seqs=2)
    for i in range(4):
        add(s, f"a{i}", range(i * 4, i * 4 + 4), tenant="a", arrival=i)
    step(s)
    assert s.waiting_info("a2")["reason"] == "max_seqs"
    assert s.waiting_info("a3")["reason"] == "queue_order"
    assert s.waiting_info("a0") is None  # running
    # tenant_share: b's head waits while a (with a lower counter) goes first.
    s = sched(max_seqs=1, budget=64)
    add(s, "b0", range(200, 240), tenant="b", max_tokens=2)
    step(s)
    add(s, "a0", range(0, 4), tenant="a", arrival=1)
    add(s, "b1", range(300, 304), tenant="b", arrival=2)
    step(s)
    infos = {r: s.waiting_info(r) for r in ("a0", "b1")}
    assert infos["a0"]["position"] == 0 and infos["b1"]["reason"] == "tenant_share", infos
    # no_budget: a 40-token budget spent by the first prompt.
    s = sched(budget=40, max_seqs=4)
    add(s, "p0", range(0, 40))
    add(s, "p1", range(100, 110))
    step(s)
    assert s.waiting_info("p1")["reason"] == "no_budget"
    # no_blocks: a pool of 4 blocks holds one 12-token prompt, not two.
    s = sched(num_blocks=4, max_seqs=4)
    add(s, "big0", range(0, 12))
    add(s, "big1", range(100, 112))
    step(s)
    info = s.waiting_info("big1")
    assert info["reason"] == "no_blocks" and info["position"] == 0 and info["est_start_steps"] > 0


def test_prefix_cache_is_per_tenant_by_default():
    prompt = list(range(40))
    s = sched(num_blocks=64)
    add(s, "a0", prompt, tenant="alice", max_tokens=1)
    step(s)
    add(s, "a1", prompt, tenant="alice", max_tokens=1)
    add(s, "b0", prompt, tenant="bob", max_tokens=1)
    step(s)
    assert s.prefix_cache_hits == 36  # alice's second request: 9 blocks; bob: none
    # A default-tenant salt cannot spell another tenant's key.
    assert hash_cache_salt("alice") != hash_cache_salt(None, "alice")
    assert hash_cache_salt("x", "alice") != hash_cache_salt(None, "alice") != hash_cache_salt("", "alice")
    # Isolation off: tenants share the cache.
    s = sched(num_blocks=64, isolate_tenant_prefix_cache=False)
    add(s, "a0", prompt, tenant="alice", max_tokens=1)
    step(s)
    add(s, "b0", prompt, tenant="bob", max_tokens=1)
    step(s)
    assert s.prefix_cache_hits == 36


def test_a_just_resumed_request_is_spared_while_another_candidate_exists():
    for protect, expected in ((32, "b"), (0, "c")):
        s = sched(num_blocks=64, max_seqs=4, preemption_protect_steps=protect)
        add(s, "a", range(0, 16), arrival=0)
        add(s, "b", range(100, 108), arrival=1)
        add(s, "c", range(200, 204), arrival=2)
        step(s)
        # c (4 computed tokens) is the cheapest to recompute; say it just resumed.
        s.requests["c"].resumed_step = s.step_id
        victim = s.running[s.tenant_policy.pick_victim(s.running, s.step_id)].req_id
        assert victim == expected, (protect, victim)
        # Once the protection expires, c is the cheapest again.
        s.step_id += protect
        assert s.running[s.tenant_policy.pick_victim(s.running, s.step_id)].req_id == "c"


def test_stats_per_tenant():
    s = sched(max_seqs=1)
    add(s, "a0", range(0, 8), tenant="a")
    add(s, "b0", range(100, 108), tenant="b")
    add(s, "b1", range(200, 208), tenant="b")
    step(s)
    st = s.get_stats()
    assert {t: (v["running"], v["waiting"], v["tokens"]) for t, v in st.tenants.items()} == {
        "a": (1, 0, 8), "b": (0, 2, 0)}
    assert st.queue_kv_demand_blocks == 4 and st.tenants["a"]["counter"] == 8.0


def test_a_steady_request_gets_a_slot_the_next_step_when_a_burst_holds_them_all():
    """Slots are part of the share: with all 4 slots held by the flood's long streams, a
    request of a tenant under its share (2 of 4 slots) starts the next step, by
    preempting the flood's cheapest running request, which restarts later."""
    s = sched(max_seqs=4, num_blocks=256)
    for i in range(12):
        add(s, f"f{i}", range(i * 8, i * 8 + 8), tenant="flood", arrival=i * 0.01, max_tokens=64)
    for _ in range(40):  # well past the hysteresis window of any resumed request
        step(s)
    assert [r.tenant for r in s.running] == ["flood"] * 4
    add(s, "steady", range(900, 908), tenant="steady", arrival=99.0, max_tokens=8)
    plan, _ = step(s)
    assert [n.req_id for n in plan.scheduled_new_reqs] == ["steady"]
    assert len(plan.preempted_req_ids) == 1 and plan.preempted_req_ids[0].startswith("f")
    assert s.requests[plan.preempted_req_ids[0]] in list(s.waiting)  # back in the queue, not lost
    for _ in range(3):  # 1 of 4 is under its share of 2: no further preemption
        plan, _ = step(s)
        assert plan.preempted_req_ids == []


def test_two_backlogged_tenants_at_their_share_preempt_nobody():
    s = sched(max_seqs=4, num_blocks=256)
    for i in range(8):
        add(s, f"a{i}", range(i * 8, i * 8 + 8), tenant="a", arrival=i * 0.01, max_tokens=16)
        add(s, f"b{i}", range(500 + i * 8, 508 + i * 8), tenant="b", arrival=i * 0.01 + 0.001, max_tokens=16)
    for _ in range(60):
        plan, _ = step(s)
        assert plan.preempted_req_ids == []
        running = [r.tenant for r in s.running]
        assert abs(running.count("a") - running.count("b")) <= 2  # the slots are shared


def test_a_request_preempted_for_a_reservation_resumes_once_the_pool_is_idle():
    """bulk grows into gold's reserved blocks while gold is absent; gold arrives and takes
    them back. bulk now needs 10 blocks and only 8 lie outside gold's reservation: once
    nothing else runs it resumes anyway (no block would come free by waiting; gold would
    take its blocks back by preemption) and finishes."""
    s = sched(num_blocks=12, max_seqs=4, reservations={"gold": Reservation(blocks=4, seqs=1)})
    bulk = add(s, "bulk", range(12), tenant="bulk", max_tokens=36)
    while len(s.kv_cache_manager.req_to_blocks.get("bulk", ())) < 10:
        step(s)
    add(s, "vip", range(700, 712), tenant="gold", max_tokens=4)
    plan, _ = step(s)
    assert plan.preempted_req_ids == ["bulk"] and [n.req_id for n in plan.scheduled_new_reqs] == ["vip"]
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        step(s)
    assert not s.has_unfinished_requests() and bulk.num_output_tokens == 36
    assert s.kv_cache_manager.num_free_blocks == 12
