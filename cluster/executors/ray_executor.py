"""RayExecutor: a tensor-parallel group of worker actors, one plan broadcast per step.

    scheduler actor (engine replica)                  placement group, one bundle per rank
      plan ──▶ broadcast channel ──▶ RayWorkerWrapper rank 0 ──┐  gloo (CPU) / NCCL (GPU)
                             └────▶ RayWorkerWrapper rank 1 ──┘  all-reduce
      result ◀── rank 0 only (the other ranks return nothing)

Not a Ray method call per worker per step (each costs more than a whole broadcast). Two channels,
chosen by ``PAGEDSERVE_DISPATCH``:

- ``zmq`` (default): one pickle per step written to a PUSH socket per rank, rank 0's
  result read from one PULL socket (cluster/executors/zmq_dispatch.py; Unix sockets when all ranks
  share the node). Cheaper per step than the compiled graph: loadtest/bench_dispatch.py
  measures both (BENCHMARKS.md, Dispatch).
- ``cgraph``: a Ray Compiled Graph (``InputNode`` -> each rank -> ``MultiOutputNode``),
  shared-memory channels allocated once.

The data plane (activations) never goes through Ray: torch.distributed carries it.
``loadtest/bench_dispatch.py`` measures both channels.

Not done: overlapping the scheduling of step N+1 with the execution of step N. The
``Executor.execute_model`` contract is synchronous; both channels could return before
the workers finish (send now, receive later), so the overlap would live in the engine
loop, which must then not schedule tokens it has not sampled yet.
"""

from __future__ import annotations

import logging
import os
import time

import ray
from ray.dag import InputNode, MultiOutputNode

from pagedserve.cluster.executors.base import Executor
from pagedserve.cluster.wire.failures import ExecutorDeadError
from pagedserve.cluster.ray_utils import (LOOPBACK, get_open_port, in_bundle, init_ray, node_ip, node_of_each,
                                          worker_placement)
from pagedserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.config import FAULT_INJECTION_ENV, EngineConfig

logger = logging.getLogger(__name__)


class RayWorkerWrapper:
    """Actor body around one ``pagedserve.worker.worker.Worker`` (which knows nothing of Ray)."""

    def __init__(self, engine_config: EngineConfig, rank: int, world_size: int,
                 distributed_init_method: str | None = None) -> None:
        from pagedserve.worker.worker import Worker  # torch is imported in the actor only

        self.rank = rank
        self.worker = Worker(engine_config, rank=rank, world_size=world_size,
                             distributed_init_method=distributed_init_method)
        # Seconds spent inside Worker.execute_model per step (the benchmark subtracts it
        # from the round trip to get the pure dispatch overhead).
        self.exec_times: list[float] = []

    def rendezvous(self, across_nodes: bool) -> str:
        """Rank 0: the torch.distributed address, on this node: its cluster address when
        some rank sits on another node, loopback otherwise (issue 10's bind policy)."""
        host = node_ip() if across_nodes else LOOPBACK
        return f"tcp://{host}:{get_open_port(host)}"

    def init_device(self, distributed_init_method: str | None = None) -> None:
        if distributed_init_method is not None:
            self.worker.distributed_init_method = distributed_init_method
        self.worker.init_device()

    def load_model(self) -> None:
        self.worker.load_model()

    def determine_num_available_blocks(self) -> int:
        return self.worker.determine_num_available_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput | None:
        t0 = time.perf_counter()
        out = self.worker.execute_model(plan)
        self.exec_times.append(time.perf_counter() - t0)
        if len(self.exec_times) > 100_000:  # bounded: a long-lived server steps forever
            del self.exec_times[:50_000]
        return out

    def pop_exec_times(self) -> list[float]:
        times, self.exec_times = self.exec_times, []
        return times

    def ping(self) -> int:
        """Liveness: answered by the control thread, even while a step runs."""
        return self.rank

    def run_zmq_loop(self, plan_addr: str, result_addr: str) -> int:
        """The ZMQ dispatch loop; occupies one actor thread until the STOP message."""
        from pagedserve.cluster.executors.zmq_dispatch import worker_loop

        return worker_loop(self.execute_model, self.rank, plan_addr, result_addr)

    def shutdown(self) -> None:
        self.worker.shutdown()


