"""Admission control of one engine replica: shed load before it becomes queueing delay.

A request that cannot start at once waits in the scheduler's queue. Left unbounded, a
3x overload turns into a queue that grows by 2x capacity every second (TTFT grew until
Serve killed the replica). Three bounds, checked on the engine thread
right before ``add_request`` (so the counts are exact, not one step stale):

    queueing delay   would_wait / drain_rate > max_queue_delay_s        (on by default)
    projected KV     blocks of the prompts not yet started + this one > the pool
    count            would_wait > max_waiting_requests                  (off by default)

``would_wait`` counts the requests that must wait for a slot to free, this one included.
``drain_rate`` is measured, not configured: requests admitted into the running batch
per second, over the steps that found a queue and left one (only then is the admission
rate the rate the queue can drain at, not the arrival rate). It decays with a half-life
of ``DRAIN_HALF_LIFE_S``, so it follows the workload. Until the queue has drained at
least ``MIN_DRAINED`` requests there is no measurement, and the delay bound is a count
instead: at most ``max_num_seqs`` requests wait (about one batch's lifetime of delay; a
burst into a cold server used to queue many seconds of work before the first measurement).

With several tenants active, the delay bound is per tenant (``admit``): a request waits for
its own tenant's queue, which drains at the tenant's fair share of the rate, so a tenant
flooding the replica is refused while one within its share is not.

A refusal is a 429 whose ``Retry-After`` is the time the measured rate needs to drain
the excess (1 s before any measurement), rounded up to whole seconds.
"""

from __future__ import annotations

import math

from pagedserve.cluster.wire.stream import Admission
from pagedserve.scheduler.fair_queue import DEFAULT_TENANT

DRAIN_HALF_LIFE_S = 3.0
MIN_DRAINED = 8.0
RETRY_AFTER_MAX_S = 60


class DrainMeter:
    """Requests admitted per second of time with a non-empty waiting queue (decayed)."""

    def __init__(self, half_life_s: float = DRAIN_HALF_LIFE_S) -> None:
        self.half_life_s = half_life_s
        self._admitted = 0.0
        self._busy_s = 0.0

    def observe(self, dt: float, num_admitted: int) -> None:
        """``dt`` seconds passed with a request waiting; ``num_admitted`` left the queue."""
        if dt <= 0 and not num_admitted:
            return
        decay = 0.5 ** (max(dt, 0.0) / self.half_life_s)
        self._admitted = self._admitted * decay + num_admitted
        self._busy_s = self._busy_s * decay + max(dt, 0.0)

    @property
    def rate(self) -> float | None:
        if self._admitted < MIN_DRAINED or self._busy_s <= 0:
            return None
        return self._admitted / self._busy_s


def retry_after(excess: float, rate: float | None) -> int:
    if not rate:
        return 1
    return int(min(RETRY_AFTER_MAX_S, max(1, math.ceil(excess / rate))))


def drain_seconds(excess: float, rate: float | None) -> float | None:
    return None if not rate else min(float(RETRY_AFTER_MAX_S), max(0.0, excess / rate))


def _refuse(replica_id: str, message: str, excess: float, rate: float | None,
            any_request: bool = True, tenant: str | None = None) -> Admission:
    """``any_request``: the bound refuses any request now, whatever its size (the count and
    delay bounds; not the KV one, which a shorter prompt may pass): only then does it tell
    the ingress's gate to shed for ``shed_s``. ``tenant``: the tenant whose queue the delay
    bound measured; the gate sheds that tenant only. Even with no other tenant active the
    refusal is that tenant's: another tenant arriving now would be admitted on its own share.
    None (the count bound): the replica refuses everyone."""
    return Admission(False, replica_id, 429, message, retry_after_s=retry_after(excess, rate),
                     shed_s=drain_seconds(excess, rate) if any_request else None, shed_tenant=tenant)


