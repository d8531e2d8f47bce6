"""The tenant-aware parts of the Scheduler (a mixin, to keep scheduler.py one screenful
of the core step): choosing the next waiting request with reservations, preempting for a
reserved class, why-waiting answers, and per-tenant stats. The rules: tenancy.py; the
fair share itself: fair_queue.py."""

from __future__ import annotations

from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.tenancy import Ledger, classes_of, victim_key

_RUNNING = RequestStatus.RUNNING


class TenantScheduling:
    def _pick_victim(self, ledger: Ledger | None = None, exclude_key: str | None = None) -> int | None:
        """Index in ``running`` of the request to preempt (tenancy.victim_key): the lowest
        priority ("priority" policy), not on reserved capacity, not just resumed, the
        cheapest to recompute. ``exclude_key``: never a member of that class, nor anyone on
        reserved capacity (preempting *for* a reservation); None if no one qualifies."""
        running = self.running
        prio, step, protect = self.policy == "priority", self.step_id, self.protect_steps
        candidates = range(len(running))
        if exclude_key is not None:
            candidates = [j for j in candidates if exclude_key not in classes_of(running[j])
                          and not ledger.within_reservation(running[j])]
            if not candidates:
                return None
        return max(candidates, key=lambda j: victim_key(running[j], step, protect, prio, ledger))

    def _charge_tenants(self, sched_reqs: list[Request], sched_nums: list[int]) -> None:
        """Bill this step's tokens (before num_computed_tokens advances) to each tenant's fair
        share: prompt tokens (or recompute) vs decode tokens."""
        charge = getattr(self.waiting, "charge", None)
        tenant_tokens = self.tenant_tokens
        for req, n in zip(sched_reqs, sched_nums):
            if charge is not None:
                num_prompt = min(max(req.num_prompt_tokens - req.num_computed_tokens, 0), n)
                charge(req.tenant, num_prompt, n - num_prompt)
            tenant_tokens[req.tenant] = tenant_tokens.get(req.tenant, 0) + n

    def _check_fits_outside_reservations(self, request: Request) -> None:
        """What admission takes must fit outside the others' reservations, or the request
        could never start: refuse it up front (a ValueError, as for a too-long prompt)."""
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

    def _next_candidate(self, ledger: Ledger | None) -> tuple[Request, str | None]:
        """The waiting request to try next: a reserved class's head while the class has
        unused reserved capacity, else the fair queue's head. Also returns its class key."""
        if ledger is not None:
            kv = self.kv_cache_manager
            for key in ledger.reserved_keys_waiting():
                head = self._reserved_head(ledger, key)
                if head is not None and self._blocks_to_admit(head) <= kv.num_free_blocks:
                    return head, key
        return self.waiting.peek_request(), None

    def _blocks_to_admit(self, req: Request) -> int:
        """Free blocks admitting ``req``'s first chunk would take (revived prefix hits too)."""
        hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(req)
        num_new = min(len(req.all_token_ids) - num_hit, self.max_num_batched_tokens)
        return (-(-(num_hit + num_new) // self.block_size) - len(hit_blocks)
                + sum(1 for b in hit_blocks if b.ref_cnt == 0))

    def _reserved_head(self, ledger: Ledger, key: str) -> Request | None:
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

    def _make_room_for_reserved(self, ledger: Ledger) -> list[Request]:
        """Preempt other classes' requests so that a reserved class's waiting head fits
        its unused reservation (blocks and a batch slot). Returns the victims."""
        kv = self.kv_cache_manager
        preempted: list[Request] = []
        for key in ledger.reserved_keys_waiting():
            head = self._reserved_head(ledger, key)
            if head is None:
                continue
            unused = ledger.unused(key)
            need = self._blocks_to_admit(head)
            while (kv.num_free_blocks - kv.watermark_blocks < need and unused.blocks) or (
                    len(self.running) >= self.max_num_seqs and unused.seqs):
                j = self._pick_victim(ledger, exclude_key=key)
                if j is None:
                    break
                preempted.append(self.running[j])
                self._preempt(j, ledger)
        return preempted

    def _make_room(self, ledger: Ledger | None) -> list[Request]:
        """Preemptions before a step's scheduling: for reservations, then for slot shares."""
        return (self._make_room_for_reserved(ledger) if ledger else []) + self._make_room_for_fair_share(ledger)

    def _make_room_for_fair_share(self, ledger: Ledger | None) -> list[Request]:
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
        self._share_victim = None
        waiting = self.waiting
        set_running = getattr(waiting, "set_running", None)
        if set_running is None or self.policy == "static":  # a static batch is never preempted
            return []
        if len(waiting.queues) < 2:  # one tenant ever seen: no share to keep, no tie to break
            return []
        counts: dict[str, int] = {}
        for r in self.running:
            counts[r.tenant] = counts.get(r.tenant, 0) + 1
        set_running(counts)
        if len(self.running) < self.max_num_seqs or not len(waiting):
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
        step, protect, prio = self.step_id, self.protect_steps, self.policy == "priority"
        candidates = [j for j, r in enumerate(self.running)
                      if counts[r.tenant] > share[r.tenant]
                      and not (r.resumed_step >= 0 and step - r.resumed_step < protect)
                      and not (ledger is not None and ledger.within_reservation(r))
                      and not (prio and r.priority < head.priority)]
        if not candidates:
            return []
        j = max(candidates, key=lambda j: victim_key(self.running[j], step, protect, prio, ledger))
        victim = self._share_victim = self.running[j]
        self._preempt(j, ledger)
        counts[victim.tenant] -= 1
        return [victim]

    def waiting_info(self, req_id: str) -> dict | None:
        """Why ``req_id`` waits, as of the last schedule(), and when it should start:
        ``{"reason", "position", "est_start_steps"}`` (tenancy.WHY_REASONS), or None if it
        is not waiting. The head of the line carries the reason admission stopped; a
        request behind another of its tenant waits for "queue_order"; the head of a tenant
        that already got more than its share waits for "tenant_share"."""
        req = self.requests.get(req_id)
        if req is None or req.status in (_RUNNING,) or RequestStatus.is_finished(req.status):
            return None
        head_reason = self._waiting_reason or "queue_order"
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

    def _tenant_stats(self) -> tuple[dict[str, dict[str, float]], int]:
        tenants: dict[str, dict[str, float]] = {}
        for t, n in self.tenant_tokens.items():
            tenants[t] = {"running": 0, "waiting": 0, "tokens": n, "counter": self._counter(t)}
        for r in self.running:
            tenants.setdefault(r.tenant, {"running": 0, "waiting": 0, "tokens": 0,
                                          "counter": self._counter(r.tenant)})["running"] += 1
        demand = 0
        for r in self.waiting:
            tenants.setdefault(r.tenant, {"running": 0, "waiting": 0, "tokens": 0,
                                          "counter": self._counter(r.tenant)})["waiting"] += 1
            demand += -(-len(r.all_token_ids) // self.block_size)
        return tenants, demand
