"""The ingress's memory of its replicas' recent 429s: refuse at the door while all shed.

Under a 10x overload most requests are refused, and each refusal used to cost a full trip
through the replica (a Ray call, tokenization, a turn on the engine thread) before its
429 came back. On a box whose cores the engine needs, that work slowed the steps of the
admitted requests: their TTFT grew with the refused traffic. A replica's 429 says how
long its measured drain rate needs to clear the excess (``Admission.shed_s``); for that
long, as long as every replica this ingress has heard from recently is shedding, the
ingress answers the 429 itself:

    replica 429 (shed_s=0.3) ──▶ closed_until[r] = now + min(shed_s, MAX_CLOSED_S)
    request ──▶ every live replica closed?  yes ─▶ 429, Retry-After ceil(remaining) >= 1
                                             no ─▶ the replica decides, as before

The replica's own bound still decides every request that reaches it; the gate only skips
trips whose answer is already known. It never refuses longer than MAX_CLOSED_S after the
last replica 429, so a replica that has drained is asked again within that.
"""

from __future__ import annotations

import math

MAX_CLOSED_S = 1.0
LIVE_TTL_S = 10.0  # a replica not heard from for this long no longer counts


class ShedGate:
    def __init__(self) -> None:
        self._closed_until: dict[str, float] = {}
        self._heard: dict[str, float] = {}
        self.num_refused = 0  # 429s answered here, without a replica trip

    def refused(self, replica_id: str, shed_s: float | None, now: float) -> None:
        self._heard[replica_id] = now
        if shed_s is not None and shed_s > 0:
            self._closed_until[replica_id] = now + min(shed_s, MAX_CLOSED_S)

    def accepted(self, replica_id: str, now: float) -> None:
        self._heard[replica_id] = now
        self._closed_until.pop(replica_id, None)

    def closed_for(self, now: float) -> float | None:
        """Seconds until some live replica may admit again; None: ask the replicas."""
        live = [r for r, t in self._heard.items() if now - t < LIVE_TTL_S]
        if not live:
            return None
        remaining = min(self._closed_until.get(r, 0.0) - now for r in live)
        return remaining if remaining > 0 else None

    def refuse(self, now: float) -> tuple[str, int] | None:
        """(message, Retry-After) while every live replica sheds, else None."""
        wait = self.closed_for(now)
        if wait is None:
            return None
        self.num_refused += 1
        return (f"The server is overloaded: every replica refused requests within the last "
                f"{MAX_CLOSED_S:g} s and needs about {wait:.2f} s more to drain its queue. "
                f"Retry later."), max(1, math.ceil(wait))