def tenant_share(stats, tenant: str, weights: dict[str, float] | None) -> float | None:
    """``tenant``'s fair share of the batch (its weight over the weights of the tenants with
    requests running or waiting, itself included), or None while it is the only one."""
    active = {t for t, s in (stats.tenants or {}).items() if s.get("running") or s.get("waiting")}
    active.add(tenant)
    if len(active) < 2:
        return None
    w = weights or {}
    return w.get(tenant, 1.0) / sum(w.get(t, 1.0) for t in active)


def admit(stats, *, replica_id: str, max_num_seqs: int, num_blocks: int, block_size: int,
          pending_blocks: dict[str, int], num_prompt_tokens: int, rate: float | None,
          max_waiting: int | None, max_queue_delay_s: float | None, tenant: str = DEFAULT_TENANT,
          weights: dict[str, float] | None = None) -> Admission | None:
    """None: admit. Else the 429 to answer. ``stats`` is the scheduler's live
    SchedulerStats; ``pending_blocks`` the prompt blocks of accepted requests that have
    produced nothing yet, oldest first.

    With several tenants active, the delay bound is the tenant's own: the scheduler's fair
    share (scheduler/fair_queue.py) starts a tenant's request ahead of another tenant's
    backlog, so what this request waits for is its own tenant's queue, draining at its
    share of the rate. A tenant flooding the replica gets the 429s; one within its share
    is admitted (a global bound refused both alike, so the tenants scenario ran with it off)."""
    # A burst that still fits the batch is not "waiting", even though it sits in the
    # scheduler's queue until the next step; a queue held back by KV blocks is.
    kv_bound = bool(stats.waiting and (stats.waiting_by_reason or {}).get("no_blocks"))
    would_wait = max(0, stats.running + stats.waiting + 1 - max_num_seqs)
    if kv_bound:
        would_wait = max(would_wait, stats.waiting + 1)
    if max_waiting is not None and would_wait > max_waiting:
        return _refuse(replica_id, f"The server is overloaded: {stats.waiting} requests are waiting "
                                   f"(max_waiting_requests={max_waiting}). Retry later.",
                       would_wait - max_waiting, rate)
    share = tenant_share(stats, tenant, weights)
    slots, whose, who = float(max_num_seqs), "", ""
    if share is not None:
        mine = (stats.tenants or {}).get(tenant, {})
        running, waiting = int(mine.get("running", 0)), int(mine.get("waiting", 0))
        slots = max_num_seqs * share
        would_wait = max(0, math.ceil(running + waiting + 1 - slots))
        if kv_bound:
            would_wait = max(would_wait, waiting + 1)
        rate = rate * share if rate else rate
        whose = f" of tenant {tenant!r}"
        who = f" (tenant {tenant!r}, {share:.0%} of the replica)"
    if max_queue_delay_s is not None and rate is None and would_wait > slots:
        return _refuse(replica_id, f"The server is overloaded: {would_wait - 1} requests{whose} are waiting "
                                   f"for the {slots:g} running ones (no drain rate measured yet){who}. "
                                   f"Retry later.", would_wait - slots, rate, tenant=tenant)
    if max_queue_delay_s is not None and would_wait and rate is not None:
        delay = would_wait / rate
        if delay > max_queue_delay_s:
            return _refuse(replica_id,
                           f"The server is overloaded: this request would wait about {delay:.1f} s "
                           f"to start ({would_wait - 1} requests{whose} ahead, draining at {rate:.1f}/s{who}; "
                           f"max_queue_delay_s={max_queue_delay_s:g}). Retry later.",
                           would_wait - rate * max_queue_delay_s, rate, tenant=tenant)
    need = -(-num_prompt_tokens // block_size)
    demand = sum(pending_blocks.values()) + need
    if pending_blocks and demand > num_blocks:
        # How many of the oldest pending prompts must start before this one fits.
        excess, to_drain = demand - num_blocks, 0
        for blocks in pending_blocks.values():
            if excess <= 0:
                break
            excess -= blocks
            to_drain += 1
        return _refuse(replica_id, f"The server is overloaded: waiting requests need {demand} KV blocks, "
                                   f"more than the {num_blocks} this replica holds. Retry later.",
                       to_drain, rate, any_request=False)
    return None
