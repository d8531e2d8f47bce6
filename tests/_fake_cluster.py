"""deploy/cluster.yaml on this machine: its node types under Ray's ``fake_multinode``
autoscaler (ray/autoscaler/_private/fake_multi_node/node_provider.py), whose "nodes" are
raylets the head's autoscaler starts locally with the declared resources (GPUs included).

    deploy/cluster.yaml ──fake_multinode_config()──▶ the same node types (names, resources,
                                                     min/max workers), provider fake_multinode,
                                                     nothing to install, start or sync
    FakeHead(config).start() ─▶ RAY_FAKE_CLUSTER=1 ray start --head --block, in a session of
                                its own, HOME holding ~/ray_bootstrap_config.yaml (as `ray up`
                                leaves it on a real head), loopback, token auth off
    FakeHead.stop()          ─▶ SIGTERM to that process; then whatever of its session (or of
                                its temp dir) still runs is reported and killed

Ray's own helpers are no use here: DockerCluster needs docker-compose, and
AutoscalingCluster.start() runs `ray stop --force`, which kills every Ray process on the
machine (other tests' clusters included). So the head is started, and stopped, by hand.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_YAML = ROOT / "deploy" / "cluster.yaml"

# What a `ray up` config carries that no fake node can use: the cloud's SSH user, the
# container, the files to sync and the commands to install and start Ray. The fake
# config keeps each key, empty: the autoscaler's reset() reads them (KeyError otherwise).
EMPTIED = dict(auth={}, docker={}, file_mounts={}, cluster_synced_files=[], file_mounts_sync_continuously=False,
               rsync_exclude=[], rsync_filter=[], initialization_commands=[], setup_commands=[],
               head_setup_commands=[], worker_setup_commands=[], head_start_ray_commands=[],
               worker_start_ray_commands=[])
# The node-type keys that say what a node is and how many there may be (node_config, the
# instance and its image, is the cloud's and goes).
NODE_TYPE_KEYS = ("resources", "min_workers", "max_workers", "labels")


def load_cluster_yaml(path: Path = CLUSTER_YAML) -> dict:
    return yaml.safe_load(path.read_text())


def fake_multinode_config(cluster: dict, gcs_address: str | None = None, autoscaler_v2: bool = False) -> dict:
    """The fake_multinode config of ``cluster`` (deploy/cluster.yaml as loaded): the same
    cluster name, worker bounds and node types; provider ``fake_multinode`` dialing the head
    at ``gcs_address`` (else it dials port 6379), with no node updaters (there is nothing
    to ssh into) and no launch-config check (node_config is gone)."""
    from ray.autoscaler._private.fake_multi_node.node_provider import (FAKE_HEAD_NODE_ID, FAKE_HEAD_NODE_TYPE,
                                                                      FakeMultiNodeProvider)

    if cluster["head_node_type"] != FAKE_HEAD_NODE_TYPE:
        # The fake provider tags its head with this name: another name would leave the head
        # of a type the autoscaler does not know.
        raise ValueError(f"the head node type must be named {FAKE_HEAD_NODE_TYPE!r} for fake_multinode, "
                         f"got {cluster['head_node_type']!r}")
    # use_node_id_as_ip: every fake node is 127.0.0.1; the autoscaler keys them by node id.
    provider = dict(type="fake_multinode", use_node_id_as_ip=True, disable_node_updaters=True,
                    disable_launch_config_check=True)
    if gcs_address is not None:
        provider["gcs_address"] = gcs_address
    if autoscaler_v2:
        # As AutoscalingCluster(autoscaler_v2=True) sets it up, with one change: v2 fills the
        # config's defaults from the provider type's example config, which the ray wheel does
        # not ship for fake_multinode (fake_multi_node/example.yaml); the same provider class
        # named as an external module needs none.
        provider.update(type="external", module=f"{FakeMultiNodeProvider.__module__}.FakeMultiNodeProvider",
                        launch_multiple=True, head_node_id=FAKE_HEAD_NODE_ID)
    node_types = {name: dict({k: copy.deepcopy(t[k]) for k in NODE_TYPE_KEYS if k in t}, node_config={})
                  for name, t in cluster["available_node_types"].items()}
    config = dict(cluster_name=cluster["cluster_name"], max_workers=cluster["max_workers"],
                  upscaling_speed=cluster.get("upscaling_speed", 1.0),
                  idle_timeout_minutes=cluster.get("idle_timeout_minutes", 5),
                  provider=provider, available_node_types=node_types, head_node_type=cluster["head_node_type"])
    config.update(copy.deepcopy(EMPTIED))
    return config


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid`` (zombies aside)."""
    found = []
    for pid in _pids():
        try:
            if os.getsid(pid) != sid:
                continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:  # gone meanwhile
            continue
        found.append(pid)
    return found


def pids_naming(path: str) -> list[int]:
    """Live processes whose command line names ``path`` (Ray passes every process its
    session directory): any that left the session still shows here."""
    return [pid for pid in _pids() if pid != os.getpid() and path in _cmdline(pid)]


