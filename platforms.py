"""The platform a deployment runs on, decided once where it is built, never in an actor.

vLLM decides its ``current_platform`` once, from NVML, without creating a CUDA context;
pagedserve does the same where the app (or the offline engine) is built, from what the
deployment can run on, and carries the answer in ``EngineConfig.device``:

    device="auto" ──▶ decide_device() ──▶ "cuda" | "cpu"   (with the reason, logged)
        the deployment's own placement asks for GPUs (accelerator_type, GPU bundles)
        the cluster's live nodes have GPUs
        a node type the autoscaler may add has GPUs (not up yet: Serve waits for it)
        no cluster: this node's NVIDIA driver sees GPUs (NVML)

An actor that holds no GPU (Ray gives it an empty CUDA_VISIBLE_DEVICES) would see no
CUDA and fall back to the CPU if it asked itself; it never asks. A worker told "cuda"
whose torch cannot use CUDA fails at start-up with ``cuda_unusable_reason()`` and the
fix, never silently on the CPU.

Also here: the dtype "auto" means on each device (``auto_dtype``) and how the TP workers
of one node share its GPUs (``share_node_gpus``). No torch at import, no ray.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger("pagedserve")

CUDA_INSTALL_HINT = ("install a CUDA build of torch on that node (e.g. pip install torch "
                     "--index-url https://download.pytorch.org/whl/cu128), or pass --device cpu")


def nvml_device_count() -> int:
    """GPUs this node's NVIDIA driver reports through NVML (libnvidia-ml), 0 without a
    driver. No CUDA context is created and CUDA_VISIBLE_DEVICES is not read: this asks
    what the node has, not what this process may use."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    count = ctypes.c_uint(0)
    try:
        if nvml.nvmlInit_v2() != 0:
            return 0
        try:
            if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
                return 0
        finally:
            nvml.nvmlShutdown()
    except AttributeError:  # a library too old to have the _v2 entry points
        return 0
    return int(count.value)


@dataclass(frozen=True, slots=True)
class DeviceDecision:
    device: str  # "cuda" or "cpu"
    reason: str  # why, for the start-up log


@dataclass(frozen=True, slots=True)
class ClusterGPUs:
    """What a Ray cluster can give a deployment, read where the app is built."""

    live: float  # GPUs on the nodes that are up
    # The most GPUs a node type of the autoscaler's config has, with its name; None when
    # no autoscaler config is known (a fixed cluster, or one that does not publish it).
    node_type: tuple[str, float] | None = None


def decide_device(requested: str, *, placement_asks_gpus: bool = False,
                  cluster: ClusterGPUs | None = None, local_gpus: int = 0) -> DeviceDecision:
    """``requested``: EngineConfig.device. ``placement_asks_gpus``: the deployment's own
    placement names an accelerator or GPU bundles. ``cluster``: the Ray cluster's view
    (None: no cluster, e.g. the offline engine in-process). ``local_gpus``: NVML's count
    on this node, used only without a cluster."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {requested!r}.")
    if requested == "cpu" and placement_asks_gpus:
        raise ValueError("device 'cpu' with a placement that asks for GPUs (accelerator_type or GPU "
                         "bundles in placement_group_config): drop one of them.")
    if requested != "auto":
        return DeviceDecision(requested, f"--device {requested}")
    if placement_asks_gpus:
        return DeviceDecision("cuda", "the deployment's placement asks for GPUs")
    if cluster is not None:
        if cluster.live > 0:
            return DeviceDecision("cuda", f"the cluster's live nodes have {cluster.live:g} GPUs")
        if cluster.node_type is not None and cluster.node_type[1] > 0:
            name, n = cluster.node_type
            return DeviceDecision("cuda", f"the autoscaler's node type {name!r} has {n:g} GPUs "
                                          "(none is up yet: the replica waits for one)")
        return DeviceDecision("cpu", "no node of the cluster, live or in the autoscaler's node types, has a GPU")
    if local_gpus > 0:
        return DeviceDecision("cuda", f"this node's NVIDIA driver sees {local_gpus} GPUs")
    return DeviceDecision("cpu", "no NVIDIA GPU on this node")


PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
_PLACEMENT_KEYS = ("bundles", "bundle_per_worker", "strategy")


def accelerator_resource(accelerator_type: str) -> str:
    """Ray's custom resource for an accelerator model, as a node with that GPU declares it."""
    return f"accelerator_type:{accelerator_type}"


def check_placement_group_config(pgc: dict | None, tensor_parallel_size: int) -> None:
    """ValueError naming what is wrong with a placement_group_config (Ray Serve LLM's shape)."""
    if pgc is None:
        return
    if not isinstance(pgc, dict):
        raise ValueError(f"placement_group_config must be a mapping, got {type(pgc).__name__}.")
    unknown = set(pgc) - set(_PLACEMENT_KEYS)
    if unknown:
        raise ValueError(f"placement_group_config has unknown keys {sorted(unknown)}; it takes {list(_PLACEMENT_KEYS)}.")
    if "bundles" in pgc and "bundle_per_worker" in pgc:
        raise ValueError("placement_group_config takes 'bundles' (one per TP worker) or 'bundle_per_worker', "
                         "not both.")
    strategy = pgc.get("strategy", "STRICT_PACK")
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"placement_group_config strategy must be one of {PLACEMENT_STRATEGIES}, got {strategy!r}.")
    bundles = pgc.get("bundles") or ([pgc["bundle_per_worker"]] if "bundle_per_worker" in pgc else [])
    if "bundles" in pgc and len(bundles) != tensor_parallel_size:
        raise ValueError(f"placement_group_config has {len(bundles)} bundles; it needs one per TP worker "
                         f"(tensor_parallel_size {tensor_parallel_size}).")
    for b in bundles:
        if not isinstance(b, dict) or not b or any(not isinstance(v, (int, float)) or v < 0 for v in b.values()):
            raise ValueError(f"a placement bundle maps resource names to amounts >= 0, got {b!r}.")
        if b.get("GPU", 0) > 1:
            raise ValueError(f"a TP worker holds one GPU: a bundle of {b['GPU']:g} GPUs cannot be one worker's.")


