"""Is this engine replica alive? (a mixin of AsyncEngine, engine_actor.py). Serve's
health check and ``GET /health`` both ask ``check_health``: the loop is running, no step
has hung, and every TP worker answers a ping. A dead worker marks the replica dead for
good (``_die``: its requests fail at once, new ones get 503) and Serve replaces it."""

from __future__ import annotations

import asyncio
import time

from pagedserve.cluster.engine.executor import ExecutorDeadError

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
