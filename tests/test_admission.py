"""Admission control in numbers (cluster/replica/admission.py): the measured drain rate,
the queueing-delay bound, the projected KV bound, and Retry-After derived from the rate."""

from __future__ import annotations

import pytest

from pagedserve.cluster.replica.admission import DrainMeter, admit, retry_after
from pagedserve.scheduler.stats import SchedulerStats


def _stats(running: int, waiting: int, reason: str | None = "max_seqs") -> SchedulerStats:
    return SchedulerStats(running=running, waiting=waiting,
                          waiting_by_reason={reason: waiting} if reason and waiting else {})


def _admit(stats, rate, pending=None, tokens=16, max_waiting=None, delay=2.0):
    return admit(stats, replica_id="r", max_num_seqs=8, num_blocks=64, block_size=16,
                 pending_blocks=pending or {}, num_prompt_tokens=tokens, rate=rate,
                 max_waiting=max_waiting, max_queue_delay_s=delay)


def test_drain_meter_needs_evidence_then_measures_admissions_per_busy_second():
    m = DrainMeter(half_life_s=10.0)
    assert m.rate is None
    m.observe(0.5, 1)
    assert m.rate is None  # one admission is not a rate
    for _ in range(20):
        m.observe(0.25, 1)  # 4 per second
    assert m.rate == pytest.approx(4.0, rel=0.1)
    for _ in range(200):  # the workload changes: 1 per second; the old rate decays away
        m.observe(0.5, 0)
        m.observe(0.5, 1)
    assert m.rate == pytest.approx(1.0, rel=0.05)


def test_room_in_the_batch_is_always_admitted():
    assert _admit(_stats(running=7, waiting=0), rate=0.01) is None  # would_wait = 0


def test_no_measurement_bounds_the_queue_by_one_batch():
    assert _admit(_stats(running=8, waiting=7), rate=None) is None  # 8th to wait: admitted
    adm = _admit(_stats(running=8, waiting=8), rate=None)  # 9 > max_num_seqs=8
    assert adm.status == 429 and "no drain rate measured yet" in adm.message
    assert adm.retry_after_s == 1 and adm.shed_s is None
    assert _admit(_stats(running=8, waiting=50), rate=None, delay=None) is None  # bound off


def test_queueing_delay_bound_and_retry_after_from_the_rate():
    # 8 running (full), 7 waiting: this one would be the 8th to wait; at 4/s that is 2 s.
    assert _admit(_stats(running=8, waiting=7), rate=4.0) is None
    adm = _admit(_stats(running=8, waiting=19), rate=4.0)  # 20 / 4 = 5 s > 2 s
    assert adm.status == 429 and "would wait about 5.0 s" in adm.message
    # The excess over what 2 s drains (20 - 8 = 12) at 4/s: 3 s.
    assert adm.retry_after_s == 3
    slow = _admit(_stats(running=8, waiting=19), rate=0.5)
    assert slow.retry_after_s == 38  # (20 - 1) / 0.5: a slower drain, a longer wait


def test_a_queue_held_back_by_kv_blocks_counts_as_waiting():
    # Only 3 run (the pool is full), 5 wait for blocks: this one is the 6th to wait.
    adm = _admit(_stats(running=3, waiting=5, reason="no_blocks"), rate=2.0)
    assert adm is not None and adm.status == 429  # 6 / 2 = 3 s > 2 s


def test_projected_kv_demand_bound_with_retry_after():
    pending = {"a": 30, "b": 20, "c": 10}  # 60 of 64 blocks already promised
    assert _admit(_stats(8, 3), rate=None, pending=pending, tokens=64) is None  # 4 more: 64
    adm = _admit(_stats(8, 3), rate=2.0, pending=pending, tokens=65, delay=None)  # 5 more
    assert adm.status == 429 and "KV blocks" in adm.message
    assert adm.retry_after_s == 1  # the oldest pending prompt (30 blocks) must start: 1 / 2 s
    adm = _admit(_stats(8, 3), rate=0.25, pending=pending, tokens=65 + 16 * 30, delay=None)
    assert adm.retry_after_s == 8  # two must start first: 2 / 0.25 s


def test_count_bound():
    adm = _admit(_stats(running=8, waiting=2), rate=None, max_waiting=2)
    assert adm.status == 429 and "max_waiting_requests=2" in adm.message
    assert adm.retry_after_s == 1  # no measurement yet


def test_retry_after_bounds():
    assert retry_after(5, None) == 1
    assert retry_after(0.1, 100.0) == 1
    assert retry_after(10_000, 0.001) == 60