def placement_asks_gpus(pgc: dict | None, accelerator_type: str | None) -> bool:
    """Whether the deployment's own placement says it runs on GPUs."""
    if accelerator_type:
        return True
    if not pgc:
        return False
    bundles = pgc.get("bundles") or [pgc.get("bundle_per_worker") or {}]
    return any(b.get("GPU", 0) > 0 for b in bundles)


def worker_bundles(device: str, tensor_parallel_size: int, pgc: dict | None = None,
                   accelerator_type: str | None = None) -> list[dict[str, float]]:
    """One placement bundle per TP worker: the config's, else {"GPU": 1, "CPU": 1} on
    CUDA ({"CPU": 1} on the CPU); the accelerator's resource is added to each (a token
    0.001 of it, as Ray Serve LLM does: it only selects the node)."""
    if pgc and pgc.get("bundles"):
        bundles = [dict(b) for b in pgc["bundles"]]
    elif pgc and "bundle_per_worker" in pgc:
        bundles = [dict(pgc["bundle_per_worker"]) for _ in range(tensor_parallel_size)]
    else:
        one = {"GPU": 1.0, "CPU": 1.0} if device == "cuda" else {"CPU": 1.0}
        bundles = [dict(one) for _ in range(tensor_parallel_size)]
    if accelerator_type:
        for b in bundles:
            b.setdefault(accelerator_resource(accelerator_type), 0.001)
    return [{k: float(v) for k, v in b.items()} for b in bundles]


def with_device(engine_config, cluster: ClusterGPUs | None, local_gpus: int = 0):
    """``engine_config`` with its device decided (unchanged if it already is), the
    decision logged once with its reason."""
    import dataclasses

    decision = decide_device(engine_config.device,
                             placement_asks_gpus=placement_asks_gpus(engine_config.placement_group_config,
                                                                     engine_config.accelerator_type),
                             cluster=cluster, local_gpus=local_gpus)
    if engine_config.device == "auto":
        logger.info("device %s: %s (--device to choose)", decision.device, decision.reason)
    return dataclasses.replace(engine_config, device=decision.device)


def decide_here(engine_config):
    """The offline engine's decision, without a cluster: this node's GPUs (NVML)."""
    if engine_config.device != "auto":
        return with_device(engine_config, None)
    return with_device(engine_config, None, local_gpus=nvml_device_count())


def auto_dtype(checkpoint_dtype: str, device: str) -> str:
    """The compute dtype ``dtype="auto"`` means: the checkpoint's, except that float32
    (a float32 checkpoint, or a GGUF file, whose blocks are dequantized to float32) runs
    in bfloat16 on a GPU, as vLLM serves it there (a GPU's float32 GEMMs and attention
    are several times slower, and the weights and KV cache twice the bytes). On the CPU
    the checkpoint's dtype stays (the HF-exact reference runs there)."""
    if device == "cuda" and checkpoint_dtype in ("float32", "fp32", "float"):
        return "bfloat16"
    return checkpoint_dtype


def share_node_gpus(placements: list[tuple[str, list[str]]]) -> list[tuple[str, int]]:
    """TP workers ``[(node_id, gpu_ids Ray gave it)]`` -> ``[(CUDA_VISIBLE_DEVICES, local
    rank)]``, per worker. Every worker of a node sees all the GPUs the group holds on that
    node, in one order, and picks its own by its local rank (vLLM's layout): NCCL then
    sees its peers' devices, which per-worker masking hides from it (on NVSwitch nodes
    that costs a slow first collective or an NVLS hang)."""
    def order(gpu: str) -> tuple[int, int | str]:
        return (0, int(gpu)) if gpu.isdigit() else (1, gpu)

    on_node: dict[str, list[str]] = {}
    for node, gpus in placements:
        if len(gpus) != 1:
            raise ValueError(f"a TP worker holds exactly one GPU, got {gpus!r} on node {node}.")
        on_node.setdefault(node, []).extend(gpus)
    for node, gpus in on_node.items():
        on_node[node] = sorted(set(gpus), key=order)
    return [(",".join(on_node[node]), on_node[node].index(gpus[0])) for node, gpus in placements]


def cuda_unusable_reason() -> str | None:
    """Why torch in this process cannot run on CUDA, or None when it can. Imports torch."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.version.cuda is None:
        return f"torch {torch.__version__} here is a build without CUDA"
    if visible is not None and not visible.strip():
        return "CUDA_VISIBLE_DEVICES is empty (Ray gave this process no GPU)"
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no usable GPU "
                f"(CUDA_VISIBLE_DEVICES={visible}, the driver reports {nvml_device_count()})")
    return None
