"""Executors: how the engine reaches its workers.

``UniProcExecutor`` runs the single worker in the engine's own process (offline LLM at
tensor_parallel_size 1, and the unit of everything the Ray executor does per rank).
``pagedserve.cluster.control.ray_executor.RayExecutor`` drives a tensor-parallel group of worker actors.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pagedserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.worker.config import EngineConfig


class ExecutorDeadError(RuntimeError):
    """A worker is gone for good (its process died): no step can run any more."""


class Executor:
    def __init__(self, engine_config: EngineConfig) -> None:
        # engine_config.model is a resolved local directory by now (LLMEngine resolves
        # the demo model before building the executor).
        self.engine_config = engine_config

    def check_health(self, timeout_s: float) -> None:
        """Return if every worker answers within ``timeout_s``; ExecutorDeadError if one
        is dead, TimeoutError if one is only slow. Called from a thread other than the
        one stepping, while a step may run: it must not touch the step's channels."""

    def abandon(self) -> None:
        """Release the workers of a dead engine without waiting for them (they may be
        stuck in a collective with a dead peer). Default: an ordinary shutdown."""
        self.shutdown()

    def determine_num_available_blocks(self) -> int:
        raise NotImplementedError

    def initialize_cache(self, num_blocks: int) -> None:
        raise NotImplementedError

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def submit(self, plan: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Start a step; the returned callable waits for its result. Steps run in the
        order submitted, and results are waited for in that order (async scheduling keeps
        at most one step queued behind the running one). Default: run it now."""
        result = self.execute_model(plan)
        return lambda: result

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)
        from pagedserve.worker.worker import Worker

        if engine_config.tensor_parallel_size != 1:
            raise ValueError("UniProcExecutor runs tensor_parallel_size 1 only; "
                             "use pagedserve.cluster.control.ray_executor.RayExecutor for more ranks.")
        self.worker = Worker(engine_config)
        self._step_thread: ThreadPoolExecutor | None = None
        self.worker.init_device()
        self.worker.load_model()

    def determine_num_available_blocks(self) -> int:
        return self.worker.determine_num_available_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(plan)

    def submit(self, plan: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        # One thread runs the steps, in order; the engine plans and processes outputs
        # while it does (torch releases the GIL inside its ops).
        if self._step_thread is None:
            self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-step")
        return self._step_thread.submit(self.worker.execute_model, plan).result

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
        self.worker.shutdown()


def default_executor_class(engine_config: EngineConfig) -> type[Executor]:
    if engine_config.executor_backend() == "uni":
        return UniProcExecutor
    from pagedserve.cluster.control.ray_executor import RayExecutor  # imports ray

    return RayExecutor
