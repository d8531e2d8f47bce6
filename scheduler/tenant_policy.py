"""Who goes next and who gives way, for the Scheduler, when requests belong to tenants,
priority classes and reservations: the next waiting request to try, the running request
to preempt, the preemptions that make room for a reserved class or a tenant's slot share,
the tokens billed to each tenant, why-waiting answers and per-tenant stats. The rules:
tenancy.py; the fair share itself: fair_queue.py.

The Scheduler builds one TenantPolicy and holds it. The policy owns the tenant state
(reservations, the preemption protection, tokens per tenant, the admit rate, this step's
slot-share victim) and is given what it reads:

    at construction   the waiting queue and the KV cache manager (the Scheduler keeps
                      the same two for its lifetime)
    per call          the running list and the step id (update_from_output replaces the
                      list), and for make_room the Scheduler's preemption itself
"""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.scheduler.config import CacheConfig, SchedulerConfig
from pagedserve.scheduler.fair_queue import FairRequestQueue
from pagedserve.scheduler.kv.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.request_queue import FCFSRequestQueue, PriorityRequestQueue
from pagedserve.scheduler.tenancy import Ledger, classes_of, victim_key

# The Scheduler's preemption by recompute: (index in running, ledger) -> None. It pops
# the request from the running list it was given and puts it back in the waiting queue.
Preempt = Callable[[int, Ledger | None], None]


