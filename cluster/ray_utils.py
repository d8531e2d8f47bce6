"""Ray start-up and placement helpers (the only module that decides how Ray is started).

These quirks of Ray 2.60 shape this file (see /work/shared/PEERS.md):
- token auth is on by default; a local single-user cluster turns it off with
  ``RAY_AUTH_MODE=disabled`` (set before ``ray.init``, inherited by Ray's processes);
- Ray binds the host's routable address, and ``_node_ip_address="127.0.0.1"`` alone
  does not help (2.60 rewrites loopback to the routable IP); see ``init_ray``. A dev box
  should not open ports to the network by accident;
- every Serve replica opens an inter-deployment gRPC server on ``[::]:0`` (hard-coded in
  ray/serve/_private/replica.py); ``serve_grpc_on_node_ip`` moves it (deploy/README.md).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Iterator

import ray

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def init_ray(address: str | None = None, num_cpus: int | None = None,
             namespace: str | None = None, log_to_driver: bool = False) -> None:
    """Start (or join) Ray. ``address=None`` starts a private local instance on 127.0.0.1;
    ``address="auto"`` or ``"ray://..."`` joins a running cluster (its own auth settings
    apply). Idempotent: a no-op when Ray is already initialized in this process."""
    if ray.is_initialized():
        return
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # Ray resolves "127.0.0.1" to the host's routable IP (services.resolve_ip_for_localhost)
        # unless "cluster mode" is off, as it is on macOS/Windows; turning it off keeps the
        # GCS, raylet and workers on loopback. The env var reaches Ray's child processes;
        # the constant is read at call time, so patching it covers an already-imported ray.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        if os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = False
        # Logical CPUs, not cores: a TP worker bundle asks for 1 CPU and a replica for a
        # fraction, so a 2-core box must still admit e.g. two TP=2 replicas (they then
        # time-share the cores, which is the honest CPU-box behaviour). address="local": a
        # new instance, where ray.init() would join the cluster that RAY_ADDRESS names or
        # that the machine's last `ray start` recorded (/tmp/ray/ray_current_cluster).
        with _ray_processes_lead_own_groups():
            ray.init(address="local",
                     num_cpus=num_cpus if num_cpus is not None else max(8, os.cpu_count() or 1),
                     _node_ip_address=LOOPBACK, include_dashboard=False,
                     namespace=namespace, log_to_driver=log_to_driver,
                     configure_logging=False)
    else:
        ray.init(address=address, namespace=namespace, log_to_driver=log_to_driver)


@contextlib.contextmanager
def _ray_processes_lead_own_groups() -> Iterator[None]:
    """While ``ray.init`` starts the private instance, every process it starts (GCS, raylet,
    monitors) leads a process group of its own, as Ray's workers already do (the raylet
    starts them so). A signal to the starting process's group (``kill -- -PGID``, a
    terminal's Ctrl-C, a supervisor that signals the group) then reaches that process
    alone, which stops Serve and Ray in order. Sent to the GCS as well, it stops answering
    without exiting, and every Serve call of the shutdown waits on it until Ray's
    reconnect timeout aborts the process.

    They still die with the process that started them, however it dies: Ray starts each
    with PR_SET_PDEATHSIG (SIGKILL when its parent dies), and its workers exit when their
    raylet does (the raylet's two agents, after a SIGKILL, once their report of its death
    to the GCS, gone too, times out). Where the kernel cannot do that (not Linux), Ray's
    reaper kills the starting process's group instead, so they stay in it (Ray's own rule
    on Windows)."""
    from ray._private import services, utils

    popen = getattr(services, "ConsolePopen", None)
    fate_shared = getattr(utils, "detect_fate_sharing_support", None)
    if popen is None or fate_shared is None:  # a Ray that moved its hooks: start as Ray does
        logger.warning("ray._private has no services.ConsolePopen or utils.detect_fate_sharing_support: "
                       "Ray's processes stay in this process group (a signal to it reaches them too)")
    if popen is None or fate_shared is None or not fate_shared():
        yield
        return

    class OwnGroupPopen(popen):
        def __init__(self, *args, preexec_fn=None, **kwargs):
            def own_group() -> None:  # in the child, before exec
                os.setpgid(0, 0)
                if preexec_fn is not None:
                    preexec_fn()

            super().__init__(*args, preexec_fn=own_group, **kwargs)

    services.ConsolePopen = OwnGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = popen


def gcs_probe() -> Callable[[float], bool] | None:
    """``answers(timeout_s)``: whether this process's Ray GCS answers a read within
    ``timeout_s``. The probe has a client of its own: Ray's calls have no deadline, and a
    GCS that was sent SIGTERM stops serving but keeps running, so only an unanswered call
    tells it apart. Make it while the GCS is up: the client connects here, and waits for
    a GCS that is gone. None when Ray is not initialized here or has no such client."""
    try:
        from ray._raylet import GcsClient

        client = GcsClient(address=ray.get_runtime_context().gcs_address)
    except Exception:
        return None

    def answers(timeout_s: float) -> bool:
        try:
            client.internal_kv_exists(b"pagedserve-probe", b"pagedserve", timeout=timeout_s)
            return True
        except Exception:
            return False

    return answers


def kill_private_ray() -> None:
    """SIGKILL every process ``init_ray`` started for the private instance (GCS, raylet,
    monitors), waiting for each; their workers exit when the raylet dies. The last resort
    of a shutdown that cannot go in order. Nothing to kill on a joined cluster."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is not None:
        node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)


