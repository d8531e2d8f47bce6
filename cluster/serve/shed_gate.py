"""The ingress's memory of its replicas' recent 429s: refuse at the door while all shed.

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
within that. ``PAGEDSERVE_INGRESS_SHED=0`` turns it off (to measure without it).
"""

from __future__ import annotations

import math
import os
from collections import deque

MAX_CLOSED_S = 1.0
MIN_REFUSALS = 4  # replica 429s within MAX_CLOSED_S before the ingress sheds by itself
LIVE_TTL_S = 10.0  # a replica not heard from for this long no longer counts
ENV = "PAGEDSERVE_INGRESS_SHED"


class ShedGate:
    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = os.environ.get(ENV, "1") != "0" if enabled is None else enabled
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