def test_refusals_tell_the_ingress_gate_how_long_to_shed():
    adm = _admit(_stats(running=8, waiting=19), rate=4.0)
    assert adm.shed_s == pytest.approx(3.0)  # unrounded: 12 excess at 4/s
    adm = _admit(_stats(running=8, waiting=8), rate=4.0)  # 9 / 4 = 2.25 s > 2 s
    assert adm.retry_after_s == 1 and adm.shed_s == pytest.approx(0.25)
    assert _admit(_stats(8, 2), rate=None, max_waiting=2).shed_s is None  # no rate, no gate
    # The KV bound depends on the prompt's size (a shorter one may fit): no gate.
    kv = _admit(_stats(8, 3), rate=2.0, pending={"a": 30, "b": 30}, tokens=65, delay=None)
    assert kv.status == 429 and kv.shed_s is None


def test_shed_gate_refuses_only_while_every_live_replica_sheds():
    from pagedserve.cluster.front.door import LIVE_TTL_S, MAX_CLOSED_S, MIN_REFUSALS, ShedGate

    g = ShedGate(enabled=True)
    assert g.refuse(0.0) is None  # no replica heard from: ask them
    g.refused("a", 0.25, now=1.0)
    assert g.refuse(1.01) is None  # a lone 429 (a burst that left) does not close the door
    for k in range(MIN_REFUSALS - 1):  # refusals spread wider than the window: still open
        g.refused("a", 0.25, now=2.0 + k * MAX_CLOSED_S)
    assert g.refuse(2.0 + (MIN_REFUSALS - 2) * MAX_CLOSED_S + 0.01) is None

    def refuse_a(shed_s, now):  # sustained: MIN_REFUSALS within the window
        for k in range(MIN_REFUSALS):
            g.refused("a", shed_s, now=now - 0.01 * (MIN_REFUSALS - 1 - k))

    refuse_a(0.25, now=10.0)
    msg, retry = g.refuse(10.1)
    assert "overloaded" in msg and retry == 1 and g.num_refused == 1
    assert g.refuse(10.26) is None  # a's drain time is over: a decides again
    refuse_a(30.0, now=20.0)
    assert g.closed_for(20.0) == pytest.approx(MAX_CLOSED_S)  # never longer than the cap
    g.accepted("b", now=20.1)  # another replica admits: the door stays open
    assert g.refuse(20.2) is None
    for k in range(MIN_REFUSALS):
        g.refused("b", 0.5, now=20.3)
    assert g.closed_for(20.4) == pytest.approx(0.4)  # both shed: until the first reopens
    g.accepted("a", now=20.45)
    assert g.refuse(20.5) is None
    refuse_a(0.5, now=20.6)  # b went quiet long ago by now: only a counts
    assert g.closed_for(20.3 + LIVE_TTL_S + 0.1) is None  # a's window is over too
    refuse_a(0.5, now=40.0)
    assert g.closed_for(40.1) == pytest.approx(0.4)  # b is no longer live: a alone decides
    off = ShedGate(enabled=False)  # the replicas decide alone
    for _ in range(MIN_REFUSALS):
        off.refused("a", 0.5, now=50.0)
    assert off.closed_for(50.1) is not None and off.refuse(50.1) is None


def _tenants(**per):
    """SchedulerStats with per-tenant running/waiting, e.g. bursty=(8, 30), steady=(0, 0)."""
    tenants = {t: {"running": r, "waiting": w, "tokens": 0, "counter": 0.0} for t, (r, w) in per.items()}
    return SchedulerStats(running=sum(r for r, _ in per.values()), waiting=sum(w for _, w in per.values()),
                          waiting_by_reason={"max_seqs": 1} if any(w for _, w in per.values()) else {},
                          tenants=tenants)


