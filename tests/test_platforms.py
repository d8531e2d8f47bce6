"""The platform decisions, each on its own (platforms.py, cluster/placement.py,
worker/memory_plan.py): which device a deployment runs on and why, what dtype "auto"
means there, how a node's TP workers share its GPUs, the placement bundles, the group
check against live nodes and autoscaler node types, and the GPU memory plan. The same
decisions across a Ray cluster whose nodes declare GPUs: tests/test_gpu_cluster.py."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.platforms import (ClusterGPUs, auto_dtype, check_placement_group_config, decide_device,
                                  share_node_gpus, worker_bundles)


# ---------------------------------------------------------------- the device decision
def test_an_explicit_device_is_kept_whatever_the_cluster_has():
    assert decide_device("cpu", cluster=ClusterGPUs(live=8)).device == "cpu"
    assert decide_device("cuda", cluster=ClusterGPUs(live=0)).device == "cuda"


def test_auto_follows_the_placement_then_live_gpus_then_node_types_then_this_node():
    assert decide_device("auto", placement_asks_gpus=True, cluster=ClusterGPUs(live=0)).device == "cuda"
    assert decide_device("auto", cluster=ClusterGPUs(live=4)).device == "cuda"
    # No GPU node is up yet, but the autoscaler may add one: a deployment sent now gets GPUs.
    d = decide_device("auto", cluster=ClusterGPUs(live=0, node_type=("gpu_worker", 8.0)))
    assert d.device == "cuda" and "gpu_worker" in d.reason
    assert decide_device("auto", cluster=ClusterGPUs(live=0, node_type=("cpu_worker", 0.0))).device == "cpu"
    assert decide_device("auto", cluster=ClusterGPUs(live=0)).device == "cpu"
    # Without a cluster, this node's driver decides; a cluster's view wins over it.
    assert decide_device("auto", local_gpus=2).device == "cuda"
    assert decide_device("auto", local_gpus=0).device == "cpu"
    assert decide_device("auto", cluster=ClusterGPUs(live=0), local_gpus=2).device == "cpu"


def test_cpu_with_a_gpu_placement_is_refused_in_one_line():
    from pagedserve.cluster.cli.args import engine_config_from_args
    from pagedserve.cluster.cli.main import build_parser

    with pytest.raises(ValueError, match="drop one of them"):
        decide_device("cpu", placement_asks_gpus=True)
    with pytest.raises(ValueError, match="drop one of them"):
        EngineConfig(device="cpu", accelerator_type="H100")
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device="gpu")
    args = build_parser().parse_args(["serve", "--device", "cpu", "--placement-group-config",
                                      '{"bundle_per_worker": {"GPU": 1}}'])
    with pytest.raises(SystemExit, match="^error: device 'cpu' with a placement that asks for GPUs"):
        engine_config_from_args(args)


def test_an_engine_built_here_decides_for_this_node_and_the_worker_never_does(monkeypatch, tmp_path):
    from pagedserve import platforms
    from pagedserve.worker.worker import Worker

    monkeypatch.setattr(platforms, "nvml_device_count", lambda: 0)
    assert platforms.decide_here(EngineConfig()).device == "cpu"
    monkeypatch.setattr(platforms, "nvml_device_count", lambda: 4)
    assert platforms.decide_here(EngineConfig()).device == "cuda"
    assert platforms.decide_here(EngineConfig(device="cpu")).device == "cpu"
    with pytest.raises(ValueError, match="decided device"):
        Worker(EngineConfig(model=str(tmp_path)))  # "auto" never reaches a worker


def test_nvml_count_is_zero_without_a_driver():
    from pagedserve.platforms import nvml_device_count

    assert nvml_device_count() == (0 if not torch.cuda.is_available() else torch.cuda.device_count())


# ---------------------------------------------------------------- what "cuda" needs
@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the refusal of a torch built without CUDA")
def test_a_cuda_worker_on_a_torch_without_cuda_fails_naming_itself_and_the_fix(tmp_path, monkeypatch):
    from pagedserve.worker.worker import Worker

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    w = Worker(EngineConfig(model=str(tmp_path), device="cuda"))
    w.where = "rank 1 (actor RayWorkerWrapper on node 10.0.0.7, CUDA_VISIBLE_DEVICES=0,1, local rank 1)"
    with pytest.raises(RuntimeError) as e:
        w.init_device()
    msg = str(e.value)
    assert msg.startswith("rank 1 (actor RayWorkerWrapper on node 10.0.0.7, CUDA_VISIBLE_DEVICES=0,1, local rank 1)")
    assert "without CUDA" in msg and "pip install torch --index-url" in msg and "--device cpu" in msg


def test_dtype_auto_is_bf16_on_cuda_for_fp32_and_gguf_and_the_checkpoints_elsewhere(tmp_path):
    from pagedserve.worker.model_config import ModelConfig
    from pagedserve.worker.loading.random_models import make_test_model

    assert auto_dtype("float32", "cuda") == "bfloat16"
    assert auto_dtype("float16", "cuda") == "float16" and auto_dtype("bfloat16", "cuda") == "bfloat16"
    assert auto_dtype("float32", "cpu") == "float32"
    path = make_test_model("llama-gqa2-hd64", tmp_path)  # saved in float32
    assert ModelConfig.from_pretrained(path, device="cuda").dtype == torch.bfloat16
    assert ModelConfig.from_pretrained(path, device="cpu").dtype == torch.float32
    assert ModelConfig.from_pretrained(path, dtype="float32", device="cuda").dtype == torch.float32  # honoured
    from _gguf_helpers import write_gguf_from_hf

    gguf = write_gguf_from_hf(path, str(tmp_path / "m.gguf"))
    assert ModelConfig.from_pretrained(gguf, device="cuda").dtype == torch.bfloat16
    assert ModelConfig.from_pretrained(gguf, device="cpu").dtype == torch.float32


# ---------------------------------------------------------------- a node's GPUs
def test_workers_of_a_node_see_the_nodes_gpus_and_take_their_local_rank():
    placements = [("nodeA", ["3"]), ("nodeA", ["1"]), ("nodeB", ["0"]), ("nodeA", ["2"]), ("nodeB", ["5"])]
    assert share_node_gpus(placements) == [("1,2,3", 2), ("1,2,3", 0), ("0,5", 0), ("1,2,3", 1), ("0,5", 1)]
    assert share_node_gpus([("n", ["10"]), ("n", ["9"])]) == [("9,10", 1), ("9,10", 0)]  # numeric order
    with pytest.raises(ValueError, match="exactly one GPU"):
        share_node_gpus([("n", [])])


# ---------------------------------------------------------------- placement
def test_placement_group_config_takes_ray_serve_llms_shape():
    check_placement_group_config({"bundles": [{"GPU": 1, "CPU": 2}] * 2, "strategy": "PACK"}, 2)
    check_placement_group_config({"bundle_per_worker": {"GPU": 1}}, 4)
    check_placement_group_config({"strategy": "SPREAD"}, 4)
    for bad, match in [({"bundles": [{"GPU": 1}]}, "one per TP worker"), ({"strategy": "TIGHT"}, "strategy"),
                       ({"bundle": {}}, "unknown keys"), ({"bundle_per_worker": {"GPU": 2}}, "one GPU"),
                       ({"bundles": [{"GPU": 1}] * 2, "bundle_per_worker": {"GPU": 1}}, "not both")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(tensor_parallel_size=2, placement_group_config=bad)


def test_worker_bundles_one_per_rank_with_the_accelerator_resource():
    assert worker_bundles("cuda", 2) == [{"GPU": 1.0, "CPU": 1.0}] * 2
    assert worker_bundles("cpu", 2) == [{"CPU": 1.0}] * 2
    assert worker_bundles("cuda", 2, accelerator_type="H100") == [
        {"GPU": 1.0, "CPU": 1.0, "accelerator_type:H100": 0.001}] * 2
    assert worker_bundles("cuda", 2, {"bundle_per_worker": {"GPU": 1, "CPU": 4}}, "L4") == [
        {"GPU": 1.0, "CPU": 4.0, "accelerator_type:L4": 0.001}] * 2


def test_the_engine_deployment_shares_bundle_0_with_rank_0_and_never_asks_the_replica():
    from pagedserve.cluster.app import engine_deployment_options

    dep = engine_deployment_options(EngineConfig(tensor_parallel_size=4, device="cuda", accelerator_type="H100"))
    acc = {"accelerator_type:H100": 0.001}
    assert dep["placement_group_bundles"] == [{"GPU": 1.0, "CPU": 2.0, **acc}] + [{"GPU": 1.0, "CPU": 1.0, **acc}] * 3
    assert dep["placement_group_strategy"] == "STRICT_PACK"
    assert dep["ray_actor_options"]["num_cpus"] == 1.0 and "num_gpus" not in dep["ray_actor_options"]
    pgc = {"bundles": [{"GPU": 1, "CPU": 8}] * 2, "strategy": "PACK"}
    dep = engine_deployment_options(EngineConfig(tensor_parallel_size=2, device="cuda", placement_group_config=pgc))
    assert dep["placement_group_bundles"] == [{"GPU": 1.0, "CPU": 9.0}, {"GPU": 1.0, "CPU": 8.0}]
    assert dep["placement_group_strategy"] == "PACK"
    # TP 1 in the replica itself: the replica holds the GPU (and the accelerator).
    one = engine_deployment_options(EngineConfig(device="cuda", accelerator_type="L4"))["ray_actor_options"]
    assert (one["num_cpus"], one["num_gpus"], one["resources"]) == (1.0, 1.0, {"accelerator_type:L4": 0.001})
    assert engine_deployment_options(EngineConfig(device="cpu"))["ray_actor_options"]["num_gpus"] == 0.0


def test_a_deployment_sent_before_the_gpu_node_is_up_asks_for_gpus(monkeypatch, tmp_path):
    """`serve deploy` before the autoscaler has added a GPU node: the node types of the
    head's ray_bootstrap_config.yaml (what `ray up` writes there) decide, and the group
    check accepts a group that only a node type can hold."""
    import ray

    from pagedserve.cluster import placement
    from pagedserve.cluster.app import engine_deployment_options

    (tmp_path / "ray_bootstrap_config.yaml").write_text(json.dumps({
        "head_node_type": "head",
        "available_node_types": {"head": {"resources": {"CPU": 8, "GPU": 0}},
                                 "h100": {"resources": {"CPU": 192, "GPU": 8}, "max_workers": 2},
                                 "off": {"resources": {"CPU": 4, "GPU": 16}, "max_workers": 0}}}))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(placement, "alive_nodes", lambda: [{"Alive": True, "Resources": {"CPU": 8.0}}])
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert placement.node_types() == {"h100": {"CPU": 192.0, "GPU": 8.0}}
    dep = engine_deployment_options(EngineConfig(tensor_parallel_size=4))
    assert dep["placement_group_bundles"][1] == {"GPU": 1.0, "CPU": 1.0}
    placement.check_group_fits(dep["placement_group_bundles"], "STRICT_PACK")  # an h100 node will hold it
    # A node type that declares no accelerator resource may still have it (Ray adds it from the GPU).
    placement.check_group_fits(placement.engine_bundles(
        EngineConfig(tensor_parallel_size=8, device="cuda", accelerator_type="H100"), 1.0), "STRICT_PACK")
    with pytest.raises(ValueError, match="1 autoscaler node types"):
        placement.check_group_fits(placement.engine_bundles(
            EngineConfig(tensor_parallel_size=16, device="cuda"), 1.0), "STRICT_PACK")
    (tmp_path / "ray_bootstrap_config.yaml").unlink()  # no autoscaler: the live nodes only
    assert engine_deployment_options(EngineConfig(tensor_parallel_size=2))["placement_group_bundles"][1] == {"CPU": 1.0}


# ---------------------------------------------------------------- the GPU memory plan
def _plan(**kw):
    from pagedserve.worker.memory_plan import GiB, MemoryPlan

    base = dict(total=80 * GiB, gpu_memory_utilization=0.9, weights=16 * GiB, activations=2 * GiB,
                sampler=GiB // 2, cuda_graphs=GiB // 4, non_torch=GiB // 2, bytes_per_block=2 << 20)
    return MemoryPlan(**{**base, **kw})


def test_the_kv_cache_is_what_every_measured_share_leaves():
    from pagedserve.worker.memory_plan import GiB

    p = _plan()
    assert p.kv_cache == int(72 * GiB) - 16 * GiB - 2 * GiB - GiB // 2 - GiB // 4 - GiB // 2
    assert p.num_blocks == p.kv_cache // (2 << 20)
    assert "weights 16.00, activations 2.00, sampler 0.50, CUDA graphs 0.25, non-torch 0.50" in p.describe()
    for share in ("activations", "sampler", "cuda_graphs", "non_torch", "weights"):
        assert _plan(**{share: getattr(p, share) + GiB}).num_blocks < p.num_blocks, share
    assert _plan(gpu_memory_utilization=0.8).num_blocks < p.num_blocks
    with pytest.raises(RuntimeError, match="no memory left for the KV cache. GPU memory: 80.00 GiB"):
        _plan(activations=60 * GiB).check()


def test_the_profile_runs_the_largest_step_the_scheduler_can_send():
    from pagedserve.worker.memory_plan import profile_shapes

    def shapes(**kw):
        return profile_shapes(EngineConfig(**{"max_num_seqs": 256, **kw}), max_model_len=8192, graphs=True,
                              max_capture_size=512)

    s = shapes()
    assert (s.num_tokens, s.num_sample_rows, s.logprobs, s.graph_max_rows) == (2048, 256, True, 256)
    # Without chunked prefill a whole prompt is one step: the budget is max_model_len.
    assert shapes(enable_chunked_prefill=False).num_tokens == 8192
    assert shapes(max_num_batched_tokens=4096).num_tokens == 4096
    # Speculation: every verify row samples, and decode graphs reach the verify row count.
    spec = shapes(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert (spec.num_sample_rows, spec.graph_max_rows, spec.num_tokens) == (1280, 512, 2048)
    assert shapes(max_num_seqs=512, speculative_config={"method": "ngram", "num_speculative_tokens": 4}
                  ).num_tokens == 2560
    assert shapes(max_logprobs=0).logprobs is False
    assert profile_shapes(EngineConfig(), 8192, graphs=False, max_capture_size=512).graph_max_rows == 0


def test_decode_graphs_are_captured_up_to_the_verify_rows(tmp_path):
    from pagedserve.worker.model_config import ModelConfig
    from pagedserve.worker.model_runner import ModelRunner
    from pagedserve.worker.loading.random_models import make_test_model

    cfg = ModelConfig.from_pretrained(make_test_model("llama-gqa2-hd64", tmp_path), max_model_len=128)
    runner = ModelRunner(torch.nn.Identity(), cfg, block_size=16, device=torch.device("cpu"), max_num_seqs=8,
                         pad_eager=True, num_speculative_tokens=4)
    assert max(runner.graph_runner.sizes) == 40 and runner.graph_runner.padded_size(33) == 40


def test_the_profile_steps_run_on_the_cpu_at_the_largest_shapes(tmp_path):
    """The forward, prompt-logprobs and sampler passes the CUDA profile measures, run here
    at their shapes (the measuring itself needs a GPU: loadtest/gpu_check.py)."""
    from pagedserve.worker.memory_plan import profile_shapes
    from pagedserve.worker.loading.random_models import make_test_model
    from pagedserve.worker.worker import Worker

    path = make_test_model("llama-gqa2-hd64", tmp_path)
    config = EngineConfig(model=path, device="cpu", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=96,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    w = Worker(config)
    w.init_device()
    w.load_model()
    s = profile_shapes(config, 256, graphs=False, max_capture_size=512)
    assert (s.num_tokens, s.num_sample_rows) == (96, 24)
    w.runner.profile_forward(s.num_tokens, s.num_sample_rows, s.logprobs)
    w.runner.profile_sampler(s.num_sample_rows, s.logprobs)
