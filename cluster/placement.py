"""Where an engine replica runs: its device decided from what the cluster can have, its
placement group (Ray Serve LLM's placement model), and its TP workers' GPUs.

    placement_group_config = {"bundles": [{"GPU": 1, "CPU": 1}] * tp, "strategy": "STRICT_PACK"}
                           | {"bundle_per_worker": {"GPU": 1, "CPU": 1}, "strategy": ...}
    accelerator_type       = "H100"   -> {"accelerator_type:H100": 0.001} in each worker's bundle

    engine replica's group:  [ replica CPUs + worker 0 | worker 1 | ... | worker tp-1 ]

One bundle per TP worker; the Serve replica (the scheduler actor) shares bundle 0 with
rank 0, its CPUs added there, as Ray Serve LLM lays out a replica and its engine workers.

"What the cluster can have" is its live nodes and the node types its autoscaler may add:
a deployment sent before the autoscaler has started a GPU node still gets GPUs (Serve
then waits for the node). The node types come from the cluster config in the GCS where
something reports one (Ray 2.60's own autoscalers, v1 and v2, do not), else from the
head's ``~/ray_bootstrap_config.yaml``, which ``ray up`` writes there (the app is built on
the head: ``serve deploy`` runs its builder in a task there).
"""

from __future__ import annotations

import logging
import os

import ray
import yaml
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedserve.cluster.ray_utils import alive_nodes
from pagedserve.platforms import ClusterGPUs, nvml_device_count, with_device, worker_bundles

logger = logging.getLogger("pagedserve")

# What `ray up` writes on the head node: the autoscaler's config, node types included.
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"


def node_types() -> dict[str, dict[str, float]]:
    """The autoscaler's node types and their resources; {} when none is known."""
    try:
        from ray._private import state

        config = state.state.get_cluster_config()
    except Exception:  # an older Ray, or no GCS access
        config = None
    if config is not None and config.node_group_configs:
        return {g.name: {k: float(v) for k, v in g.resources.items()} for g in config.node_group_configs}
    try:
        with open(os.path.expanduser(BOOTSTRAP_CONFIG)) as f:
            cfg = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return {}
    types = cfg.get("available_node_types") or {}
    # A worker type with max_workers 0 is never added; the head type is up already.
    return {name: {k: float(v) for k, v in (t.get("resources") or {}).items() if isinstance(v, (int, float))}
            for name, t in types.items()
            if isinstance(t, dict) and name != cfg.get("head_node_type") and t.get("max_workers", 1) != 0}


def cluster_gpus() -> ClusterGPUs:
    live = sum(float(n.get("Resources", {}).get("GPU", 0)) for n in alive_nodes())
    types = [(name, r.get("GPU", 0.0)) for name, r in node_types().items()]
    return ClusterGPUs(live=live, node_type=max(types, key=lambda t: t[1]) if types else None)


def decide_for_cluster(engine_config):
    """``engine_config`` with its device decided from the Ray cluster this process is on
    (or, when Ray is not up, from this node's GPUs)."""
    if engine_config.device != "auto":
        return with_device(engine_config, None)
    if ray.is_initialized():
        return with_device(engine_config, cluster_gpus())
    return with_device(engine_config, None, local_gpus=nvml_device_count())


def engine_bundles(engine_config, replica_cpus: float) -> list[dict[str, float]]:
    """One engine replica's placement group under Serve: the workers' bundles with the
    replica's CPUs added to bundle 0 (the bundle Serve puts the replica in)."""
    bundles = worker_bundles(engine_config.device, engine_config.tensor_parallel_size,
                             engine_config.placement_group_config, engine_config.accelerator_type)
    bundles[0]["CPU"] = bundles[0].get("CPU", 0.0) + replica_cpus
    return bundles


def placement_strategy(engine_config, default: str = "STRICT_PACK") -> str:
    return (engine_config.placement_group_config or {}).get("strategy", default)


def _fits(need: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v > 0)