# A CPU worker's malloc backs its large chunks with transparent huge pages (THP is
# "madvise" on most distributions; the KV pool asks for them itself, worker/cpu_memory.py,
# this covers the weights and step buffers): faster decode steps, mostly in the GEMMs,
# seen before the KV pool asked.
# PAGEDSERVE_WORKER_THP=0 leaves the environment alone.
WORKER_GLIBC_TUNABLES = "glibc.malloc.hugetlb=1"


class RayExecutor(Executor):
    # "zmq" (default) or "cgraph"; see loadtest/bench_dispatch.py for both measured.
    dispatch = os.environ.get("PAGEDSERVE_DISPATCH", "zmq")

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)
        if self.dispatch not in ("zmq", "cgraph"):
            raise ValueError(f"PAGEDSERVE_DISPATCH must be 'zmq' or 'cgraph', got {self.dispatch!r}.")
        init_ray()  # no-op inside a Serve replica or an already-started driver
        tp = engine_config.tensor_parallel_size
        use_gpu = engine_config.resolve_device() == "cuda"
        self.placement_group, bundle_ids, self._owns_pg = worker_placement(tp, use_gpu)
        actor_cls = ray.remote(RayWorkerWrapper)
        self.workers = []
        for rank, bundle in enumerate(bundle_ids):
            # max_concurrency 2: the ZMQ loop holds one thread, control calls use the other.
            opts = dict(num_cpus=1, num_gpus=1 if use_gpu else 0, max_concurrency=2,
                        scheduling_strategy=in_bundle(self.placement_group, bundle))
            env = {}
            if not use_gpu and os.environ.get("PAGEDSERVE_WORKER_THP", "1") != "0":
                mine = os.environ.get("GLIBC_TUNABLES")
                env["GLIBC_TUNABLES"] = f"{mine}:{WORKER_GLIBC_TUNABLES}" if mine else WORKER_GLIBC_TUNABLES
            if os.environ.get(FAULT_INJECTION_ENV) == "1":  # a driver's test hooks reach its workers
                env[FAULT_INJECTION_ENV] = "1"
            if env:
                opts["runtime_env"] = {"env_vars": env}
            self.workers.append(actor_cls.options(**opts).remote(engine_config, rank, tp))
        self._nodes = node_of_each(self.workers)
        # Rendezvous on rank 0's node (a STRICT_PACK group: all on one node, loopback).
        init_method = ray.get(self.workers[0].rendezvous.remote(len(set(self._nodes)) > 1)) if tp > 1 else None
        # All ranks must enter the rendezvous together: submit to all, then wait.
        ray.get([w.init_device.remote(init_method) for w in self.workers])
        ray.get([w.load_model.remote() for w in self.workers])
        self._dag = None
        self._bcast = None
        self._loops: list = []
        self._broken = False  # a worker died: shut down by killing, not by asking
        logger.info("RayExecutor: %d worker actors ready (%s, init %s)", tp,
                    "GPU" if use_gpu else "CPU", init_method)

    def determine_num_available_blocks(self) -> int:
        # Every rank must hold the same block ids, so the smallest rank decides.
        return min(ray.get([w.determine_num_available_blocks.remote() for w in self.workers]))

    def initialize_cache(self, num_blocks: int) -> None:
        ray.get([w.initialize_cache.remote(num_blocks) for w in self.workers])

    def _compile(self) -> None:
        # Compiled after the cache exists: the graph's actor loops are long-lived, and
        # everything before this point uses ordinary actor calls.
        with InputNode() as plan:
            dag = MultiOutputNode([w.execute_model.bind(plan) for w in self.workers])
        self._dag = dag.experimental_compile(_max_inflight_executions=2)

    def _start_zmq(self) -> None:
        from pagedserve.cluster.executors.zmq_dispatch import ZmqBroadcast

        here = ray.get_runtime_context().get_node_id()
        local = all(n == here for n in self._nodes)
        self._bcast = ZmqBroadcast(node_ip(), len(self.workers), local=local)
        self._loops = [w.run_zmq_loop.remote(*self._bcast.addresses(rank))
                       for rank, w in enumerate(self.workers)]

    def _check_loops(self) -> None:
        done, _ = ray.wait(self._loops, num_returns=len(self._loops), timeout=0)
        if done:
            self._broken = True
            try:
                ray.get(done)  # re-raises the actor's error
            except ray.exceptions.RayActorError as e:
                raise ExecutorDeadError(f"a worker actor died: {e}") from None
            raise ExecutorDeadError("a worker's dispatch loop exited")

    def check_health(self, timeout_s: float) -> None:
        try:
            ray.get([w.ping.remote() for w in self.workers], timeout=timeout_s)
        except ray.exceptions.RayActorError as e:
            self._broken = True
            raise ExecutorDeadError(f"a worker actor died: {e}") from None
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"a worker did not answer a ping within {timeout_s:g} s") from None

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(plan)()

    def submit(self, plan: SchedulerOutput):
        """Send the plan to every rank; the callable waits for rank 0's result. The ranks
        run plans in the order sent (one queue each), so a second plan may go out while
        the first runs (async scheduling)."""
        if self.dispatch == "zmq":
            if self._bcast is None:
                self._start_zmq()
            # Both directions watch the loops: a send to a dead rank would block forever.
            self._bcast.send(plan, self._check_loops)
            return self._zmq_result
        if self._dag is None:
            self._compile()
        refs = self._dag.execute(plan)
        return lambda: self._cgraph_result(refs)

    def _zmq_result(self):
        try:
            return self._bcast.recv(self._check_loops)
        except ExecutorDeadError:  # ranks out of step: one may sit in a collective for good
            self._broken = True
            raise

    def _cgraph_result(self, refs):
        # Not contained: a compiled graph reports a rank's failure without telling whether
        # the other ranks rolled the step back too (the ZMQ channel does).
        try:
            return ray.get(refs)[0]
        except Exception as e:
            self._broken = True
            raise ExecutorDeadError(f"a worker step failed (compiled graph): {type(e).__name__}") from e

    def pop_exec_times(self) -> list[list[float]]:
        """Per-rank in-worker execution times since the last call (benchmark only)."""
        return ray.get([w.pop_exec_times.remote() for w in self.workers])

    def abandon(self) -> None:
        # No STOP message, no worker.shutdown: a rank may be stuck in an all-reduce with
        # a dead peer, and a PUSH to a dead rank blocks. Killing the actors frees all.
        for w in self.workers:
            ray.kill(w)
        if self._bcast is not None:  # or its context blocks the process's exit on open sockets
            self._bcast.close()
        self.workers, self._bcast, self._loops = [], None, []
        if self._owns_pg:
            ray.util.remove_placement_group(self.placement_group)
            self._owns_pg = False

    def shutdown(self) -> None:
        if self._broken:
            self.abandon()
            return
        if self._bcast is not None:
            self._bcast.stop()
            try:
                ray.get(self._loops, timeout=10)
            except Exception:
                logger.debug("dispatch loops did not stop cleanly", exc_info=True)
            self._bcast.close()
            self._bcast, self._loops = None, []
        if self._dag is not None:
            try:
                self._dag.teardown()
            except Exception:  # already torn down with Ray
                logger.debug("compiled graph teardown failed", exc_info=True)
            self._dag = None
        for w in self.workers:
            try:
                ray.get(w.shutdown.remote(), timeout=10)
            except Exception:
                logger.debug("worker shutdown failed", exc_info=True)
            ray.kill(w)
        self.workers = []
        if self._owns_pg:
            ray.util.remove_placement_group(self.placement_group)
            self._owns_pg = False
