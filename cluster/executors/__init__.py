"""The executors: how an engine loop reaches its workers.

    base.py           the contract (execute_model, submit, check_health, abandon)
    uniproc.py        one worker in the engine's own process (tensor_parallel_size 1)
    ray_executor.py   a TP group of Ray worker actors in one placement group
    zmq_dispatch.py   its per-step plan broadcast (one pickle per step, ZMQ sockets)

Imports: worker/, scheduler/ wire types, pagedserve.config, cluster.wire (failures),
cluster.ray_utils; never the engine loop (which is handed an executor class and never
imports this package), the replica, the front or the CLI.
"""

from __future__ import annotations

from pagedserve.config import EngineConfig


def executor_class_for(engine_config: EngineConfig) -> type:
    """UniProcExecutor in-process, RayExecutor for a TP group (or when asked for)."""
    if engine_config.executor_backend() == "uni":
        from pagedserve.cluster.executors.uniproc import UniProcExecutor

        return UniProcExecutor
    from pagedserve.cluster.executors.ray_executor import RayExecutor  # imports ray

    return RayExecutor
