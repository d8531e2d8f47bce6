"""UniProcExecutor: the single worker in the engine's own process (the offline LLM at
tensor_parallel_size 1, and the unit of everything the Ray executor does per rank)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pagedserve.cluster.executors.base import Executor
from pagedserve.config import EngineConfig
from pagedserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)
        from pagedserve.worker.worker import Worker

        if engine_config.tensor_parallel_size != 1:
            raise ValueError("UniProcExecutor runs tensor_parallel_size 1 only; "
                             "use pagedserve.cluster.executors.ray_executor.RayExecutor for more ranks.")
        self.worker = Worker(engine_config)
        ray = sys.modules.get("ray")  # inside a Serve replica; never imported for the offline engine
        if ray is not None and ray.is_initialized():
            self.worker.where = (f"the engine replica's worker (process {os.getpid()}) on node "
                                 f"{ray.util.get_node_ip_address()}")
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
