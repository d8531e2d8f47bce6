"""Weights on every node (worker/loading/model_fetch.py): ``--model`` as a Hugging Face repo id or an
s3:// URI travels as itself, and each process that opens the model fetches it onto its own
node first, once per node, under a lock, never taking a partial copy for a whole one.

    repo id   a hub cache built by hand in the hub's own layout, HF_HUB_OFFLINE=1
              (nothing can reach the hub from here): loads, or a clear error
    s3://     a real S3 endpoint (moto's server on 127.0.0.1) read by pyarrow's
              S3FileSystem, as on a cluster: mirrored, loaded, raced, interrupted
    cluster   two Ray nodes on this machine, a cache each, one TP=2 replica spanning
              both: each node holds its own copy, greedy tokens as from a local path
              (marked ``cluster``: ./dev test -m cluster)

Every load is compared token for token with the same checkpoint loaded from its directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.worker.loading import model_fetch
from pagedserve.worker.loading.model_fetch import (CONFIG_FILES, INDEX_FILE, fetch_model, is_remote,
                                           object_store_dir)
from pagedserve.worker.loading.random_models import make_test_model

REPO = "pagedserve-tests/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the snapshot folder's name: a commit hash
ENGINE = dict(dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=4)
PROMPTS = ["the weights travel to every node", "each node fetches its own copy"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_test_model("llama-gqa2-hd64", tmp_path_factory.mktemp("models"))


def greedy(model: str, **kw):
    """(prompt ids, greedy output ids) per prompt, and the engine's config after resolving."""
    from pagedserve.cluster.llm import LLM
    from pagedserve.scheduler.sampling_params import SamplingParams

    llm = LLM(model=model, **ENGINE, **kw)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        return [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs], llm.engine.config
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def reference(tiny):
    """The checkpoint loaded from its local directory, as every test below must match."""
    tokens, _ = greedy(tiny)
    assert all(len(out) == MAX_TOKENS for _, out in tokens)
    return tokens


def model_files(model_dir: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(model_dir).iterdir() if p.is_file()}


def test_the_test_model_is_what_a_fetch_takes(tiny):
    # Every file of the checkpoint is one a fetch takes: a fetched copy must equal it whole.
    assert set(model_files(tiny)) <= {*CONFIG_FILES, "model.safetensors"}
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(model_files(tiny))


def test_what_counts_as_a_remote_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_remote("org/name") and is_remote("s3://bucket/prefix") and is_remote("gs://bucket/a/b")
    assert not is_remote(None) and not is_remote("pagedserve-demo") and not is_remote("SmolLM2-135M-Instruct")
    assert not is_remote("./org/name") and not is_remote("/abs/org") and not is_remote("org/model.gguf")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_remote("org/name")  # a path that exists wins


