"""deploy/ files validated by Ray's own schemas: the Serve config through
ray.serve.schema (the classes `serve run` / `serve deploy` parse it with), the cluster
YAML against the autoscaler's JSON schema shipped inside the ray package (what `ray up`
validates against). Plus: the Serve config's args really build our app."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIG = ROOT / "deploy" / "serve_config.yaml"
CLUSTER_CONFIG = ROOT / "deploy" / "cluster.yaml"


def test_serve_config_parses_with_ray_schema():
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    raw = yaml.safe_load(SERVE_CONFIG.read_text())
    deploy = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(raw)
    assert deploy.http_options.host == "127.0.0.1"
    assert deploy.http_options.port == 8000
    [app] = deploy.applications
    assert isinstance(app, ServeApplicationSchema)
    assert app.import_path == "pagedserve.cluster.app:app_builder"
    assert app.route_prefix == "/"
    assert app.args["model"] is None  # the demo model


def test_serve_config_args_build_the_app():
    from ray.serve._private.utils import import_attr

    from pagedserve.cluster.app import engine_deployment_options, split_args
    from pagedserve.config import EngineConfig

    raw = yaml.safe_load(SERVE_CONFIG.read_text())
    [app] = raw["applications"]
    builder = import_attr(app["import_path"])
    assert callable(builder)
    cfg, opts = split_args(app["args"])
    assert isinstance(cfg, EngineConfig)
    assert (cfg.model, cfg.max_num_seqs, cfg.max_model_len) == (None, 64, 1024)
    dep = engine_deployment_options(cfg, **opts)
    auto = dep["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (1, 2, 16.0)
    # The autoscaling dict is one Serve itself accepts.
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**auto)
    with pytest.raises(ValueError, match="unknown args"):
        split_args({"max_num_seq": 4})  # a typo is an error, not silently ignored


def test_tp_deployment_gets_one_bundle_per_rank():
    from pagedserve.cluster.app import engine_deployment_options
    from pagedserve.config import EngineConfig

    dep = engine_deployment_options(EngineConfig(tensor_parallel_size=4, device="cuda"))
    bundles = dep["placement_group_bundles"]
    assert len(bundles) == 5  # the scheduler actor + 4 ranks
    assert all(b == {"GPU": 1.0, "CPU": 1.0} for b in bundles[1:])
    assert "GPU" not in bundles[0]
    assert dep["num_replicas"] == 1


def test_engine_knobs_reach_the_replica_through_its_runtime_env(monkeypatch):
    """PAGEDSERVE_CPU_LINEAR & co. set where the app is built reach the engine replica even on a
    Ray cluster started earlier (its workers have the raylet's environment, not the caller's)."""
    from pagedserve.cluster.app import engine_deployment_options
    from pagedserve.config import EngineConfig

    monkeypatch.setenv("PAGEDSERVE_CPU_LINEAR", "onednn")
    monkeypatch.setenv("PAGEDSERVE_KV_THP", "0")
    monkeypatch.delenv("PAGEDSERVE_CPU_EXT", raising=False)
    env = engine_deployment_options(EngineConfig())["ray_actor_options"]["runtime_env"]["env_vars"]
    assert env["PAGEDSERVE_CPU_LINEAR"] == "onednn" and env["PAGEDSERVE_KV_THP"] == "0"
    assert "PAGEDSERVE_CPU_EXT" not in env  # unset stays unset: the replica's own default


def _ray_schema() -> dict:
    import ray

    path = os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")
    with open(path) as f:
        return json.load(f)


def test_cluster_yaml_matches_autoscaler_schema():
    cfg = yaml.safe_load(CLUSTER_CONFIG.read_text())
    jsonschema.validate(cfg, _ray_schema())
    nodes = cfg["available_node_types"]
    assert cfg["head_node_type"] in nodes
    gpu_types = [n for n, t in nodes.items() if t["resources"].get("GPU", 0) > 0]
    assert gpu_types, "a GPU worker node type"
    assert any("pip install" in c and "pagedserve" in c for c in cfg["setup_commands"])
    assert any("ray start --head" in c for c in cfg["head_start_ray_commands"])
    assert any("ray start --address" in c for c in cfg["worker_start_ray_commands"])


def test_schema_check_can_fail():
    cfg = yaml.safe_load(CLUSTER_CONFIG.read_text())
    cfg["available_node_types"]["gpu_worker"]["resources"]["GPU"] = "four"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cfg, _ray_schema())
    del cfg["provider"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cfg, _ray_schema())