def serve_grpc_on_node_ip() -> None:
    """On a loopback node (``init_ray``'s private instance), bind each Serve replica's
    inter-deployment gRPC server to 127.0.0.1, not ``[::]``. Callers dial
    ``node_ip:port`` (the controller publishes the replica's node IP), which is
    127.0.0.1 there, so nothing that could reach it before is cut off.

    Must run in the replica process before Serve starts that server, i.e. in the
    deployment's constructor (Serve pickles deployment classes by value, so an
    import-time call in their module does not reliably run there). Idempotent; if a Ray
    upgrade moves the hook, it logs and changes nothing (tests/test_serve_security.py
    then sees the wildcard listener again)."""
    try:
        from ray.serve._private import replica
    except ImportError:  # pragma: no cover - ray without serve
        return
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None:
        logger.warning("ray.serve replica has no add_port_to_grpc_server; its gRPC server "
                       "keeps Ray's own bind address")
        return
    if getattr(original, "_pagedserve_wrapped", False):
        return

    def add_port(server, address: str):
        # Only on a loopback node: on a real cluster Ray's own choice stands.
        if address.startswith("[::]:") and ray.is_initialized() and is_loopback(node_ip()):
            address = f"{node_ip()}:{address.rsplit(':', 1)[1]}"
        return original(server, address)

    add_port._pagedserve_wrapped = True
    replica.add_port_to_grpc_server = add_port


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def shutdown_ray() -> None:
    """ray.shutdown() for drivers outside cluster/ (benchmarks), which never import ray."""
    if ray.is_initialized():
        ray.shutdown()


def node_ip() -> str:
    """The IP other ranks use to reach this node (127.0.0.1 on a local instance)."""
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # not inside Ray: a plain local process
        return LOOPBACK


def alive_nodes() -> list[dict]:
    """The cluster's live nodes as ``ray.nodes()`` reports them."""
    return [n for n in ray.nodes() if n.get("Alive")]


def bind_host() -> str:
    """Where a control-plane socket of this process listens (issue 10's bind policy):
    loopback while the Ray cluster is this one node, where every peer is local; the node's
    cluster address once the cluster has other nodes, whose processes may be the peers
    (an engine replica on another node sends its outputs to the front's channel)."""
    if not ray.is_initialized():
        return LOOPBACK
    return node_ip() if len(alive_nodes()) > 1 else LOOPBACK


# Resources that put an actor on the head node: the HTTP front and the stats aggregator
# live beside Serve's controller and proxy there, so losing a worker node never takes the
# front (and every stream through it) with it.
ON_HEAD_NODE = {"node:__internal_head__": 0.001}