class TenantPolicy:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 waiting: FairRequestQueue | FCFSRequestQueue | PriorityRequestQueue,
                 kv_cache_manager: KVCacheManager) -> None:
        self.policy = scheduler_config.scheduling_policy
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.waiting = waiting
        self.kv_cache_manager = kv_cache_manager
        # "static" is the plain FCFS baseline: no reservations.
        self.reservations = scheduler_config.reservations if self.policy != "static" else {}
        self.protect_steps = scheduler_config.preemption_protect_steps
        self.tenant_tokens: dict[str, int] = {}  # cumulative scheduled tokens per tenant
        self.admit_rate = 0.0  # requests admitted per step (EMA): the basis of est. start
        self.share_victim: Request | None = None  # preempted for a tenant's slot share this step

    # ---- requests in ------------------------------------------------------------------
    def check_fits_outside_reservations(self, request: Request) -> None:
        """What admission takes must fit outside the others' reservations, or the request
        could never start: refuse it up front (a ValueError, as for a too-long prompt)."""
        if not self.reservations:
            return
        rid, n = request.req_id, request.num_prompt_tokens
        held = sum(r.blocks for k, r in self.reservations.items() if k not in classes_of(request))
        if self.cache_config.kv_allocation == "contiguous":
            first = n + request.max_tokens
        else:  # the whole prompt and its first output token: admitted, it can always finish prefill
            first = n + 1
        if -(-first // self.block_size) > self.cache_config.num_blocks - held:
            raise ValueError(
                f"request {rid!r}: admitting it takes {-(-first // self.block_size)} KV blocks, but only "
                f"{self.cache_config.num_blocks - held} of {self.cache_config.num_blocks} are not "
                f"reserved for other tenants or classes.")

    # ---- one schedule() ---------------------------------------------------------------
    def ledger(self, running: list[Request]) -> Ledger | None:
        """This step's ledger of reserved capacity in use; None without reservations."""
        if not self.reservations:
            return None
        return Ledger(self.reservations, running, self.kv_cache_manager.req_to_blocks)

    def pick_victim(self, running: list[Request], step_id: int, ledger: Ledger | None = None,
                    exclude_key: str | None = None) -> int | None:
        """Index in ``running`` of the request to preempt (tenancy.victim_key): the lowest
        priority ("priority" policy), not on reserved capacity, not just resumed, the
        cheapest to recompute. ``exclude_key``: never a member of that class, nor anyone on
        reserved capacity (preempting *for* a reservation); None if no one qualifies."""
        prio, protect = self.policy == "priority", self.protect_steps
        candidates = range(len(running))
        if exclude_key is not None:
            candidates = [j for j in candidates if exclude_key not in classes_of(running[j])
                          and not ledger.within_reservation(running[j])]
            if not candidates:
                return None
        return max(candidates, key=lambda j: victim_key(running[j], step_id, protect, prio, ledger))

    def make_room(self, running: list[Request], step_id: int, ledger: Ledger | None,
                  preempt: Preempt) -> list[Request]:
        """Preemptions before a step's scheduling: for reservations, then for slot shares.
        Returns the victims."""
        return ((self._make_room_for_reserved(running, step_id, ledger, preempt) if ledger else [])
                + self._make_room_for_fair_share(running, step_id, ledger, preempt))

    def _make_room_for_reserved(self, running: list[Request], step_id: int, ledger: Ledger,
                                preempt: Preempt) -> list[Request]:
        """Preempt other classes' requests so that a reserved class's waiting head fits
        its unused reservation (blocks and a batch slot). Returns the victims."""
        kv = self.kv_cache_manager
        preempted: list[Request] = []
        for key in ledger.reserved_keys_waiting():
            head = self.reserved_head(ledger, key)
            if head is None:
                continue
            unused = ledger.unused(key)
            need = self._blocks_to_admit(head)
            while (kv.num_free_blocks - kv.watermark_blocks < need and unused.blocks) or (
                    len(running) >= self.max_num_seqs and unused.seqs):
                j = self.pick_victim(running, step_id, ledger, exclude_key=key)
                if j is None:
                    break
                preempted.append(running[j])
                preempt(j, ledger)
        return preempted

    def _make_room_for_fair_share(self, running: list[Request], step_id: int, ledger: Ledger | None,
                                  preempt: Preempt) -> list[Request]:
        """Batch slots are part of the fair share. The fair queue orders who starts next,
        but with every slot held by one tenant's long streams, the next tenant's request
        waits for one of them to finish (a steady tenant next to a burst could wait up to
        a whole stream's length; BENCHMARKS.md, tenants scenario). So when the batch is full and
        the queue's head belongs to a tenant that, with it, still holds no more than its
        share of the slots (max_num_seqs x weight / the active tenants' weights), one
        running request of a tenant over its share is preempted (recompute) for it: the
        cheapest to recompute that is not just resumed, not on reserved capacity and, with
        the "priority" policy, not of a higher class. One per step; no flapping, since
        afterwards neither tenant is past its share."""
        self.share_victim = None
        waiting = self.waiting
        set_running = getattr(waiting, "set_running", None)
        if set_running is None or self.policy == "static":  # a static batch is never preempted
            return []
        if len(waiting.queues) < 2:  # one tenant ever seen: no share to keep, no tie to break
            return []
        counts: dict[str, int] = {}
        for r in running:
            counts[r.tenant] = counts.get(r.tenant, 0) + 1
        set_running(counts)
        if len(running) < self.max_num_seqs or not len(waiting):
            return []
        active = set(counts).union(waiting.backlogged())
        if len(active) < 2:
            return []
        weights = waiting.weights
        total = sum(weights.get(t, 1.0) for t in active)
        share = {t: self.max_num_seqs * weights.get(t, 1.0) / total for t in active}
        head = waiting.peek_request()
        if counts.get(head.tenant, 0) + 1 > share[head.tenant]:
            return []
        protect, prio = self.protect_steps, self.policy == "priority"
        candidates = [j for j, r in enumerate(running)
                      if counts[r.tenant] > share[r.tenant]
                      and not (r.resumed_step >= 0 and step_id - r.resumed_step < protect)
                      and not (ledger is not None and ledger.within_reservation(r))
                      and not (prio and r.priority < head.priority)]
        if not candidates:
            return []
        j = max(candidates, key=lambda j: victim_key(running[j], step_id, protect, prio, ledger))
        victim = self.share_victim = running[j]
        preempt(j, ledger)
        counts[victim.tenant] -= 1
        return [victim]

    def next_candidate(self, ledger: Ledger | None) -> tuple[Request, str | None]:
        """The waiting request to try next: a reserved class's head while the class has
        unused reserved capacity, else the fair queue's head. Also returns its class key."""
        if ledger is not None:
            kv = self.kv_cache_manager
            for key in ledger.reserved_keys_waiting():
                head = self.reserved_head(ledger, key)
                if head is not None and self._blocks_to_admit(head) <= kv.num_free_blocks:
                    return head, key
        return self.waiting.peek_request(), None

    def reserved_head(self, ledger: Ledger, key: str) -> Request | None:
        """The waiting head of reserved class ``key`` if its first chunk fits the class's
        unused reservation (a bigger one queues like anyone else: holding capacity for a
        request that cannot use it would only stall the others)."""
        head = self._waiting_head_of(key)
        if head is None:
            return None
        unused = ledger.unused(key)
        return head if not unused.blocks or self._blocks_to_admit(head) <= unused.blocks else None

    def _waiting_head_of(self, key: str) -> Request | None:
        if key.startswith("priority:"):
            return next((r for r in self.waiting if f"priority:{r.priority}" == key), None)
        peek = getattr(self.waiting, "peek_tenant", None)
        return peek(key) if peek is not None else None

    def _blocks_to_admit(self, req: Request) -> int:
        """Free blocks admitting ``req``'s first chunk would take (revived prefix hits too)."""
        hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(req)
        num_new = min(len(req.all_token_ids) - num_hit, self.max_num_batched_tokens)
        return (-(-(num_hit + num_new) // self.block_size) - len(hit_blocks)
                + sum(1 for b in hit_blocks if b.ref_cnt == 0))

    def charge(self, sched_reqs: list[Request], sched_nums: list[int]) -> None:
        """Bill this step's tokens (before num_computed_tokens advances) to each tenant's fair
        share: prompt tokens (or recompute) vs decode tokens."""
        charge = getattr(self.waiting, "charge", None)
        tenant_tokens = self.tenant_tokens
        for req, n in zip(sched_reqs, sched_nums):
            if charge is not None:
                num_prompt = min(max(req.num_prompt_tokens - req.num_computed_tokens, 0), n)
                charge(req.tenant, num_prompt, n - num_prompt)
            tenant_tokens[req.tenant] = tenant_tokens.get(req.tenant, 0) + n

    def note_admitted(self, num_admitted: int) -> None:
        """Requests a schedule() admitted (new or resumed): the admit rate behind est_start_steps."""
        self.admit_rate += 0.1 * (num_admitted - self.admit_rate)

    # ---- answers ----------------------------------------------------------------------
    def waiting_info(self, req: Request, head_reason: str | None) -> dict | None:
        """Scheduler.waiting_info for a request that is not running nor finished;
        ``head_reason``: why the last schedule() stopped admitting (None: the queue emptied)."""
        head_reason = head_reason or "queue_order"
        seen_tenants: set[str] = set()
        head = None
        for pos, r in enumerate(self.waiting):
            if head is None:
                head = r
            if r is req:
                if r is head:
                    reason = head_reason
                elif r.tenant in seen_tenants:
                    reason = "queue_order"
                elif self._counter(r.tenant) > self._counter(head.tenant):
                    reason = "tenant_share"
                else:
                    reason = head_reason
                rate = max(self.admit_rate, 1e-3)
                return {"reason": reason, "position": pos, "est_start_steps": round((pos + 1) / rate, 1)}
            seen_tenants.add(r.tenant)
        return None

    def _counter(self, tenant: str) -> float:
        counters = getattr(self.waiting, "counters", None)
        return counters.get(tenant, 0.0) if counters is not None else 0.0

    def stats(self, running: list[Request]) -> tuple[dict[str, dict[str, float]], int]:
        """Per tenant: running, waiting, tokens scheduled and its fair-share counter; and
        the blocks the waiting queue's requests would take (queue_kv_demand_blocks)."""
        tenants: dict[str, dict[str, float]] = {}
        for t, n in self.tenant_tokens.items():
            tenants[t] = {"running": 0, "waiting": 0, "tokens": n, "counter": self._counter(t)}
        for r in running:
            tenants.setdefault(r.tenant, {"running": 0, "waiting": 0, "tokens": 0,
                                          "counter": self._counter(r.tenant)})["running"] += 1
        demand = 0
        for r in self.waiting:
            tenants.setdefault(r.tenant, {"running": 0, "waiting": 0, "tokens": 0,
                                          "counter": self._counter(r.tenant)})["waiting"] += 1
            demand += -(-len(r.all_token_ids) // self.block_size)
        return tenants, demand
