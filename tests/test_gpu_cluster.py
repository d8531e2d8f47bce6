"""The GPU path as a GPU cluster's user meets it, on Ray nodes that declare GPUs they do
not have (Ray hands them out, CUDA_VISIBLE_DEVICES included, as on real GPU nodes; torch
here has no CUDA, so everything up to the first CUDA call is what runs for real):

- an app built with device auto on a cluster with GPU nodes is a CUDA app: the engine
  replica itself holds no GPU (it never decides), every TP worker holds one, and the
  workers of a node see the node's GPUs with a local rank each; on this torch they then
  fail at start-up, each naming its node, GPUs and local rank and the fix;
- a TP=1 replica built for CUDA holds its GPU and fails the same way;
- --device cpu on the same cluster holds no GPU and serves.

Several Ray nodes: marked ``cluster`` (./dev test -m cluster), run after the session's own
Ray is gone (conftest orders the files that use it first)."""

from __future__ import annotations

import re
import time

import httpx
import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    import ray
    from ray import serve
    from ray.serve.context import _set_global_client

    from pagedserve.cluster.ray_utils import LocalCluster, get_open_port
    from pagedserve.worker.loading.random_models import make_test_model

    if ray.is_initialized():  # the session's Ray, if a test before left it up
        serve.shutdown()
        ray.shutdown()
    cluster = LocalCluster(workers=2, cpus_per_worker=4, gpus_per_worker=2)
    _set_global_client(None)
    ray.init(address=cluster.address, namespace="gpu-cluster", log_to_driver=False)
    port = get_open_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    model = make_test_model("llama-gqa2-hd64", tmp_path_factory.mktemp("gpu-cluster-models"))
    try:
        yield dict(url=f"http://127.0.0.1:{port}", model=model, nodes=sorted(cluster.nodes))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _deploy(app, name: str) -> None:
    """Deploy without waiting for the app to run (it will not: its replicas fail to start)."""
    from ray.serve.api import _run

    _run(app, name=name, route_prefix=f"/{name}", _blocking=False)


def _start_failure(app_name: str, timeout_s: float = 180.0) -> str:
    """The engine deployment's status message once a replica has failed to start."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        dep = app.deployments.get("EngineDeployment") if app else None
        if dep is not None and "failed" in (dep.message or "").lower() and "Error" in dep.message:
            return dep.message
        time.sleep(1.0)
    raise AssertionError(f"{app_name}: no start-up failure within {timeout_s:.0f} s")


def _engine(model: str, **kw):
    from pagedserve.config import EngineConfig

    return EngineConfig(model=model, dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
                        max_num_seqs=4, **kw)


def test_an_app_built_for_the_gpus_puts_one_on_each_worker_with_local_ranks_and_fails_loudly(gpu_cluster):
    from ray import serve
    from ray.util.placement_group import placement_group_table

    from pagedserve.cluster.app import build_app

    _deploy(build_app(_engine(gpu_cluster["model"], tensor_parallel_size=2), engine_num_cpus=0.5), "tp2-gpu")
    try:
        msg = _start_failure("tp2-gpu")
        groups = [g for g in placement_group_table().values() if len(g["bundles"]) == 2]
        assert groups and all(b.get("GPU") == 1.0 for g in groups for b in g["bundles"].values())
    finally:
        serve.delete("tp2-gpu")
    # Both ranks of one node, each naming itself: the node, the node's two GPUs, its local rank.
    found = set(re.findall(r"rank (\d) \(actor RayWorkerWrapper on node ([\d.]+), "
                           r"CUDA_VISIBLE_DEVICES=([\d,]+), local rank (\d)\)", msg))
    assert {(r, v, lr) for r, _, v, lr in found} == {("0", "0,1", "0"), ("1", "0,1", "1")}, msg
    nodes = {node for _, node, _, _ in found}
    assert len(nodes) == 1 and nodes <= set(gpu_cluster["nodes"]), msg
    assert "device 'cuda' was decided for this deployment" in msg and "without CUDA" in msg
    assert "pip install torch --index-url" in msg and "--device cpu" in msg
    # The replica never decided: it holds no GPU, so it would have seen none.
    assert "starting the device failed on 2 of 2 TP workers" in msg


def test_a_tp1_replica_built_for_the_gpus_holds_one_and_fails_loudly(gpu_cluster):
    from ray import serve

    from pagedserve.cluster.app import build_app

    _deploy(build_app(_engine(gpu_cluster["model"])), "tp1-gpu")
    try:
        msg = _start_failure("tp1-gpu")
    finally:
        serve.delete("tp1-gpu")
    assert "device 'cuda' was decided for this deployment" in msg and "without CUDA" in msg, msg
    # The replica holds one GPU of one worker node, and says so.
    assert re.search(r"the engine replica's worker \(process \d+\) on node 127\.0\.0\.[23] "
                     r"\(CUDA_VISIBLE_DEVICES=[01]\)", msg), msg


def test_device_cpu_on_the_gpu_cluster_holds_no_gpu_and_serves(gpu_cluster):
    import ray
    from ray import serve
    from ray.util.placement_group import placement_group_table

    from pagedserve.cluster.app import build_app

    serve.run(build_app(_engine(gpu_cluster["model"], tensor_parallel_size=2, device="cpu"), engine_num_cpus=0.5),
              name="tp2-cpu", route_prefix="/tp2-cpu")
    try:
        r = httpx.post(f"{gpu_cluster['url']}/tp2-cpu/v1/completions", timeout=60, json=dict(
            prompt=[5, 17, 99, 3], max_tokens=8, temperature=0, ignore_eos=True))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        live = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        assert live and not any(b.get("GPU") for g in live for b in g["bundles"].values())
        # Every GPU of the cluster is still free: nothing of this app holds one.
        assert ray.available_resources().get("GPU") == 4.0
    finally:
        serve.delete("tp2-cpu")