def get_open_port(host: str = LOOPBACK) -> int:
    """A free TCP port on ``host`` for the torch.distributed rendezvous (the OS picks it;
    a tiny race with other binders is accepted, as in vLLM)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---- a multi-node Ray cluster on one machine (tests, loadtest/multinode/cluster_check.py)
class LocalCluster:
    """A head and worker nodes on this machine (``ray.cluster_utils.Cluster``), each its
    own raylet, resources and object store, as ``ray up`` makes them on several machines.
    The head has no CPUs (nothing but Serve's controller, proxy and the front lands
    there); worker ``i`` listens on 127.0.0.``i+2`` and has the resource ``node_i``.
    ``kill(ip)`` removes a node with everything on it, as a machine that dies. A worker
    may declare GPUs it does not have: Ray hands them out (CUDA_VISIBLE_DEVICES and all)
    as on a GPU node, up to the first CUDA call."""

    def __init__(self, workers: int = 2, cpus_per_worker: int = 4, object_store_mb: int = 150,
                 gpus_per_worker: int = 0) -> None:
        from ray.cluster_utils import Cluster

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep 127.0.0.x (init_ray)
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
        self._store = object_store_mb * 1024 * 1024
        self._cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=0, node_ip_address=LOOPBACK, include_dashboard=False, object_store_memory=self._store))
        self.nodes: dict[str, object] = {}
        for _ in range(workers):
            self.add_worker(cpus_per_worker, gpus_per_worker)

    @property
    def address(self) -> str:
        return self._cluster.address

    def add_worker(self, cpus: int, gpus: int = 0) -> str:
        i = len(self.nodes)
        ip = f"127.0.0.{i + 2}"
        self.nodes[ip] = self._cluster.add_node(num_cpus=cpus, num_gpus=gpus, node_ip_address=ip,
                                                resources={f"node_{i}": 1}, object_store_memory=self._store)
        return ip

    def kill(self, ip: str) -> None:
        self._cluster.remove_node(self.nodes.pop(ip), allow_graceful=False)

    def shutdown(self) -> None:
        self._cluster.shutdown()


def _join(address: str, namespace: str) -> None:
    """This driver joins ``address`` (once). Serve's client of an earlier cluster this
    process joined is dropped: it would ask that cluster's (gone) controller."""
    if ray.is_initialized():
        return
    from ray.serve.context import _set_global_client

    _set_global_client(None)
    ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)


def cluster_view(address: str, namespace: str = "serve") -> dict:
    """What a user would check on a cluster, from a driver that joins it: the live nodes,
    every actor's class, state and node, every placement group's state and the node of
    each bundle, and Serve's deployments. JSON-ready (loadtest/multinode/cluster_check.py)."""
    _join(address, namespace)
    from ray._private import state
    from ray import serve

    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive"))
    actors = [dict(cls=a.get("ActorClassName", ""), state=a.get("State"), name=a.get("Name", ""),
                   node=nodes.get(a.get("Address", {}).get("NodeID"), "?"), pid=a.get("Pid"))
              for a in state.actors().values()]
    groups = []
    for pg_id, pg in ray.util.placement_group_table().items():
        groups.append(dict(id=pg_id, name=pg.get("name", ""), state=pg.get("state"), strategy=pg.get("strategy"),
                           bundle_nodes=[nodes.get(n, "?") for _, n in sorted(pg.get("bundles_to_node_id", {}).items())]))
    deployments = {}
    try:
        for app_name, app in serve.status().applications.items():
            for name, dep in app.deployments.items():
                deployments[f"{app_name}/{name}"] = dict(
                    status=str(getattr(dep.status, "value", dep.status)), message=dep.message,
                    replicas={str(getattr(k, "value", k)): v for k, v in dep.replica_states.items()})
    except Exception as e:  # Serve not started
        deployments = {"error": f"{type(e).__name__}: {e}"}
    return dict(alive_nodes=alive, actors=actors, placement_groups=groups, deployments=deployments)


def deploy_config(address: str, config: dict) -> None:
    """``serve deploy CONFIG`` without the dashboard: the same declarative apply (Serve's
    controller starts the changed deployments' new version and drains the old replicas)."""
    _join(address, "serve")
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    client = serve_start(http_options=config.get("http_options"), proxy_location=config.get("proxy_location"))
    client.deploy_apps(ServeDeploySchema.model_validate(config))


def delete_app(name: str) -> None:
    """``serve.delete(name)`` for drivers outside cluster/."""
    from ray import serve

    serve.delete(name)
