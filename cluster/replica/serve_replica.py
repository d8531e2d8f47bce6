"""The engine replica as Serve runs it: the class behind the EngineDeployment (cluster/app.py
binds it), whose replica actor is the scheduler actor.

    Serve replica actor ── EngineReplica ── AsyncEngine (engine_replica.py): the step loop
          │                     │
          │                     └── Lifeline (cluster/wire/lifeline.py): the fronts see it die
          └── its stats pushes ──▶ StatsAggregator (the app's /metrics)

``cpu_threads`` is the replica's own call on how many CPU threads its ranks take: it reads
the cores the replica's process sees.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

from ray import serve

from pagedserve.cluster.ray_utils import bind_host, serve_grpc_on_node_ip
from pagedserve.cluster.replica.engine_replica import AsyncEngine
from pagedserve.cluster.wire.lifeline import Lifeline
from pagedserve.cluster.wire.request import EngineRequest
from pagedserve.config import EngineConfig
from pagedserve.worker.cpu_affinity import parse_bind

logger = logging.getLogger("pagedserve")


def cpu_threads(engine_config: EngineConfig) -> EngineConfig:
    """On CPU, the ranks of a deployment's only engine replica share the cores it sees,
    unless --num-threads says otherwise (with several replicas, each keeps the threads of
    its Ray CPU reservation). Ray sets OMP_NUM_THREADS=1 in a 1-CPU actor, which left the
    model on one core while the serving path used only part of the other: sharing the
    cores raised HTTP output throughput and cut TTFT at both low and high concurrency."""
    if (engine_config.num_threads is not None or engine_config.device != "cpu"
            or parse_bind(engine_config.cpu_omp_threads_bind, engine_config.tensor_parallel_size)):
        return engine_config  # a bound worker takes one thread per core of its own
    cores = len(os.sched_getaffinity(0))
    n = max(1, cores // engine_config.tensor_parallel_size)
    logger.info("CPU threads per rank: %d (%d cores, tensor_parallel_size %d; --num-threads to choose)",
                n, cores, engine_config.tensor_parallel_size)
    return dataclasses.replace(engine_config, num_threads=n)


class EngineReplica:
    """One engine replica: Serve's replica actor of the EngineDeployment (cluster/app.py)
    IS the scheduler actor. Serve calls these methods; each is AsyncEngine's."""

    def __init__(self, engine_config: EngineConfig, stats=None, all_cores: bool = False) -> None:
        serve_grpc_on_node_ip()  # before Serve starts this replica's gRPC server
        try:
            replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:
            replica_id = None
        self._stats = stats
        sink = None if stats is None else (lambda rid, snap: stats.report.remote(rid, snap))
        if all_cores:  # the only engine replica: its ranks may use the node's cores
            engine_config = cpu_threads(engine_config)
        # Several replicas: publish the prefix cache's changes for KV-aware routing.
        self.core = AsyncEngine(engine_config, stats_sink=sink, replica_id=replica_id,
                                kv_events_host=None if all_cores else bind_host())
        # The fronts' line to this process: they learn at once when it or its node dies.
        self._lifeline = Lifeline(bind_host())
        self.core.lifeline_address = self._lifeline.address
        info = self.core.info()
        logger.info("engine replica %s ready: %s", info["replica_id"], info.get("kv_sizing"))

    async def generate(self, req: EngineRequest, *, output_route):
        """The request's lifeline (AsyncEngine.generate): its Admission, then its end or
        failure; the outputs take the ingress's channel (cluster/wire/output_channel.py)."""
        async for item in self.core.generate(req, output_route=output_route):
            yield item

    async def request_info(self, request_id: str) -> dict | None:
        return await self.core.request_info(request_id)

    def info(self) -> dict:
        return self.core.info()

    def record_routing_stats(self) -> dict:
        """What Serve hands the fronts' routers as this replica's ``routing_stats``: where
        it publishes its prefix cache's changes (None with one replica)."""
        return {"kv_events": self.core.kv_events_address}

    def stats(self) -> dict:
        return self.core.stats()

    async def check_lora(self, lora_request) -> None:
        """Whether this replica can serve a LoRA adapter (ValueError naming why not)."""
        await self.core.check_lora(lora_request)

    async def tokenize(self, prompt=None, messages=None, add_special_tokens=None,
                       add_generation_prompt=True, tools=None, chat_template_kwargs=None) -> list[int]:
        return await self.core.tokenize(prompt, messages, add_special_tokens, add_generation_prompt,
                                        tools, chat_template_kwargs)

    async def token_strs(self, tokens: list[int]) -> list[str]:
        return await self.core.token_strs(tokens)

    def tokenizer_info(self) -> dict:
        return self.core.tokenizer_info()

    async def detokenize(self, tokens: list[int], skip_special_tokens: bool = False) -> str:
        return await self.core.detokenize(tokens, skip_special_tokens)

    async def check_health(self) -> None:
        """Serve's health check: the loop is alive and every TP worker answers. Raising
        here a few times in a row makes Serve replace the replica (fresh placement group)."""
        await self.core.check_health()

    async def health(self) -> None:
        """The same check, for the ingress's GET /health."""
        await self.core.check_health()

    async def __del__(self) -> None:
        # Serve calls this on graceful replica shutdown (downscaling, serve.shutdown).
        if self._stats is not None:
            # Bounded: when the whole app is deleted the aggregator may be gone already, and
            # a handle call then waits for a replica forever; Serve force-killed this one
            # after its grace period, before the engine shut its workers down.
            async def remove() -> None:
                await self._stats.remove.remote(self.core.replica_id)

            try:
                await asyncio.wait_for(remove(), timeout=0.5)
            except Exception:  # gone, or timed out: the aggregator drops stale replicas itself
                pass
        self._lifeline.close()
        self.core.shutdown()
