"""How the front picks an engine replica: Serve's power-of-two-choices router, minus the
replicas this front has seen die (lost_replicas.py).

    Serve's controller: the replica list ─▶ LiveReplicaRouter.update_replicas ─▶ minus lost
    lost_replicas.mark_lost(id)          ─▶ LiveReplicaRouter.drop_lost (at once)

Serve's router learns that a replica is gone from the controller, which learns it from
the GCS, which on a lost node waits for several missed raylet health checks in a row.
Until then new requests would be routed to the dead replica and wait there.

With more than one replica the default is KVPrefixRouter: Serve's replica list minus the
lost, ranked by kv_routing.py's cost model (predicted time to first token) on each
replica's prefix cache and load as its KV events describe them (cluster/wire/kv_events.py). ``--request-router`` picks it ("kv"), Ray Serve
LLM's PrefixCacheAffinityRouter ("prefix", the peer: a prefix tree of prompt text built
from its own routing history), or Serve's default ("pow2").

The router runs in the process that holds the engine handle (the ingress replica), on
Serve's router event loop. Serve pickles this module by value into that process, so what
others must see (lost replicas, the decision counts of /metrics) lives in modules
imported by reference: lost_replicas.py, route_counts.py.
"""

from __future__ import annotations

import time
from collections import Counter

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.request_router import LocalityMixin, MultiplexMixin, RequestRouter

from pagedserve.cluster.front.router import lost_replicas, route_counts
from pagedserve.cluster.front.router.kv_routing import (BY_LOAD, KVRoutingPolicy, ReplicaLoad, decision_record,
                                                         matched_blocks, rank, replica_load, trace, tracing)

SENT_TTL_S = 5.0  # a finished request's blocks count as there until its replica's events say so
MAX_SENT_BLOCKS = 100_000  # per replica: bounds what a flood of distinct prompts leaves here
MAX_IN_FLIGHT = 10_000  # requests marked and not completed (one cancelled before dispatch never is)
MAX_SCORED = 10_000  # scored requests not yet routed (a cancelled one never is)
POLL_INTERVAL_S = 0.002  # a replica's event socket is read at most this often (its steps take longer)
SCORED_TTL_S = 2.0  # a scored request counts as on its way to its first choice this long at most
ROUTERS = {  # --request-router: the class Serve loads for the engine deployment
    "kv": "pagedserve.cluster.front.router.routing.KVPrefixRouter",
    "prefix": "pagedserve.cluster.front.router.text_prefix_router.TextPrefixRouter",
    "pow2": "pagedserve.cluster.front.router.routing.LiveReplicaRouter",
}


class _SkipsLostReplicas:
    """Serve's replica list minus the replicas this front saw die (lost_replicas.py)."""

    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        lost_replicas.register(self)

    def update_replicas(self, replicas) -> None:
        now = time.monotonic()
        super().update_replicas([r for r in replicas if not lost_replicas.is_lost(r.replica_id.unique_id, now)])

    async def _choose_replica_for_request(self, pending_request, *, is_retry: bool = False):
        # Serve's hook that resolves a request to its replica. Where each engine request
        # goes is recorded first, so the front knows which admissions a lost replica takes
        # with it (failover.admission); then a replica marked lost is never the answer,
        # even when the drop that mark_lost queued on this loop has not run yet: it is
        # dropped now and the request routed again (as Serve does a rejected one).
        req = _generate_request(pending_request)
        while True:
            replica = await super()._choose_replica_for_request(pending_request, is_retry=is_retry)
            uid = replica.replica_id.unique_id
            if req is not None:
                lost_replicas.routed(req.request_id, uid)
            if not lost_replicas.is_lost(uid):
                return replica
            self.drop_lost()
            is_retry = True

    def drop_lost(self) -> None:
        now = time.monotonic()
        for replica_id in list(self.curr_replicas):
            if lost_replicas.is_lost(replica_id.unique_id, now):
                self.on_replica_actor_died(replica_id)


class LiveReplicaRouter(_SkipsLostReplicas, PowerOfTwoChoicesRequestRouter):
    """Serve's default router (power of two choices) over the replicas not marked lost."""