class FakeHead:
    """A Ray head node with the fake_multinode autoscaler, started as ``ray up`` starts one
    (the head type's resources, ``--autoscaling-config ~/ray_bootstrap_config.yaml``), all
    on 127.0.0.1, in a temp dir and a session of its
    own so that everything it starts can be found and stopped, and nothing else."""

    def __init__(self, cluster: dict, autoscaler_v2: bool = False) -> None:
        self.cluster = cluster
        self.autoscaler_v2 = autoscaler_v2
        # Short: Ray's unix sockets live under it (the path limit is 107 bytes).
        self.tmp = tempfile.mkdtemp(prefix="rayup-", dir="/tmp")
        self.home = Path(self.tmp) / "home"
        self.home.mkdir()
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.config = fake_multinode_config(cluster, gcs_address=self.address, autoscaler_v2=autoscaler_v2)
        self.bootstrap_config = self.home / "ray_bootstrap_config.yaml"
        self.bootstrap_config.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.log_path = Path(self.tmp) / "head.log"
        self.proc: subprocess.Popen | None = None
        self._stopped = False

    def env(self) -> dict[str, str]:
        from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

        # Nothing here that `ray up` sets per node (RAY_OVERRIDE_RESOURCES, RAY_NODE_TYPE_NAME):
        # the monitor inherits this environment and builds the fake nodes in its own process,
        # so they would take the head's resources and node type.
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
        env.update({
            "HOME": str(self.home),
            "RAY_FAKE_CLUSTER": "1",
            "RAY_AUTH_MODE": "disabled",
            # 127.0.0.1 for the head and every fake node (ray_utils.init_ray says why this
            # and not only --node-ip-address).
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            # Stop at once: nothing here to drain.
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            # The id the fake provider knows its head by (the workers' ids it sets itself).
            "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID,
        })
        if self.autoscaler_v2:
            env.update({"RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID})
        return env

    def start(self, timeout_s: float = 120.0) -> str:
        ray_cli = str(Path(sys.executable).parent / "ray")
        # The head type's resources as flags (`ray up` exports them as RAY_OVERRIDE_RESOURCES; see env()).
        resources = dict(self.cluster["available_node_types"][self.cluster["head_node_type"]]["resources"])
        cmd = [ray_cli, "start", "--head", "--block", f"--num-cpus={resources.pop('CPU', 0)}",
               f"--num-gpus={resources.pop('GPU', 0)}", f"--resources={json.dumps(resources)}",
               f"--port={self.port}", "--node-ip-address=127.0.0.1",
               "--autoscaling-config=~/ray_bootstrap_config.yaml", "--include-dashboard=false",
               f"--temp-dir={self.tmp}", f"--ray-client-server-port={free_port()}",
               f"--dashboard-agent-listen-port={free_port()}", "--min-worker-port=0", "--max-worker-port=0",
               "--disable-usage-stats"]
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=self.env(), cwd=self.home, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start --head exited {self.proc.returncode}:\n{self.log()}")
            if "Ray runtime started" in self.log():
                return self.address
            time.sleep(0.5)
        raise TimeoutError(f"ray start --head not up in {timeout_s:g} s:\n{self.log()}")

    def log(self, tail: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def monitor_log(self, tail: int = 6000) -> str:
        """The autoscaler's own log (monitor.log of the session), for a failing test's message."""
        logs = sorted(Path(self.tmp).glob("session_*/logs/monitor.log"))
        return logs[-1].read_text(errors="replace")[-tail:] if logs else ""

    def stop(self, grace_s: float = 60.0) -> list[str]:
        """Stop the head, then the fake nodes its autoscaler started.

        SIGTERM to ``ray start --block`` makes it stop the processes it started (GCS, raylet,
        monitor, ...; they also die with it: Ray starts them with PR_SET_PDEATHSIG) and exit.
        The fake nodes are not among them: the monitor starts their raylets without fate
        sharing, so they would outlive the head (until their raylets give up on the GCS).
        They are in the head's process group, which gets SIGTERM next; their workers (each in
        a group of its own) exit with their raylet. Returns what of this head (its session,
        or any process naming its temp dir) still ran ``grace_s`` later, SIGKILLed since:
        [] when SIGTERM took everything."""
        if self.proc is None or self._stopped:
            return []
        self._stopped = True
        sid = self.proc.pid  # a session leader: its session and process group ids are its pid
        deadline = time.monotonic() + grace_s
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(sid, signal.SIGTERM)
        except ProcessLookupError:  # the group is empty already
            pass
        left = []
        while time.monotonic() < deadline:
            left = sorted(set(session_pids(sid)) | set(pids_naming(self.tmp)))
            if not left:
                break
            time.sleep(0.5)
        report = [f"{pid}: {_cmdline(pid)[:200]}" for pid in left]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        return report

    def remove_files(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
