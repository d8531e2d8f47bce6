"""The executor contract: how the engine loop reaches its workers.

The engine loop (cluster/engine/llm_engine.py) is handed an executor class and never
imports this package: ``pagedserve.cluster.executors.executor_class_for`` picks one for
a config, and the offline ``LLM`` and the engine replica pass it in.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.config import EngineConfig
from pagedserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput


class Executor:
    def __init__(self, engine_config: EngineConfig) -> None:
        # engine_config.model is a resolved local directory by now (LLMEngine resolves
        # the demo model before building the executor), or a repo id / URI that each
        # worker fetches onto its own node (worker/loading/model_fetch.py).
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