# ---------------------------------------------------------------------------- Hugging Face repo ids
def hub_cache(root: Path, model_dir: str, repo: str = REPO, commit: str = COMMIT,
              only: set[str] | None = None) -> Path:
    """The hub's own cache layout, as snapshot_download leaves it on a node:

        models--org--name/refs/main                     the commit "main" points at
        models--org--name/blobs/<sha256>                each file's bytes
        models--org--name/snapshots/<commit>/<file>  -> ../../blobs/<sha256>
    """
    entry = root / ("models--" + repo.replace("/", "--"))
    snap = entry / "snapshots" / commit
    (entry / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for name, data in model_files(model_dir).items():
        if only is not None and name not in only:
            continue
        blob = entry / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(commit)
    return snap


def test_repo_id_loads_offline_from_the_node_hub_cache(tiny, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = hub_cache(tmp_path / "hub", tiny)
    fetched = fetch_model(REPO)
    assert (fetched.path, fetched.revision, fetched.fetched) == (str(snap), COMMIT, False)
    tokens, config = greedy(REPO)
    assert tokens == reference
    # The engine passes the source on (its workers fetch it on their nodes), at the commit it found.
    assert (config.model, config.revision) == (REPO, COMMIT)


def test_repo_id_missing_offline_names_the_repo_and_the_node(tmp_path, monkeypatch):
    from pagedserve.cluster.cli.args import resolve_model_or_exit
    from pagedserve.config import EngineConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(OSError) as e:
        fetch_model("pagedserve-tests/absent")
    msg = str(e.value)
    assert "pagedserve-tests/absent" in msg and socket.gethostname() in msg and "HF_HUB_OFFLINE=1" in msg
    assert str(tmp_path / "empty-hub") in msg
    with pytest.raises(SystemExit) as e:  # the CLI: one line, before anything starts
        resolve_model_or_exit(EngineConfig(model="pagedserve-tests/absent"))
    assert "--model 'pagedserve-tests/absent'" in str(e.value) and socket.gethostname() in str(e.value)


def test_offline_snapshot_without_weights_checks_but_does_not_load(tiny, tmp_path, monkeypatch):
    # What the driver leaves on its node: the config and tokenizer, no weights.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_cache(tmp_path / "hub", tiny, only=set(CONFIG_FILES))
    assert fetch_model(REPO, download_dir=str(tmp_path / "hub"), config_only=True).revision == COMMIT
    with pytest.raises(OSError) as e:
        fetch_model(REPO, download_dir=str(tmp_path / "hub"))
    assert "model.safetensors" in str(e.value) and REPO in str(e.value) and socket.gethostname() in str(e.value)


def test_cli_keeps_a_repo_id_as_the_source_pinned_to_its_commit(tiny, tmp_path, monkeypatch):
    """--download-dir is the node's hub cache; the driver checks the config there, and
    what goes to the engine is the repo id at the commit found, not a driver-local path."""
    from pagedserve.cluster.cli.args import engine_config_from_args, resolve_model_or_exit
    from pagedserve.cluster.cli.main import build_parser

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_cache(tmp_path / "hub", tiny)
    args = build_parser().parse_args(["serve", "--model", REPO, "--download-dir", str(tmp_path / "hub")])
    cfg = resolve_model_or_exit(engine_config_from_args(args))
    assert (cfg.model, cfg.revision, cfg.download_dir) == (REPO, COMMIT, str(tmp_path / "hub"))
    assert (cfg.model_root, cfg.served_model_name) == (REPO, REPO)
    local = resolve_model_or_exit(engine_config_from_args(build_parser().parse_args(["serve", "--model", tiny])))
    assert (local.model, local.revision) == (tiny, None)  # a local path: the driver's, as before


def test_a_serve_config_pins_a_repo_id_where_the_app_is_built(tiny, tmp_path, monkeypatch):
    """`serve deploy`: the app builder pins the repo id to its commit once, so replicas
    Serve starts later (a scale-up, a replacement) load the same files as the first."""
    from pagedserve.cluster.app import pinned_model
    from pagedserve.config import EngineConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_cache(tmp_path / "hub", tiny, only=set(CONFIG_FILES))
    cfg = pinned_model(EngineConfig(model=REPO, download_dir=str(tmp_path / "hub")))
    assert (cfg.model, cfg.revision) == (REPO, COMMIT)
    assert pinned_model(EngineConfig(model=tiny)).revision is None  # a local path stays as it is


# ---------------------------------------------------------------------------- s3:// through a real endpoint
@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on 127.0.0.1, and the environment pyarrow (and boto3) read:
    the endpoint and fake credentials. Yields a boto3 client for the uploads."""
    pytest.importorskip("moto.server")
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in dict(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="testing",
                         AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                         AWS_EC2_METADATA_DISABLED="true").items():
            mp.setenv(k, v)
        client = boto3.client("s3")
        client.create_bucket(Bucket="models")
        yield client
    server.stop()


def upload(s3, model_dir: str, prefix: str, extra: dict[str, bytes] | None = None) -> str:
    files = {**model_files(model_dir), **(extra or {})}
    for name, data in files.items():
        s3.put_object(Bucket="models", Key=f"{prefix}/{name}", Body=data)
    return f"s3://models/{prefix}"


# What a fetch must never take: pickled weights, and a second copy of the weights.
JUNK = {"pytorch_model.bin": b"pickle", "original/consolidated.safetensors": b"second copy"}


def test_s3_uri_is_mirrored_once_and_loads_as_the_local_path(tiny, reference, s3, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    uri = upload(s3, tiny, "tiny-llama", JUNK)
    tokens, config = greedy(uri)
    assert tokens == reference
    assert (config.model, config.revision) == (uri, None)  # the workers got the URI, not a path
    whole = object_store_dir(uri)
    assert whole.startswith(str(tmp_path / "cache" / "object-store"))
    assert model_files(whole) == model_files(tiny) and sorted(os.listdir(whole)) == sorted(model_files(tiny))
    # The engine read the config subset first (its tokenizer, the model's shape): no weights there.
    assert set(os.listdir(whole + ".config")) == set(model_files(tiny)) - {"model.safetensors"}
    again = fetch_model(uri)
    assert (again.path, again.fetched, again.revision) == (whole, False, None)
    assert fetch_model(uri, config_only=True).path == whole  # the whole copy serves a config read too


def test_sharded_checkpoint_takes_the_shards_its_index_names(tiny, reference, s3, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(tiny, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    src = tmp_path / "sharded"
    src.mkdir()
    for name, data in model_files(tiny).items():
        if name != "model.safetensors":
            (src / name).write_bytes(data)
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(src / shard), metadata={"format": "pt"})
    (src / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {k: s for s, ks in shards.items()
                                                                            for k in ks}}))
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    uri = upload(s3, str(src), "sharded", {"consolidated.safetensors": b"second copy", **JUNK})
    tokens, _ = greedy(uri)
    assert tokens == reference
    assert sorted(os.listdir(object_store_dir(uri))) == sorted(os.listdir(src))


def test_missing_prefix_is_an_error_naming_the_uri_and_the_node(s3, tmp_path, monkeypatch):
    from pagedserve.cluster.cli.args import resolve_model_or_exit
    from pagedserve.config import EngineConfig

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(OSError) as e:
        fetch_model("s3://models/absent")
    assert "s3://models/absent" in str(e.value) and socket.gethostname() in str(e.value)
    with pytest.raises(SystemExit) as e:
        resolve_model_or_exit(EngineConfig(model="s3://models/absent"))
    assert "--model 's3://models/absent'" in str(e.value)
    assert not os.path.exists(object_store_dir("s3://models/absent"))


# A process that fetches ``uri`` when the file ``go`` appears, its copy slowed down
# (``delay`` s after each file, ``copied`` touched) so that processes overlap in it.
FETCH_SCRIPT = r"""
import json, logging, os, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from pagedserve.worker.loading import model_fetch
uri, ready, go, delay, copied = sys.argv[1:6]
copy = model_fetch._copy_file
def slow_copy(*args):
    copy(*args)
    open(copied, "a").close()
    time.sleep(float(delay))
model_fetch._copy_file = slow_copy
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.01)
f = model_fetch.fetch_model(uri)
print(json.dumps(dict(path=f.path, fetched=f.fetched)))
"""


def start_fetchers(n: int, uri: str, tmp_path: Path, delay: float) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", FETCH_SCRIPT, uri, str(tmp_path / f"ready-{i}"),
                               str(tmp_path / "go"), str(delay), str(tmp_path / "copied")],
                              cwd=tmp_path, env=dict(os.environ), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(n)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{i}").exists() for i in range(n)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.05)
    (tmp_path / "go").touch()
    return procs


def test_processes_resolving_one_uri_at_once_make_one_copy(tiny, s3, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    uri = upload(s3, tiny, "raced")
    procs = start_fetchers(3, uri, tmp_path, delay=0.3)
    results, logs = [], []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
        logs.append(err)
    assert [r["fetched"] for r in results].count(True) == 1, (results, logs)
    assert len({r["path"] for r in results}) == 1
    assert model_files(results[0]["path"]) == model_files(tiny)
    # The race took place: the others came while the copy ran, and waited for it.
    assert sum("is fetching it; waiting" in err for err in logs) >= 1, logs


def test_a_copy_cut_short_is_never_taken_for_the_model(tiny, s3, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    uri = upload(s3, tiny, "interrupted")
    whole = object_store_dir(uri)
    # A process killed in the middle of its copy (a node's worker lost mid-download).
    (proc,) = start_fetchers(1, uri, tmp_path, delay=60)
    deadline = time.monotonic() + 120
    while not (tmp_path / "copied").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    parent = Path(whole).parent
    partial = [p for p in parent.iterdir() if p.name.startswith(f".tmp-{Path(whole).name}-")]
    assert not os.path.exists(whole) and len(partial) == 1 and len(os.listdir(partial[0])) >= 1
    # A copy that fails (a lost connection) leaves nothing behind either.
    calls = []

    def failing_copy(*args):
        calls.append(args)
        if len(calls) == 3:
            raise OSError("connection reset")
        return copy(*args)

    copy = model_fetch._copy_file
    monkeypatch.setattr(model_fetch, "_copy_file", failing_copy)
    with pytest.raises(OSError, match="connection reset"):
        fetch_model(uri)
    assert not os.path.exists(whole)
    assert not [p for p in parent.iterdir() if p.name.startswith(".tmp-")]  # the killed one's too
    monkeypatch.setattr(model_fetch, "_copy_file", copy)
    fetched = fetch_model(uri)
    assert (fetched.path, fetched.fetched) == (whole, True)
    assert model_files(whole) == model_files(tiny)


# ---------------------------------------------------------------------------- two nodes, a cache each
@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_nodes_each_fetch_their_own_copy_before_their_workers_load(tiny, reference, s3, tmp_path, monkeypatch):
    """``pagedserve serve --ray-address`` as on a ``ray up`` cluster, with ``--model s3://...``
    and one TP=2 replica whose placement group spans two worker nodes (PACK, 2 CPUs a node):
    rank 1's node has nothing of the model but what its worker fetches there. The KV
    router's front, on the head, reads the tokenizer from the head's own copy."""
    import httpx
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    from pagedserve.cluster.ray_utils import cluster_view, shutdown_ray
    from pagedserve.loadtest.harness.servers import free_port, pagedserve_server

    uri = upload(s3, tiny, "cluster-tiny", JUNK)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep 127.0.0.x (cluster/ray_utils.py)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    # Each node's cache is its raylet's PAGEDSERVE_CACHE; a driver's would travel to the
    # replicas with the app (cluster/app.py ENGINE_ENV) and make them share one.
    monkeypatch.delenv("PAGEDSERVE_CACHE", raising=False)
    nodes = {"127.0.0.2": tmp_path / "node-a", "127.0.0.3": tmp_path / "node-b"}
    store = 150 << 20
    head = tmp_path / "head"
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=0, node_ip_address="127.0.0.1", include_dashboard=False, object_store_memory=store,
        env_vars={"PAGEDSERVE_CACHE": str(head)}))
    srv = None
    try:
        for i, (ip, cache) in enumerate(nodes.items()):
            cluster.add_node(num_cpus=2, node_ip_address=ip, resources={f"node_{i}": 1},
                             object_store_memory=store, env_vars={"PAGEDSERVE_CACHE": str(cache)})
        srv = pagedserve_server(uri, port=free_port(), log_dir=tmp_path / "logs", ray_address=cluster.address,
                                tensor_parallel_size=2, placement_group_strategy="PACK", device="cpu",
                                dtype="float32", max_model_len=256, kv_cache_memory="16MiB", max_num_seqs=4,
                                num_threads=1, served_model_name="model", request_router="kv")
        # The driver's node: its own cache (HOME), which must get the config subset only.
        srv.env["HOME"] = str(tmp_path / "driver")
        srv.start(timeout=600)
        got = []
        for prompt_ids, _ in reference:
            r = httpx.post(f"{srv.base_url}/v1/completions", timeout=120, json=dict(
                model="model", prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                return_token_ids=True))
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
        # A text prompt has the front load its tokenizer (on its first such request, then
        # in the background): from the head's copy of the config subset.
        deadline = time.monotonic() + 120
        while not os.path.isdir(object_store_dir(uri, str(head)) + ".config"):
            assert time.monotonic() < deadline, srv.tail()
            httpx.post(f"{srv.base_url}/v1/completions", timeout=120,
                       json=dict(model="model", prompt=PROMPTS[0], max_tokens=1)).raise_for_status()
            time.sleep(1)
        view = cluster_view(cluster.address)
    finally:
        if srv is not None:
            srv.stop()
        shutdown_ray()
        cluster.shutdown()
    assert got == [out for _, out in reference]
    workers = [a["node"] for a in view["actors"] if a["cls"].endswith("RayWorkerWrapper") and a["state"] == "ALIVE"]
    assert sorted(workers) == sorted(nodes), view["actors"]  # the premise: one rank on each node
    for ip, cache in nodes.items():
        whole = object_store_dir(uri, str(cache))
        assert model_files(whole) == model_files(tiny), ip  # each node its own whole copy
    for name, cache in ("driver", tmp_path / "driver" / ".cache" / "pagedserve"), ("head", head):
        subset = object_store_dir(uri, str(cache))  # the config and tokenizer, never the weights
        assert not os.path.exists(subset) and "model.safetensors" not in os.listdir(subset + ".config"), name
