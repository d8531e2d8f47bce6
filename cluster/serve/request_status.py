"""Why-waiting as the HTTP front shows it, and the live view page.

    x-pagedserve-queue: reason=no_blocks; position=3; est-start-s=0.42
        on a response whose request was still waiting after its first engine step (the
        engine actor sends that status with its admission; engine_status.py); absent
        when it started at once.
    GET /v1/requests/{id}  (the `id` of the response the client gets)
        {"id", "object": "request", "status": "admitting"|"waiting"|"running", "tenant",
         "reason", "position", "est_start_steps", "est_start_s", "num_preemptions", ...}

Reasons are the scheduler's (scheduler/tenancy.py WHY_REASONS).
"""

from __future__ import annotations

from collections import OrderedDict
from importlib import resources

DASHBOARD_HTML = resources.files("pagedserve.cluster.serve").joinpath("dashboard.html").read_text("utf-8")
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


def request_object(request_id: str, status: dict) -> dict:
    return {"id": request_id, "object": "request", **status}


class LiveRequests:
    """The ingress's requests in flight: id -> [tenant, replica id, holders]. A request is
    held by its handler and, when streaming, by its SSE body too."""

    def __init__(self) -> None:
        self._live: OrderedDict[str, list] = OrderedDict()

    def add(self, rid: str, tenant: str | None) -> None:
        self._live[rid] = [tenant, None, 1]
        while len(self._live) > MAX_LIVE:
            self._live.popitem(last=False)

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

    def get(self, rid: str) -> tuple[str | None, str | None] | None:
        entry = self._live.get(rid)
        return None if entry is None else (entry[0], entry[1])