def _node_type_fits(need: dict[str, float], node_type: dict[str, float]) -> bool:
    """A node type that declares no accelerator_type resource may still have one (Ray adds
    it on the node from the GPU it finds): it is taken to have whichever is asked."""
    if not any(k.startswith("accelerator_type:") for k in node_type):
        need = {k: v for k, v in need.items() if not k.startswith("accelerator_type:")}
    return _fits(need, node_type)


def check_group_fits(bundles: list[dict[str, float]], strategy: str) -> None:
    """Refuse a placement group that neither a live node nor a node type the autoscaler
    may add can hold, with the numbers, instead of a replica that waits for resources for
    good. STRICT_PACK needs one node with the whole group; the other strategies need a
    node for each bundle and, on a fixed cluster, the cluster's total."""
    nodes = alive_nodes()
    if not nodes:
        return
    def fmt(r: dict) -> str:
        return ", ".join(f"{k} {v:g}" for k, v in sorted(r.items())
                         if (k in ("CPU", "GPU") or k.startswith("accelerator_type:")) and v) or "no CPU or GPU"

    totals = [{k: float(v) for k, v in n.get("Resources", {}).items()} for n in nodes]
    types = node_types()
    key = lambda r: (r.get("GPU", 0.0), r.get("CPU", 0.0))  # noqa: E731
    largest = max(totals + list(types.values()), key=key)
    where = f"the {len(nodes)} live nodes" + (f" and {len(types)} autoscaler node types" if types else "")

    def fits_somewhere(need: dict[str, float]) -> bool:
        return any(_fits(need, t) for t in totals) or any(_node_type_fits(need, t) for t in types.values())

    group: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            group[k] = group.get(k, 0.0) + v
    if strategy == "STRICT_PACK":
        if not fits_somewhere(group):
            raise ValueError(
                f"one engine replica's placement group ({len(bundles)} bundles: its TP workers, the "
                f"replica itself sharing the first) needs {fmt(group)} on one node (placement "
                f"strategy STRICT_PACK), but the largest of {where} has {fmt(largest)}. Lower "
                f"--tensor-parallel-size, add a node (type) that fits it, or pass "
                f"--placement-group-strategy PACK to spread the group across nodes (tensor "
                f"parallelism over the network).")
        return
    for b in bundles:
        if not fits_somewhere(b):
            raise ValueError(f"a bundle of {fmt(b)} fits none of {where} (the largest has {fmt(largest)}).")
    if types:
        return  # the autoscaler may add nodes until the group fits
    cluster: dict[str, float] = {}
    for t in totals:
        for k, v in t.items():
            cluster[k] = cluster.get(k, 0.0) + v
    if not _fits(group, cluster):
        raise ValueError(f"one engine replica's group needs {fmt(group)}; the whole cluster has {fmt(cluster)}.")


def worker_placement(engine_config) -> tuple[PlacementGroup, bool]:
    """The placement group the TP workers go in, one bundle each (rank r in bundle r).
    Inside a Serve replica built with ``engine_bundles`` it is the replica's own group
    (Serve applied its strategy); elsewhere (the offline engine) a new group, owned by
    the caller (second value True: the caller removes it). STRICT_PACK by default: every
    rank on one node (NCCL over NVLink, not the network)."""
    tp = engine_config.tensor_parallel_size
    current = ray.util.get_current_placement_group()
    if current is not None and len(current.bundle_specs) >= tp:
        return current, False
    bundles = worker_bundles(engine_config.device, tp, engine_config.placement_group_config,
                             engine_config.accelerator_type)
    strategy = placement_strategy(engine_config)
    check_group_fits(bundles, strategy)
    pg = placement_group(bundles, strategy=strategy)
    ray.get(pg.ready(), timeout=120)
    return pg, True


def actor_resources(bundle: dict[str, float]) -> dict:
    """Ray actor options that take exactly ``bundle`` (a worker's share of its bundle)."""
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    opts: dict = dict(num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0))
    if custom:
        opts["resources"] = custom
    return opts


def in_bundle(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index,
        placement_group_capture_child_tasks=True)
