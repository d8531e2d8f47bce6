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

import ipaddress
import logging
import os
import socket

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

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
        # time-share the cores, which is the honest CPU-box behaviour).
        ray.init(num_cpus=num_cpus if num_cpus is not None else max(8, os.cpu_count() or 1),
                 _node_ip_address=LOOPBACK, include_dashboard=False,
                 namespace=namespace, log_to_driver=log_to_driver,
                 configure_logging=False)
    else:
        ray.init(address=address, namespace=namespace, log_to_driver=log_to_driver)


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
        if address.startswith("[::]:") and ray.is_initialized() and _is_loopback(node_ip()):
            address = f"{node_ip()}:{address.rsplit(':', 1)[1]}"
        return original(server, address)

    add_port._pagedserve_wrapped = True
    replica.add_port_to_grpc_server = add_port


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def shutdown_ray() -> None:
    """ray.shutdown() for drivers outside cluster/ (benchmarks), which never import ray."""
    ray.shutdown()


def node_ip() -> str:
    """The IP other ranks use to reach this node (127.0.0.1 on a local instance)."""
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # not inside Ray: a plain local process
        return LOOPBACK


def get_open_port(host: str = LOOPBACK) -> int:
    """A free TCP port on ``host`` for the torch.distributed rendezvous (the OS picks it;
    a tiny race with other binders is accepted, as in vLLM)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tp_bundles(tensor_parallel_size: int, use_gpu: bool, cpus_per_worker: float = 1.0,
               driver_cpus: float = 0.5) -> list[dict[str, float]]:
    """Placement-group bundles of one engine replica: bundle 0 holds the scheduler actor
    (the Serve replica), bundles 1..tp hold one worker each (a GPU each on CUDA)."""
    worker = {"GPU": 1.0, "CPU": cpus_per_worker} if use_gpu else {"CPU": cpus_per_worker}
    return [{"CPU": driver_cpus}] + [dict(worker) for _ in range(tensor_parallel_size)]


def worker_placement(tensor_parallel_size: int, use_gpu: bool
                     ) -> tuple[PlacementGroup, list[int], bool]:
    """The placement group and bundle indices for the TP workers. Inside a Serve replica
    that was given ``placement_group_bundles`` the replica's own group is reused (bundle
    0 is the replica itself); elsewhere a fresh group is created and owned by the caller
    (third value True: the caller must remove it)."""
    current = ray.util.get_current_placement_group()
    if current is not None and len(current.bundle_specs) >= tensor_parallel_size + 1:
        return current, list(range(1, tensor_parallel_size + 1)), False
    bundles = tp_bundles(tensor_parallel_size, use_gpu)[1:]
    # PACK: all ranks of one replica on as few nodes as possible (NCCL over NVLink beats
    # the network); a real multi-node TP deployment would switch to STRICT_PACK per node.
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    return pg, list(range(tensor_parallel_size)), True


def in_bundle(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index,
        placement_group_capture_child_tasks=True)
