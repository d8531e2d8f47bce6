"""The door of the HTTP front: who may come in now, and who is inside.

The shed gate: the ingress's memory of its replicas' recent 429s: refuse at the door while all shed.

Under a 10x overload most requests are refused, and each refusal used to cost a full trip
through the replica (a Ray call, tokenization, a turn on the engine thread) before its
429 came back. On a box whose cores the engine needs, that work slowed the steps of the
admitted requests: their TTFT grew with the refused traffic. A replica's 429 says how
long its measured drain rate needs to clear the excess (``Admission.shed_s``); for that
long, as long as every replica this ingress has heard from recently is shedding, the
ingress answers the 429 itself:

    replica 429 (shed_s=0.3), the MIN_REFUSALS-th within MAX_CLOSED_S
                       ──▶ closed_until[r] = now + min(shed_s, MAX_CLOSED_S)
    request ──▶ every live replica closed?  yes ─▶ 429, Retry-After ceil(remaining) >= 1
                                             no ─▶ the replica decides, as before

The replica's own bound still decides every request that reaches it; the gate only skips
trips whose answer is already known. A 429 from a tenant's own share (admission.py, several
tenants active) closes the door to that tenant only; the others still reach the replica. Only sustained refusals close it: a lone 429 (one
burst that filled the queue, then left: aborts drain a queue faster than the measured
rate says) must not turn away the next client. It never refuses longer than
MAX_CLOSED_S after the last replica 429, so a replica that has drained is asked again
within that.

The front limit (``FrontLimit``): a bound on the requests this front holds, which binds
only while the wait it measures before the replica is past its target: the queue that forms
in the serving path itself, before any replica sees the request.

The live requests: why-waiting as the HTTP front shows it, and the live view page.

    x-pagedserve-queue: reason=no_blocks; position=3; est-start-s=0.42
        on a response whose request was still waiting after its first engine step (the
        engine replica sends that status with its admission; cluster/replica/engine_replica.py); absent
        when it started at once.
    GET /v1/requests/{id}  (the `id` of the response the client gets)
        {"id", "object": "request", "status": "admitting"|"waiting"|"running", "tenant",
         "reason", "position", "est_start_steps", "est_start_s", "num_preemptions", ...}

Reasons are the scheduler's (scheduler/tenancy.py WHY_REASONS).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from contextlib import contextmanager
from importlib import resources


MAX_CLOSED_S = 1.0
MIN_REFUSALS = 4  # replica 429s within MAX_CLOSED_S before the ingress sheds by itself
LIVE_TTL_S = 10.0  # a replica not heard from for this long no longer counts


class ShedGate:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        # keyed by (replica, tenant): tenant None when the replica refuses everyone
        self._closed_until: dict[tuple[str, str | None], float] = {}
        self._heard: dict[str, float] = {}
        self._refusals: dict[tuple[str, str | None], deque[float]] = {}  # the last MIN_REFUSALS 429 times
        self.num_refused = 0  # 429s answered here, without a replica trip

    def refused(self, replica_id: str, shed_s: float | None, now: float, tenant: str | None = None) -> None:
        """A replica's 429; ``tenant``: it refused that tenant's share only (None: everyone)."""
        self._heard[replica_id] = now
        if shed_s is None or shed_s <= 0:
            return
        key = (replica_id, tenant)
        times = self._refusals.setdefault(key, deque(maxlen=MIN_REFUSALS))
        times.append(now)
        if len(times) == MIN_REFUSALS and now - times[0] <= MAX_CLOSED_S:
            self._closed_until[key] = now + min(shed_s, MAX_CLOSED_S)

    def accepted(self, replica_id: str, now: float, tenant: str | None = None) -> None:
        self._heard[replica_id] = now
        self._closed_until.pop((replica_id, None), None)
        self._closed_until.pop((replica_id, tenant), None)

    def closed_for(self, now: float, tenant: str | None = None) -> float | None:
        """Seconds until some live replica may admit ``tenant`` again; None: ask the replicas."""
        live = [r for r, t in self._heard.items() if now - t < LIVE_TTL_S]
        if not live:
            return None
        closed = self._closed_until
        remaining = min(max(closed.get((r, None), 0.0), closed.get((r, tenant), 0.0)) - now for r in live)
        return remaining if remaining > 0 else None

    def refuse(self, now: float, tenant: str | None = None) -> tuple[str, int] | None:
        """(message, Retry-After) while every live replica sheds ``tenant``, else None."""
        wait = self.closed_for(now, tenant) if self.enabled else None
        if wait is None:
            return None
        self.num_refused += 1
        return (f"The server is overloaded: every replica refused requests within the last "
                f"{MAX_CLOSED_S:g} s and needs about {wait:.2f} s more to drain its queue. "
                f"Retry later."), max(1, math.ceil(wait))


class FrontLimit:
    """The front's own bound on the requests it has in flight, adapted to the wait it
    measures before the replica (from a request's arrival at this front to the replica's
    answer, less the time the replica says it spent: ``Admission.replica_s``): cut when that
    wait runs long, grown back while it is short (as TCP's window; Envoy's adaptive
    concurrency filter does the same with a gradient).

    Why: the replica admits on the engine's queue, but on a box whose serving path (proxy,
    ingress, the replica's loop) is short of CPU the queue forms in front of the engine, where
    the replica cannot see it: at 3x capacity the engine found a short queue and admitted
    most requests while their first token came many seconds later. What the replica spends
    (tokenization, the engine thread, a long step, its queue behind max_num_seqs) is not in
    this signal: the replica's own admission bounds that.

        every WINDOW_S:  median wait of the window > TARGET_S  ──▶  limit = 0.75 x peak in flight
                         the limit bound in the window, waits fine ──▶  limit += max(1, limit / 10)
        request ──▶ in flight >= limit and its tenant holds its share ──▶ 429, Retry-After 1

    It starts unlimited and only ever binds after a window whose waits missed the target, so
    a server that keeps up never refuses here. A tenant below its even share of the limit is
    still let in (the engine's own shares judge it), so one tenant's flood does not close the
    door to another."""

    WINDOW_S = 1.0
    # The median wait before the replica this front allows before it bounds what it holds
    # (a keeping-up server forwards in milliseconds; past it, requests queue in the serving path).
    TARGET_S = 0.5
    MIN_SAMPLES = 8
    FLOOR = 4

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.limit: float = math.inf
        self._window_start: float | None = None
        self._waits: list[float] = []
        self._peak = 0
        self.num_refused = 0

    def observe(self, wait_s: float, now: float) -> None:
        self._waits.append(wait_s)
        self._roll(now)

    def refuse(self, now: float, in_flight: int, tenant_share) -> tuple[str, int] | None:
        """(message, Retry-After) when this request would pass the limit, else None (and
        it counts toward the window's peak). ``in_flight``: the others this front holds;
        ``tenant_share()``: (this tenant's of them, tenants with any), asked only at the limit."""
        self._roll(now)
        if not self.enabled:
            return None
        self._peak = max(self._peak, in_flight)  # what the front held, refused or not
        if in_flight >= self.limit and _holds_share(self.limit, *tenant_share()):
            self.num_refused += 1
            return (f"The server is overloaded: its HTTP front has {in_flight} requests in flight, "
                    f"its limit while requests wait over {self.TARGET_S:g} s to reach a replica. "
                    f"Retry later."), 1
        self._peak = max(self._peak, in_flight + 1)
        return None

    def _roll(self, now: float) -> None:
        if self._window_start is None:
            self._window_start = now
        if now - self._window_start < self.WINDOW_S:
            return
        if len(self._waits) >= self.MIN_SAMPLES:
            t = sorted(self._waits)
            p50 = t[len(t) // 2]
            if p50 > self.TARGET_S:
                self.limit = max(self.FLOOR, 0.75 * min(self.limit, self._peak))
            elif self._peak >= self.limit:
                self.limit += max(1.0, self.limit / 10)
        elif self._peak < 0.5 * self.limit and not math.isinf(self.limit):
            self.limit += max(1.0, self.limit / 10)  # quiet: the bound opens again
        self._window_start, self._waits, self._peak = now, [], 0


def _holds_share(limit: float, tenant_in_flight: int, num_tenants: int) -> bool:
    return tenant_in_flight >= limit / max(1, num_tenants)


DASHBOARD_HTML = resources.files("pagedserve.cluster.front").joinpath("dashboard.html").read_text("utf-8")
# Ids remembered at most (a request whose stream body was never iterated is never
# released; the oldest go first, so a leak cannot grow without bound).
MAX_LIVE = 100_000


def queue_header(status: dict | None) -> str | None:
    if not status or status.get("status") != "waiting":
        return None
    parts = [f"reason={status.get('reason')}", f"position={status.get('position')}"]
    if status.get("est_start_s") is not None:
        parts.append(f"est-start-s={status['est_start_s']}")
    else:
        parts.append(f"est-start-steps={status.get('est_start_steps')}")
    return "; ".join(parts)


REPLICA_HEADER = "x-pagedserve-replica"
REQUEST_ID_HEADER = "x-pagedserve-request-id"  # Serve sets x-request-id itself
QUEUE_HEADER = "x-pagedserve-queue"


def admitted_headers(rid: str, adm) -> dict:
    """The headers of a response whose request a replica admitted (``adm``): the replica,
    the id as GET /v1/requests/{id} takes it (before a streamed body names it), and the
    why-waiting of a request that was still waiting."""
    headers = {REPLICA_HEADER: adm.replica_id, REQUEST_ID_HEADER: rid}
    queued = queue_header(adm.queue)
    if queued is not None:
        headers[QUEUE_HEADER] = queued
    return headers


def request_object(request_id: str, status: dict) -> dict:
    return {"id": request_id, "object": "request", **status}


class LiveRequests:
    """The ingress's requests in flight: id -> [tenant, replica id, holders, arrival]. A
    request is held by its handler and, when streaming, by its SSE body too; ``arrival``
    (time.monotonic) is when the front took it."""

    def __init__(self) -> None:
        self._live: OrderedDict[str, list] = OrderedDict()

    def add(self, rid: str, tenant: str | None) -> None:
        self._live[rid] = [tenant, None, 1, time.monotonic()]
        while len(self._live) > MAX_LIVE:
            self._live.popitem(last=False)

    @contextmanager
    def handled(self, rid: str, tenant: str | None):
        """``rid`` is live while a route's handler runs (a stream's body holds it on)."""
        self.add(rid, tenant)
        try:
            yield
        finally:
            self.release(rid)

    def placed(self, rid: str, replica_id: str) -> None:
        if rid in self._live:
            self._live[rid][1] = replica_id

    def hold(self, rid: str) -> None:
        if rid in self._live:
            self._live[rid][2] += 1

    def release(self, rid: str) -> None:
        entry = self._live.get(rid)
        if entry is not None:
            entry[2] -= 1
            if entry[2] <= 0:
                del self._live[rid]

    def arrival(self, rid: str) -> float | None:
        entry = self._live.get(rid)
        return None if entry is None else entry[3]

    def __len__(self) -> int:
        return len(self._live)

    def tenant_share(self, tenant: str | None) -> tuple[int, int]:
        """For a live request of ``tenant``: (the others ``tenant`` has in flight, tenants
        with any in flight)."""
        counts: dict[str | None, int] = {}
        for entry in self._live.values():
            counts[entry[0]] = counts.get(entry[0], 0) + 1
        return max(0, counts.get(tenant, 0) - 1), max(1, len(counts))

    def get(self, rid: str) -> tuple[str | None, str | None] | None:
        entry = self._live.get(rid)
        return None if entry is None else (entry[0], entry[1])
