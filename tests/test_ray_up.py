"""`ray up deploy/cluster.yaml`, booted on this machine with Ray's own local simulation of a
cloud: the fake_multinode provider, whose nodes are raylets the head's autoscaler starts here
with the resources cluster.yaml declares (8 GPUs and accelerator_type:H100 for an H100 node).
tests/_fake_cluster.py derives that config from cluster.yaml and starts the head as `ray up`
would; tests/test_deploy_configs.py checks the derivation, the schema and the commands.

The story: a CPU-only head is up, no GPU node is. deploy/serve_config.gpu.yaml goes in through
Serve's declarative API (`serve deploy` without the dashboard), with the demo model. Its engine
replica's placement group asks for 2 GPUs and accelerator_type:H100, STRICT_PACK; the autoscaler
adds a ray.worker.h100 node (not an L4 one); the group, the replica and its two TP worker actors
land there, one GPU each. torch here has no CUDA, so the workers then fail at start-up, as they
must on a GPU node without a CUDA torch: the error Serve reports names the node, each rank, the
GPUs it was shown and its local rank, and the fix. Afterwards nothing of the cluster runs.

The app is built on the head while only the head is up: build_app refuses a placement group
that neither a live node nor an autoscaler node type can hold, so getting as far as the H100
node also shows that cluster/placement.py found cluster.yaml's node types in the head's
~/ray_bootstrap_config.yaml (neither autoscaler of Ray 2.60 reports them to the GCS).

Both autoscalers run it: v1, and v2, which `ray up` starts by default since Ray 2.50. Every
fake node is 127.0.0.1, so nodes are told apart by node id (cluster_view tells them apart by
address, which is one here).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from _fake_cluster import FakeHead, free_port, load_cluster_yaml

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
GPU_SERVE_CONFIG = ROOT / "deploy" / "serve_config.gpu.yaml"
APP = "pagedserve"
# Serve gives up on a replica whose constructor failed 3 times; the error is in its message
# from the first failure on, so the test stops watching at the first.
DEVICE_FAILURE = "starting the device failed"


def _drop_driver() -> None:
    """Disconnect this process from whatever Ray it is on (Serve's client included)."""
    import ray
    from ray.serve.context import _set_global_client

    if ray.is_initialized():
        ray.shutdown()
    _set_global_client(None)


@pytest.fixture(params=["v1", "v2"])
def head(request, monkeypatch):
    from ray._private import ray_constants

    _drop_driver()  # this process joins the fake cluster, and nothing else
    # This driver on loopback too (cluster/ray_utils.py init_ray says why both are needed).
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    head = FakeHead(load_cluster_yaml(), autoscaler_v2=request.param == "v2")
    try:
        head.start()
        yield head
    finally:
        _drop_driver()
        head.stop()  # idempotent: the test stops it itself and asserts on what was left
        head.remove_files()


def _gpu_app_config() -> dict:
    """deploy/serve_config.gpu.yaml with the demo model (its own max_model_len) and a free
    HTTP port; everything else (TP 2, device auto, accelerator_type H100, STRICT_PACK, the
    replica range) as the file says."""
    config = yaml.safe_load(GPU_SERVE_CONFIG.read_text())
    config["http_options"]["port"] = free_port()
    [app] = config["applications"]
    assert app["name"] == APP
    app["args"].update(model="pagedserve-demo", max_model_len=None)
    return config


def _watch(timeout_s: float) -> dict:
    """Poll the cluster until the engine deployment reports the workers' device failure:
    the GPU nodes seen, the nodes of every placement group's bundles, the nodes of every
    worker actor and engine replica a process ran (dead ones stay in the actor table), Serve's message."""
    import ray
    from ray import serve
    from ray._private import state

    seen = dict(gpu_nodes={}, groups={}, workers={}, replicas={}, message="", status="")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for n in ray.nodes():
            if n["Alive"] and n["Resources"].get("GPU", 0) > 0:
                resources = {k: v for k, v in n["Resources"].items()
                             if k in ("CPU", "GPU") or k.startswith("accelerator_type:")}
                seen["gpu_nodes"][n["NodeID"]] = dict(ip=n["NodeManagerAddress"], resources=resources)
        for pg_id, pg in ray.util.placement_group_table().items():
            if any(pg.get("bundles_to_node_id", {}).values()):
                seen["groups"][pg_id] = dict(strategy=pg["strategy"], bundles=pg["bundles"],
                                             nodes=set(pg["bundles_to_node_id"].values()))
        for actor_id, a in state.actors().items():
            # Only actors a process ran (Pid): one Serve kills while its lease is still being
            # spilled from the head to the GPU node keeps the head's node id in its address.
            node = a["Address"]["NodeID"]
            if not (a["Pid"] and node and node != "nil"):
                continue
            if a["ActorClassName"] == "RayWorkerWrapper":
                seen["workers"][actor_id] = node
            elif a["ActorClassName"].endswith(":EngineDeployment"):
                seen["replicas"][actor_id] = node
        app = serve.status().applications.get(APP)
        dep = app.deployments.get("EngineDeployment") if app else None
        if dep is not None:
            seen["message"], seen["status"] = dep.message, str(dep.status)
            if DEVICE_FAILURE in dep.message:
                return seen
        if app is not None and str(app.status).endswith("DEPLOY_FAILED"):  # e.g. the app did not build
            raise AssertionError(f"{APP} failed otherwise: {app.message}\n{dep.message if dep else ''}")
        time.sleep(1.0)
    raise AssertionError(f"no device failure in {timeout_s:g} s; last seen: {seen}")


def test_ray_up_adds_an_h100_node_and_the_tp_workers_fail_there_naming_node_gpus_and_rank(head):
    import ray

    from pagedserve.cluster.ray_utils import deploy_config

    cluster = head.cluster
    h100 = cluster["available_node_types"]["ray.worker.h100"]["resources"]

    deploy_config(head.address, _gpu_app_config())
    assert not [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0]  # none yet
    seen = _watch(timeout_s=600)

    # The autoscaler added one node, of cluster.yaml's H100 type (its resources, 8 GPUs and
    # the accelerator resource), and none of the L4 type.
    [(node_id, node)] = seen["gpu_nodes"].items()
    assert node["resources"] == {k: float(v) for k, v in h100.items()}
    status = subprocess.run([str(Path(sys.executable).parent / "ray"), "status", f"--address={head.address}"],
                            capture_output=True, text=True, timeout=120).stdout
    assert re.search(r"^\s*1 ray\.worker\.h100$", status, re.M), status
    assert "ray.worker.l4" not in status, status

    # Every engine placement group (one per replica Serve tried) whole on that node: two
    # bundles of one GPU and a token of accelerator_type:H100 each, packed.
    assert seen["groups"]
    for group in seen["groups"].values():
        assert group["strategy"] == "STRICT_PACK" and group["nodes"] == {node_id}, group
        assert [b["GPU"] for b in group["bundles"].values()] == [1.0, 1.0], group
        assert all(b["accelerator_type:H100"] == 0.001 for b in group["bundles"].values()), group
    # The replicas and their TP worker actors ran there, two workers a replica.
    assert seen["replicas"] and set(seen["replicas"].values()) == {node_id}
    assert len(seen["workers"]) >= 2 and set(seen["workers"].values()) == {node_id}

    # What the user reads in `serve status`: both ranks failed at start-up, each naming the
    # node, the GPUs it sees (the two the group holds on that node: one each, shown to
    # both so NCCL could see its peer), its local rank, and the fix.
    message = seen["message"]
    failures = re.findall(r"rank (\d) \(actor RayWorkerWrapper on node ([\d.]+), "
                          r"CUDA_VISIBLE_DEVICES=(\d+),(\d+), local rank (\d)\): device 'cuda'", message)
    assert sorted((rank, local) for rank, _, _, _, local in failures) == [("0", "0"), ("1", "1")], message
    assert {ip for _, ip, _, _, _ in failures} == {node["ip"]}
    [gpus] = {(a, b) for _, _, a, b, _ in failures}
    assert gpus[0] != gpus[1] and all(0 <= int(g) < h100["GPU"] for g in gpus), gpus
    assert "failed on 2 of 2 TP workers" in message
    assert "build without CUDA" in message and "--device cpu" in message, message

    # Stopping the head stops everything it started, the fake GPU node included.
    _drop_driver()
    left = head.stop()
    assert left == [], left
