"""RayExecutor: a tensor-parallel group of worker actors, one plan broadcast per step.

    scheduler actor (engine replica)                  placement group, one bundle per rank
      plan ──▶ broadcast channel ──▶ RayWorkerWrapper rank 0 ──┐  gloo (CPU) / NCCL (GPU)
                             └────▶ RayWorkerWrapper rank 1 ──┘  all-reduce
      result ◀── rank 0 only (the other ranks return nothing)

Not a Ray method call per worker per step (each costs more than a whole broadcast): one
pickle per step written to a PUSH socket per rank, rank 0's result read from one PULL
socket (cluster/executors/zmq_dispatch.py; Unix sockets when all ranks share the node).
A Ray Compiled Graph cost about twice as much per step here and could not tell a step
that every rank rolled back from a group out of step, so it went (git history keeps it;
loadtest/offline/bench_dispatch.py measures the channel).

The data plane (activations) never goes through Ray: torch.distributed carries it.

``submit`` sends a plan and returns the wait for its result, so the engine loop may plan
step N+1 while step N runs (async scheduling, cluster/engine/llm_engine.py).

The workers' device is decided where the app is built (platforms.py); the workers of one
node see the GPUs the group holds there, each taking its own by LOCAL_RANK.
"""

from __future__ import annotations

import logging
import os

import ray

from pagedserve.cluster.executors.base import Executor
from pagedserve.cluster.wire.failures import ExecutorDeadError
from pagedserve.cluster.placement import actor_resources, in_bundle, worker_placement
from pagedserve.cluster.ray_utils import LOOPBACK, get_open_port, init_ray, node_ip
from pagedserve.platforms import share_node_gpus, worker_bundles
from pagedserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.config import EngineConfig
from pagedserve.plugins import PLUGINS_ENV

logger = logging.getLogger(__name__)


class RayWorkerWrapper:
    """Actor body around one ``pagedserve.worker.worker.Worker`` (which knows nothing of Ray)."""

    def __init__(self, engine_config: EngineConfig, rank: int, world_size: int,
                 distributed_init_method: str | None = None) -> None:
        from pagedserve.worker.worker import Worker  # torch is imported in the actor only

        self.rank = rank
        self.worker = Worker(engine_config, rank=rank, world_size=world_size,
                             distributed_init_method=distributed_init_method)
        self.worker.where = f"rank {rank} (actor RayWorkerWrapper on node {node_ip()})"

    def rendezvous(self, across_nodes: bool) -> str:
        """Rank 0: the torch.distributed address, on this node: its cluster address when
        some rank sits on another node, loopback otherwise (issue 10's bind policy)."""
        host = node_ip() if across_nodes else LOOPBACK
        return f"tcp://{host}:{get_open_port(host)}"

    def placement(self) -> tuple[str, list[str]]:
        """(node id, the GPU ids Ray gave this actor)."""
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]

    def use_gpus(self, visible_devices: str, local_rank: int) -> None:
        """See every GPU the group holds on this node and take the ``local_rank``-th
        (platforms.share_node_gpus); before the first CUDA call, which reads them."""
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        os.environ["LOCAL_RANK"] = str(local_rank)
        self.worker.where = (f"rank {self.rank} (actor RayWorkerWrapper on node {node_ip()}, "
                             f"CUDA_VISIBLE_DEVICES={visible_devices}, local rank {local_rank})")

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
        return self.worker.execute_model(plan)

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
WORKER_GLIBC_TUNABLES = "glibc.malloc.hugetlb=1"


