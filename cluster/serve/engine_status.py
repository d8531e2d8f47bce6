"""The engine replica's answers to "where is my request" and "what is the pool doing"
(a mixin of AsyncEngine, engine_actor.py; every method here but ``request_info`` runs on
the engine thread, where the scheduler may be read without locks).

    add_request ─▶ _new_ids ─step─▶ request_status of each ─▶ QueueStatus into its stream
                                    (the ingress's x-pagedserve-queue header)
    GET /v1/requests/{id} ─▶ request_info ─▶ request_status + est_start_s
    each step ─▶ step-time EMA, StepTimeline; every VIEW_INTERVAL_S the block map and
                 timeline ride along in the stats push (/dashboard, live_view.py)
"""

from __future__ import annotations

import time

from pagedserve.cluster.serve.live_view import VIEW_INTERVAL_S, StepTimeline, replica_view

# Weight of the newest step in the step-time average: ~5 steps of memory, so an estimate
# follows a load change within a second and one slow step does not swing it.
_STEP_EMA = 0.2


class QueueStatus:
    """A request's status after its first step (the first item of its stream)."""

    __slots__ = ("status",)

    def __init__(self, status: dict | None) -> None:
        self.status = status


class EngineStatus:
    def _init_status(self) -> None:
        self._new_ids: list[str] = []  # added since the last step
        self._step_time_s: float | None = None
        self._timeline = StepTimeline()
        self._last_view = 0.0

    def _observe_step(self, dt: float) -> None:
        self._step_time_s = dt if self._step_time_s is None else (
            (1 - _STEP_EMA) * self._step_time_s + _STEP_EMA * dt)
        self._timeline.record(self.engine.last_plan, self.engine.scheduler)

    def _first_statuses(self) -> dict[str, dict | None]:
        """Right after a step: the status of the requests added before it (waiting, and
        why; or already running)."""
        ids, self._new_ids = self._new_ids, []
        return {rid: self._status(rid) for rid in ids}

    def _status(self, request_id: str) -> dict | None:
        st = self.engine.request_status(request_id)
        if st is not None:
            st["replica_id"] = self.replica_id
            steps = st.get("est_start_steps")
            if steps is not None and self._step_time_s is not None:
                st["est_start_s"] = round(steps * self._step_time_s, 3)
        return st

    def _with_view(self, snap: dict) -> dict:
        # Built on every step once due, until a push carries it (pushes are rate-limited,
        # so a view on a step whose stats were not sent would be lost; _push_stats resets).
        if self._stats_sink is not None and time.monotonic() - self._last_view >= VIEW_INTERVAL_S:
            snap["view"] = replica_view(self.engine, self._timeline, self._step_time_s)
        return snap

    async def request_info(self, request_id: str) -> dict | None:
        """None unless this replica holds the request."""
        return await self._call(self._status, request_id)