def _bounded(table: dict, limit: int, expired_before: float) -> dict:
    """``table`` (key -> a time) at most ``limit`` long: entries older than ``expired_before``
    go first, then all of them (a flood of distinct prompts must not grow it for good)."""
    if len(table) > limit:
        for k in [k for k, t in table.items() if t < expired_before]:
            del table[k]
        if len(table) > limit:
            table.clear()
    return table


class _SentBlocks:
    """The blocks of prompts sent to each replica that its events may not report yet. They
    count as there while their request is in flight (queued behind others, it may wait
    seconds before its prefill stores them), then for SENT_TTL_S more (the event is on its
    way). A burst or a queue of one new prefix then follows its first request instead of
    being prefilled on every replica."""

    def __init__(self) -> None:
        self._pending: dict[str, Counter] = {}  # replica unique id -> block hash -> requests in flight
        self._grace: dict[str, dict[int, float]] = {}  # replica unique id -> block hash -> until when
        self._requests: dict[str, tuple[str, list[int]]] = {}  # request id -> (replica, its blocks)

    def view(self, uid: str, now: float):
        """``has(block hash)`` for one replica, as of ``now``."""
        pending, grace = self._pending.get(uid) or {}, self._grace.get(uid) or {}
        return lambda h: pending.get(h, 0) > 0 or grace.get(h, 0.0) >= now

    def send(self, request_id: str, uid: str, hashes: list[int]) -> None:
        """The request's blocks go to ``uid`` (from wherever they were marked before)."""
        old = self._requests.pop(request_id, None)
        if old is not None:
            self._drop(*old)
        if len(self._requests) >= MAX_IN_FLIGHT:  # the oldest first: insertion order
            for rid in list(self._requests)[: MAX_IN_FLIGHT // 2]:
                self._drop(*self._requests.pop(rid))
        self._requests[request_id] = (uid, hashes)
        self._pending.setdefault(uid, Counter()).update(hashes)

    def done(self, request_id: str, now: float) -> None:
        rec = self._requests.pop(request_id, None)
        if rec is None:
            return
        uid, hashes = rec
        self._drop(uid, hashes)
        grace = _bounded(self._grace.setdefault(uid, {}), MAX_SENT_BLOCKS, now)
        until = now + SENT_TTL_S
        for h in hashes:
            grace[h] = until

    def forget(self, uid: str) -> None:
        self._pending.pop(uid, None)
        self._grace.pop(uid, None)

    def replicas(self) -> set[str]:
        return set(self._pending) | set(self._grace)

    def _drop(self, uid: str, hashes: list[int]) -> None:
        pending = self._pending.get(uid)
        if pending is None:
            return
        for h in hashes:
            left = pending.get(h, 0) - 1
            if left > 0:
                pending[h] = left
            else:
                pending.pop(h, None)


class _InFlight:
    """This front's requests in flight on each replica (routed, not completed), each with
    its fresh prompt tokens (the part its replica did not hold when it was routed) and its
    LoRA adapter. The cost model's in-flight count, the weight of the requests a replica's
    stats do not show yet, and the adapters on their way there (kv_routing.py). Not
    Serve's count (``_replica_queue_len_cache``): its entries expire unread after
    RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S unless a probe renews them, and this router
    does not probe, so a replica busy with long requests read as idle."""

    def __init__(self) -> None:
        self._by_replica: dict[str, dict[str, int]] = {}  # replica unique id -> request id -> fresh tokens
        self._replica_of: dict[str, str] = {}  # request id -> replica unique id
        self._adapters: dict[str, Counter] = {}  # replica unique id -> lora_int_id -> requests in flight
        self._adapter_of: dict[str, int] = {}  # request id -> its lora_int_id (those with one)

    def add(self, request_id: str, uid: str, fresh: int, adapter: int | None = None) -> None:
        self.remove(request_id)
        if len(self._replica_of) >= MAX_IN_FLIGHT:  # one cancelled before dispatch never completes
            for rid in list(self._replica_of)[: MAX_IN_FLIGHT // 2]:
                self.remove(rid)
        self._replica_of[request_id] = uid
        self._by_replica.setdefault(uid, {})[request_id] = fresh
        if adapter is not None:
            self._adapter_of[request_id] = adapter
            self._adapters.setdefault(uid, Counter())[adapter] += 1

    def remove(self, request_id: str) -> None:
        uid = self._replica_of.pop(request_id, None)
        if uid is not None:
            self._by_replica.get(uid, {}).pop(request_id, None)
        adapter = self._adapter_of.pop(request_id, None)
        if uid is not None and adapter is not None:
            counts = self._adapters.get(uid)
            if counts is not None:
                counts[adapter] -= 1
                if counts[adapter] <= 0:
                    del counts[adapter]

    def fresh(self, uid: str) -> tuple[int, ...]:
        """The fresh tokens of its requests in flight, newest first (their number: the count)."""
        return tuple(reversed((self._by_replica.get(uid) or {}).values()))

    def has_adapter(self, uid: str, adapter: int) -> bool:
        """A request with this adapter is in flight there (it is loaded, or being loaded)."""
        return (self._adapters.get(uid) or {}).get(adapter, 0) > 0

    def forget(self, uid: str) -> None:
        for rid in self._by_replica.pop(uid, {}):
            self._replica_of.pop(rid, None)
            self._adapter_of.pop(rid, None)
        self._adapters.pop(uid, None)

    def replicas(self) -> set[str]:
        return set(self._by_replica)


def _generate_request(pending_request):
    """The EngineRequest (cluster/wire/request.py) of an engine ``generate`` call, else None."""
    if pending_request is None or pending_request.metadata.call_method != "generate" or not pending_request.args:
        return None
    return pending_request.args[0]


class KVPrefixRouter(_SkipsLostReplicas, LocalityMixin, MultiplexMixin, RequestRouter):
    """The replica with the lowest predicted time to first token: its queued prefill, the
    part of this prompt it does not hold, its decode load (kv_routing.py). A request
    without token ids (the front's tokenizer not loaded yet, a call that is not
    ``generate``) and a replica list with no views yet take Serve's power of two choices. Not FIFO as Serve's default is: there the replica a routing
    task found goes to the oldest pending request, which in a burst hands one prompt's
    holder to another prompt; here it goes to the request it was scored for (as in Ray
    Serve LLM's router, whose mixins these are)."""

    def initialize_state(self, block_size: int = 16, isolate_tenants: bool = True, **kwargs) -> None:
        # request_router_kwargs: the replicas' block size and isolation, and any of the
        # policy's fields (kv_routing.KVRoutingPolicy: miss_weight, stale_s, tie_rel, ...)
        tuning = {k: kwargs.pop(k) for k in ("miss_weight", "stale_s", "tie_rel", "default_prefill_tok_s",
                                             "default_decode_step_s", "default_lora_load_s") if k in kwargs}
        super().initialize_state(**kwargs)
        self._policy = KVRoutingPolicy(block_size, isolate_tenants, **tuning)
        self._subs: dict = {}  # replica unique id -> KVEventSubscriber
        self._sent = _SentBlocks()  # blocks on their way to each replica
        # internal request id -> (first choice, decision, matched, when, prompt len, adapter)
        self._scored: dict[str, tuple] = {}
        self._in_flight = _InFlight()

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for uid in [u for u in self._subs if u not in live]:
            self._subs.pop(uid).close()  # gone: a replica that comes back has a new id, an empty view
        for uid in self._sent.replicas() - live:
            self._sent.forget(uid)
        for uid in self._in_flight.replicas() - live:
            self._in_flight.forget(uid)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        sub = self._subs.pop(replica_id.unique_id, None)
        if sub is not None:
            sub.close()
        self._sent.forget(replica_id.unique_id)
        self._in_flight.forget(replica_id.unique_id)

    def _subscriber(self, replica):
        """This replica's view, subscribed on first use (its address comes in its
        routing_stats, which Serve refreshes every request_routing_stats_period_s)."""
        uid = replica.replica_id.unique_id
        sub = self._subs.get(uid)
        if sub is None:
            address = (replica.routing_stats or {}).get("kv_events")
            if not address:
                return None
            from pagedserve.cluster.wire.kv_events import KVEventSubscriber

            sub = self._subs[uid] = KVEventSubscriber(address)
        sub.poll(POLL_INTERVAL_S)
        return sub

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        req = _generate_request(pending_request)
        ids = getattr(req, "token_ids", None)
        if not ids or not candidate_replicas:
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        hashes = self._policy.block_hashes(ids, req.cache_salt, req.tenant, req.lora_request)
        adapter = req.lora_request.lora_int_id if req.lora_request is not None else None
        loads, seen, now = {}, False, time.monotonic()
        me = pending_request.metadata.internal_request_id  # scored before, when this is a retry
        # The requests scored and not routed yet (a burst is scored before any of it is
        # routed), newest first, ahead of those in flight; the replicas their adapter goes to.
        on_way: dict[str, list[int]] = {}
        adapter_on_way: set[str] = set()
        for rid, (first, _, matched, when, n, lora) in reversed(self._scored.items()):
            if when > now - SCORED_TTL_S and rid != me:
                on_way.setdefault(first, []).append(max(0, n - matched.get(first, 0) * self._policy.block_size))
                if lora is not None and lora == adapter:
                    adapter_on_way.add(first)
        for r in candidate_replicas:
            uid = r.replica_id.unique_id
            sub = self._subscriber(r)
            seen |= sub is not None
            fresh = (*on_way.get(uid, ()), *self._in_flight.fresh(uid))
            coming = adapter is not None and (uid in adapter_on_way or self._in_flight.has_adapter(uid, adapter))
            if sub is None:
                loads[r] = ReplicaLoad(0, len(fresh), fresh_in_flight=fresh, has_adapter=adapter is None or coming)
                continue
            held = sub.view.hashes  # leading blocks cached there, or on their way (sent)
            matched = matched_blocks(hashes, held, self._sent.view(uid, now))
            age = None if sub.heard_at is None else now - sub.heard_at
            loads[r] = replica_load(matched, len(fresh), len(held), sub.stats, age, fresh, adapter, coming)
        if not seen:
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        order, by = rank(self._policy, len(ids), loads)
        first = order[0].replica_id.unique_id
        if tracing():  # PAGEDSERVE_ROUTER_TRACE: what a workload that routes badly is read from
            trace({"request": me, **decision_record(self._policy, len(ids), loads, order, by,
                                                    lambda r: r.replica_id.unique_id)})
        # Counted once the request is routed (this may run again on a backoff), for the
        # replica it took: the first choice, or a later one when that was full.
        if len(self._scored) > MAX_SCORED:
            self._scored.clear()
        self._scored[pending_request.metadata.internal_request_id] = (
            first, by, {r.replica_id.unique_id: x.matched_blocks for r, x in loads.items()}, now, len(ids), adapter)
        # Its blocks count as sent to the first choice now, not once Serve has routed it:
        # the other requests of a burst are scored before that, and would otherwise send
        # the same new prefix to both replicas. A request that lands elsewhere corrects it.
        self._sent.send(pending_request.metadata.internal_request_id, first, hashes)
        return [[r] for r in order]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        req = _generate_request(pending_request)
        ids = getattr(req, "token_ids", None)
        if not ids:
            return
        rid = pending_request.metadata.internal_request_id
        scored = self._scored.pop(rid, None)
        bs = self._policy.block_size
        held = 0 if scored is None else scored[2].get(replica_id.unique_id, 0) * bs
        adapter = req.lora_request.lora_int_id if req.lora_request is not None else None
        self._in_flight.add(rid, replica_id.unique_id, max(0, len(ids) - held), adapter)
        if tracing():
            trace({"routed": rid, "to": replica_id.unique_id, "first": scored and scored[0],
                   "fresh": max(0, len(ids) - held)})
        if scored is not None:
            first, by, matched = scored[:3]
            route_counts.count(by if replica_id.unique_id == first else BY_LOAD, held, len(ids))
            if replica_id.unique_id == first:
                return  # marked as sent there when it was scored
        self._sent.send(pending_request.metadata.internal_request_id, replica_id.unique_id,
                        self._policy.block_hashes(ids, req.cache_salt, req.tenant, req.lora_request))

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self._sent.done(internal_request_id, time.monotonic())
        self._in_flight.remove(internal_request_id)