class RayExecutor(Executor):
    # The actor class of each rank (a bench may time its steps with a subclass).
    worker_cls = RayWorkerWrapper

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)
        init_ray()  # no-op inside a Serve replica or an already-started driver
        tp = engine_config.tensor_parallel_size
        if engine_config.device not in ("cpu", "cuda"):
            raise ValueError(f"RayExecutor needs a decided device, got {engine_config.device!r} "
                             "(cluster/placement.py decide_for_cluster decides it where the app is built).")
        use_gpu = engine_config.device == "cuda"
        self.placement_group, self._owns_pg = worker_placement(engine_config)
        bundles = worker_bundles(engine_config.device, tp, engine_config.placement_group_config,
                                 engine_config.accelerator_type)
        actor_cls = ray.remote(self.worker_cls)
        self.workers = []
        for rank, bundle in enumerate(bundles):
            # max_concurrency 2: the ZMQ loop holds one thread, control calls use the other.
            opts = dict(actor_resources(bundle), max_concurrency=2,
                        scheduling_strategy=in_bundle(self.placement_group, rank))
            env = {}
            if not use_gpu:
                mine = os.environ.get("GLIBC_TUNABLES")
                env["GLIBC_TUNABLES"] = f"{mine}:{WORKER_GLIBC_TUNABLES}" if mine else WORKER_GLIBC_TUNABLES
            if os.environ.get(PLUGINS_ENV):  # the driver's plugins load in its workers too
                env[PLUGINS_ENV] = os.environ[PLUGINS_ENV]
            if env:
                opts["runtime_env"] = {"env_vars": env}
            self.workers.append(actor_cls.options(**opts).remote(engine_config, rank, tp))
        self._bcast = None
        self._loops: list = []
        self._broken = False  # a worker died: shut down by killing, not by asking
        try:
            placements = ray.get([w.placement.remote() for w in self.workers])
            self._nodes = [node for node, _ in placements]
            if len(set(self._nodes)) > 1:
                logger.warning("the tensor-parallel group spans %d nodes: every layer's all-reduce crosses "
                               "the network (placement strategy %s)", len(set(self._nodes)),
                               (engine_config.placement_group_config or {}).get("strategy", "STRICT_PACK"))
            if use_gpu:
                self._all([w.use_gpus.remote(*share) for w, share in zip(self.workers, share_node_gpus(placements))],
                          "sharing the nodes' GPUs")
            # Rendezvous on rank 0's node (a STRICT_PACK group: all on one node, loopback).
            init_method = ray.get(self.workers[0].rendezvous.remote(len(set(self._nodes)) > 1)) if tp > 1 else None
            # All ranks must enter the rendezvous together: submit to all, then wait.
            self._all([w.init_device.remote(init_method) for w in self.workers], "starting the device")
            self._all([w.load_model.remote() for w in self.workers], "loading the model")
        except BaseException:
            self.abandon()  # no half-started group keeps its GPUs
            raise
        logger.info("RayExecutor: %d worker actors ready (%s, init %s)", tp,
                    "GPU" if use_gpu else "CPU", init_method)

    def _all(self, refs: list, step: str) -> list:
        """Every rank's result; if any rank failed, one error naming each failed rank's
        own message (each says its node, GPUs and local rank), not only the first's."""
        results, errors = [], []
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                errors.append(f"  rank {rank}: {type(cause).__name__}: {cause}")
                results.append(None)
        if errors:
            raise RuntimeError(f"{step} failed on {len(errors)} of {len(refs)} TP workers:\n" + "\n".join(errors))
        return results

    def determine_num_available_blocks(self) -> int:
        # Every rank must hold the same block ids, so the smallest rank decides.
        return min(ray.get([w.determine_num_available_blocks.remote() for w in self.workers]))

    def initialize_cache(self, num_blocks: int) -> None:
        ray.get([w.initialize_cache.remote(num_blocks) for w in self.workers])

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
        if self._bcast is None:
            self._start_zmq()
        # Both directions watch the loops: a send to a dead rank would block forever.
        self._bcast.send(plan, self._check_loops)
        return self._zmq_result

    def _zmq_result(self):
        try:
            return self._bcast.recv(self._check_loops)
        except ExecutorDeadError:  # ranks out of step: one may sit in a collective for good
            self._broken = True
            raise

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