def test_with_two_tenants_the_delay_bound_is_each_tenants_own():
    """One tenant holds every slot and a 30-deep queue (a global bound refuses anyone: 39
    ahead at 4/s); the other tenant's request starts ahead of that backlog (the fair share),
    so it is admitted, and the flooding tenant is the one refused, at its half of the rate."""
    def ask(stats, tenant):
        return admit(stats, replica_id="r", max_num_seqs=8, num_blocks=64, block_size=16, pending_blocks={},
                     num_prompt_tokens=16, rate=4.0, max_waiting=None, max_queue_delay_s=2.0, tenant=tenant)

    alone = _tenants(bursty=(8, 30))
    assert ask(alone, "steady") is None
    adm = ask(alone, "bursty")  # the only tenant active: the replica's bound, as before...
    assert adm.status == 429 and "tenant" not in adm.message
    assert adm.shed_tenant == "bursty"  # ...but the gate sheds only bursty: another tenant gets in
    adm = ask(_tenants(bursty=(7, 30), steady=(1, 0)), "bursty")
    # Share 1/2 of 8 slots: 7 running + 30 waiting + 1 - 4 = 34 ahead, at 2/s: 17 s.
    assert adm.status == 429 and "tenant 'bursty', 50% of the replica" in adm.message
    assert "would wait about 17.0 s" in adm.message and adm.shed_tenant == "bursty"
    assert adm.retry_after_s == 15  # what 2 s at 2/s does not drain: (34 - 4) / 2


def test_a_tenant_within_its_share_waits_at_its_share_of_the_rate():
    def steady(running, waiting, rate=4.0, weights=None):
        return admit(_tenants(bursty=(8 - running, 30), steady=(running, waiting)), replica_id="r",
                     max_num_seqs=8, num_blocks=64, block_size=16, pending_blocks={}, num_prompt_tokens=16,
                     rate=rate, max_waiting=None, max_queue_delay_s=2.0, tenant="steady", weights=weights)

    assert steady(3, 0) is None  # 4th of its 4 slots: starts at once
    assert steady(4, 3) is None  # 4 ahead of it beyond its slots, at 2/s: 2 s
    assert steady(4, 4).status == 429  # 5 at 2/s: 2.5 s
    assert steady(4, 4, weights={"steady": 3.0}) is None  # 3/4 of 8 = 6 slots: 3 at 3/s
    assert steady(4, 3, rate=None) is None  # no rate yet: at most its slots' worth waits
    assert steady(4, 8, rate=None).status == 429


def test_shed_gate_closes_per_tenant_when_the_replica_refused_a_tenants_share():
    from pagedserve.cluster.front.door import MIN_REFUSALS, ShedGate

    g = ShedGate(enabled=True)
    for k in range(MIN_REFUSALS):
        g.refused("a", 0.5, now=1.0 + 0.01 * k, tenant="bursty")
    assert g.refuse(1.1, "bursty") is not None
    assert g.refuse(1.1, "steady") is None  # the others still reach the replica
    g.accepted("a", now=1.2, tenant="steady")
    assert g.refuse(1.25, "bursty") is not None  # admitting another tenant does not reopen it
    for k in range(MIN_REFUSALS):
        g.refused("a", 0.5, now=2.0 + 0.01 * k)  # the replica refuses everyone
    assert g.refuse(2.1, "steady") is not None and g.refuse(2.1, "bursty") is not None


def test_front_limit_binds_only_after_long_waits_before_the_replica_and_opens_again():
    from pagedserve.cluster.front.door import FrontLimit

    lim = FrontLimit(enabled=True)
    fair = lambda: (0, 1)  # noqa: E731  (this tenant holds nothing else; one tenant)
    flood = lambda: (10_000, 1)  # noqa: E731
    t = 0.0
    # A server that keeps up: any number in flight, short waits, never a refusal.
    for i in range(200):
        t += 0.01
        assert lim.refuse(t, in_flight=500, tenant_share=flood) is None
        lim.observe(0.2, t)
    assert lim.limit == float("inf") and lim.num_refused == 0
    # Requests wait long before the engine (median over the target) with 40 in flight: the
    # bound falls below 40.
    for i in range(200):
        t += 0.01
        lim.refuse(t, in_flight=39, tenant_share=flood)
        lim.observe(FrontLimit.TARGET_S * 3, t)
    assert lim.limit <= 0.75 * 40
    bound = lim.limit
    msg, retry = lim.refuse(t, in_flight=int(bound) + 1, tenant_share=flood)
    assert "overloaded" in msg and retry == 1
    # A tenant below its even share is still let in (the engine's shares judge it).
    assert lim.refuse(t, in_flight=int(bound) + 1, tenant_share=lambda: (0, 2)) is None
    # Short waits again while the bound binds: it grows back (by a tenth per window).
    for i in range(1000):
        t += 0.01
        lim.refuse(t, in_flight=int(lim.limit), tenant_share=fair)
        lim.observe(0.1, t)
    assert lim.limit > bound * 1.5
    off = FrontLimit(enabled=False)
    off.limit = 1
    assert off.refuse(t, in_flight=100, tenant_share=flood) is None
