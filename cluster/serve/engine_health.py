"""Is this engine replica alive? (a mixin of AsyncEngine, engine_actor.py). Serve's
health check and ``GET /health`` both ask ``check_health``: the loop is running, no step
has hung, and every TP worker answers a ping. A dead worker marks the replica dead for
good (``_die``: its requests fail at once, new ones get 503) and Serve replaces it."""

from __future__ import annotations

import asyncio
import logging
import time

from pagedserve.cluster.engine.executor import ExecutorDeadError
from pagedserve.cluster.serve.metrics import stats_snapshot

logger = logging.getLogger("pagedserve")

# A step running longer than this is hung (the longest legitimate step, a full
# max_num_batched_tokens prefill of a big model on CPU, takes seconds).
STEP_STALL_S = 120.0
WORKER_PING_TIMEOUT_S = 5.0


class EngineDeadError(RuntimeError):
    """The replica's engine cannot step any more; Serve replaces the replica."""


class EngineHealth:
    async def check_health(self) -> None:
        """Raises unless the loop is alive, no step is hung and every worker answers."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._loop_task is not None and self._loop_task.done():
            self._die("the engine loop exited")
            raise EngineDeadError(self._dead)
        started = self._step_started
        if started is not None and time.monotonic() - started > STEP_STALL_S:
            self._die(f"an engine step has been running for {time.monotonic() - started:.0f} s")
            raise EngineDeadError(self._dead)
        try:
            await asyncio.wait_for(asyncio.to_thread(self.engine.executor.check_health,
                                                     WORKER_PING_TIMEOUT_S), WORKER_PING_TIMEOUT_S + 1)
        except ExecutorDeadError as e:  # a worker is gone for good: nothing can step
            self._die(str(e))
            raise EngineDeadError(self._dead) from None
        # A slow answer (TimeoutError) only fails this check: Serve decides after a few.

    def _die(self, reason: str) -> None:
        """Fail every open request of this replica at once and stop stepping."""
        if self._dead is not None:
            return
        self._dead = reason
        logger.error("engine replica %s is dead: %s; failing %d open requests", self.replica_id,
                     reason, len(self._queues))
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(f"the engine replica failed: {reason}"))
        if self._wakeup is not None:
            self._wakeup.set()
        # Free every block, so the gauges tell the truth (nothing stays "running"). This
        # waits behind the step only if the step itself is what hangs.
        done = asyncio.wrap_future(self._thread.submit(self._abort_all))
        asyncio.get_running_loop().create_task(self._push_when_done(done))

    def _abort_all(self) -> None:
        self.engine.abort_all()
        self._pending_blocks.clear()
        self._stats = stats_snapshot(self.engine.get_stats())

    async def _push_when_done(self, done) -> None:
        try:
            await asyncio.wait_for(done, 30)
        except Exception:
            return
        self._last_push = 0.0  # the loop has stopped: this is the last snapshot it sends
        self._push_stats(force=True)
