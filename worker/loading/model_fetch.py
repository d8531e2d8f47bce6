"""Getting a model's files onto this node.

``--model`` may name files that are not on this machine: a Hugging Face repo id or an
object-store URI. Such a source travels as itself (in ``EngineConfig.model``) to every
process that opens the model: the CLI on the driver, the engine replica, each TP worker.
Each calls ``fetch_model`` on its own node just before it reads the files; the first one
on a node copies them, the others find them there:

    org/name              huggingface_hub.snapshot_download into this node's hub cache
                          ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub;
                          --download-dir instead), in the hub's own layout:
                          models--org--name/snapshots/<commit>/
    s3://bucket/prefix    mirrored with pyarrow.fs into
    gs://bucket/prefix    $PAGEDSERVE_CACHE/object-store/<bucket>-<prefix>-<sha256(uri)[:16]>/
                          (--download-dir/object-store/... instead), credentials and endpoint
                          from the environment as pyarrow reads them (AWS_*, GOOGLE_*)

What is fetched is what the engine reads and nothing more: never pickled weights (.bin,
.pth: the loader refuses them), never a second copy of the weights (Mistral's
consolidated.safetensors, Llama's original/):

    config    config.json, generation_config.json, the tokenizer's files, and
              model.safetensors.index.json                (the driver's check, the engine)
    full      config + model.safetensors, or the shards the index names      (the workers)

Once per node: one file lock per source (filelock: an flock, released when its holder
dies) lets one process of a node fetch while the others wait and then find the files.
An object-store copy is written to a temporary directory and renamed into place when
whole, so a copy cut short (a killed process, a lost connection) is never taken for the
model; the next fetch under the lock removes it and copies again. The hub's own
downloads are whole-file (a blob is renamed in when complete; a missing one is fetched
again on the next call).

HF_HUB_OFFLINE=1: the hub is not asked; a repo already in this node's hub cache loads,
a missing one (or one without its weights) is an error naming the repo and the node.
A repo id is pinned to the commit it resolved to (``FetchedModel.revision``), which the
driver and the engine pass on, so every node loads the same files. An object-store copy
is keyed by its URI and never refreshed: publish a changed model under a new prefix.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger("pagedserve")

OBJECT_STORE_SCHEMES = ("s3", "gs")
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                "merges.txt", "chat_template.jinja", "chat_template.json")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
OBJECT_STORE_DIR = "object-store"  # under $PAGEDSERVE_CACHE or --download-dir
# The hub's own check of a repo id (huggingface_hub.utils.validate_repo_id), with the
# namespace required: "name" alone stays a local path or a built-in name.
_REPO_ID = re.compile(r"^\b[\w\-.]+\b/\b[\w\-.]{1,96}\b$")

_announced: set[tuple[str, str]] = set()  # (source, dir) this process has logged


@dataclass(slots=True)
class FetchedModel:
    path: str  # the directory on this node that holds the files
    revision: str | None  # the commit a repo id resolved to; None for a URI
    fetched: bool  # this call copied files onto the node (False: they were here already)


def is_object_store_uri(model) -> bool:
    return isinstance(model, str) and "://" in model and \
        model.split("://", 1)[0].lower() in OBJECT_STORE_SCHEMES


def is_hf_repo_id(model) -> bool:
    return isinstance(model, str) and bool(_REPO_ID.match(model)) and ".." not in model \
        and "--" not in model and not model.endswith(".gguf") and not os.path.exists(model)


def is_remote(model) -> bool:
    """``model`` names files a node may not have (a repo id or a URI), not a local path."""
    return model is not None and not os.path.exists(model) and (is_object_store_uri(model) or is_hf_repo_id(model))


def node_name() -> str:
    return socket.gethostname()


def local_model_path(model, revision: str | None = None, download_dir: str | None = None,
                     config_only: bool = False):
    """``model`` as this process opens it: a remote source fetched onto this node first,
    anything else (a local path, None) as it is."""
    if not is_remote(model):
        return model
    return fetch_model(model, revision, download_dir, config_only).path


def fetch_model(source: str, revision: str | None = None, download_dir: str | None = None,
                config_only: bool = False) -> FetchedModel:
    """Bring ``source`` (a repo id or an s3:// / gs:// URI) onto this node, once per node;
    ``config_only``: only what describes the model (config, tokenizer), not its weights."""
    if is_object_store_uri(source):
        if revision is not None:
            raise ValueError(f"revision {revision!r} names a Hugging Face commit; {source!r} has none.")
        return _fetch_object_store(source, download_dir, config_only)
    if is_hf_repo_id(source):
        return _fetch_hf(source, revision, download_dir, config_only)
    raise ValueError(f"{source!r} is neither a Hugging Face repo id (org/name) nor an object-store "
                     f"URI ({', '.join(s + '://' for s in OBJECT_STORE_SCHEMES)}).")


# ---------------------------------------------------------------- Hugging Face hub
def hf_cache_dir(download_dir: str | None = None) -> str:
    """This node's hub cache: the hub's own rule, read now (not when huggingface_hub was
    imported), so a process's environment decides."""
    if download_dir:
        return os.path.expanduser(os.fspath(download_dir))
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return os.path.expanduser(env["HF_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def hf_offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _fetch_hf(repo_id: str, revision: str | None, download_dir: str | None, config_only: bool) -> FetchedModel:
    from huggingface_hub import snapshot_download

    cache_dir = hf_cache_dir(download_dir)
    offline = hf_offline()
    what = repo_id + (f"@{revision}" if revision else "")
    folder = "models--" + repo_id.replace("/", "--")  # the hub's name for the repo's cache entry
    snapshots = os.path.join(cache_dir, folder, "snapshots")
    with _node_lock(os.path.join(cache_dir, ".locks", folder + ".pagedserve.lock"), what):
        before = _files_under(snapshots)
        try:
            kw = dict(revision=revision, cache_dir=cache_dir, local_files_only=offline)
            path = snapshot_download(repo_id, allow_patterns=[*CONFIG_FILES, INDEX_FILE], **kw)
            if not config_only:
                path = snapshot_download(repo_id, allow_patterns=[*CONFIG_FILES, INDEX_FILE,
                                                                  *map(glob.escape, _weight_files(path))], **kw)
        except Exception as e:  # the hub's errors: not found, gated, offline and not cached, network
            where = f"node {node_name()}'s hub cache {cache_dir}"
            if offline:
                raise OSError(f"model {what!r} is not a local path, and HF_HUB_OFFLINE=1 and the repo is "
                              f"not in {where} (put it there first, e.g. `hf download {repo_id}` on that "
                              f"node): {type(e).__name__}: {e}") from e
            raise OSError(f"model {what!r} is not a local path, and the Hugging Face repo could not be "
                          f"fetched into {where}: {type(e).__name__}: {e}") from e
        try:
            _check_complete(path, config_only)
        except (OSError, ValueError) as e:
            hint = " (HF_HUB_OFFLINE=1: fetch it on that node with the hub reachable)" if offline else ""
            raise OSError(f"model {what!r} on node {node_name()}: {e}{hint}") from None
        fetched = bool(_files_under(snapshots) - before)
    _announce(what, path, fetched, "the Hugging Face hub")
    return FetchedModel(path, os.path.basename(os.path.normpath(path)), fetched)


def _files_under(root: str) -> set[str]:
    return {os.path.join(d, f) for d, _, files in os.walk(root) for f in files} if os.path.isdir(root) else set()


# ---------------------------------------------------------------- object stores
def object_store_dir(uri: str, download_dir: str | None = None) -> str:
    """Where this node keeps its copy of ``uri`` (whole; ``+ ".config"``: the config subset)."""
    from pagedserve.worker.loading.model_cache import cache_root

    scheme, rest = uri.split("://", 1)
    readable = re.sub(r"[^\w.-]+", "-", rest.split("?", 1)[0].strip("/"))[:80]
    key = f"{scheme.lower()}-{readable}-{hashlib.sha256(uri.encode()).hexdigest()[:16]}"
    return os.path.join(os.path.expanduser(download_dir or cache_root()), OBJECT_STORE_DIR, key)


def _fetch_object_store(uri: str, download_dir: str | None, config_only: bool) -> FetchedModel:
    final = object_store_dir(uri, download_dir)
    target = final + ".config" if config_only else final
    # A directory at either name is whole (renamed into place only once complete).
    found = final if os.path.isdir(final) else target if os.path.isdir(target) else None
    if found is None:
        root, key = os.path.split(final)
        with _node_lock(os.path.join(root, ".locks", key + ".lock"), uri):
            found = final if os.path.isdir(final) else target if os.path.isdir(target) else None
            if found is None:
                num_files, num_bytes = _mirror(uri, target, config_only)
                size = f"{num_bytes / 2**20:.1f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.0f} KiB"
                _announce(uri, target, True, f"the object store ({num_files} files, {size})")
                return FetchedModel(target, None, True)
    _announce(uri, found, False, "the object store")
    return FetchedModel(found, None, False)


def _mirror(uri: str, target: str, config_only: bool) -> tuple[int, int]:
    """Copy what the engine reads of ``uri`` into ``target``: via a temporary directory
    beside it, renamed into place when every file has its listed size. Runs under the
    node's lock, so any temporary directory of this key is a dead process's, removed."""
    import pyarrow.fs as pafs

    parent, key = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(parent, glob.escape(f".tmp-{key}-") + "*")):
        shutil.rmtree(stale, ignore_errors=True)
    try:
        fs, base = pafs.FileSystem.from_uri(uri)
        listing = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        sizes = {os.path.relpath(i.path, base): i.size for i in listing if i.type == pafs.FileType.File}
        if not sizes:
            raise FileNotFoundError(f"no files under {uri}")
        if "config.json" not in sizes:
            raise FileNotFoundError(f"no config.json under {uri}")
        weights: list[str] = []
        if not config_only:
            if INDEX_FILE in sizes:
                with fs.open_input_stream(f"{base}/{INDEX_FILE}") as f:
                    weights = _shards_of(json.loads(f.read()), uri)
            elif SINGLE_FILE in sizes:
                weights = [SINGLE_FILE]
            else:
                raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} under {uri} (pagedserve "
                                        "loads safetensors weights only)")
        missing = [n for n in weights if n not in sizes]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} under {uri} names {missing[0]}, which is not there")
        names = [n for n in (*CONFIG_FILES, INDEX_FILE) if n in sizes] + weights
        tmp = tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=parent)
        try:
            local = pafs.LocalFileSystem()
            for name in names:
                dst = os.path.join(tmp, name)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                _copy_file(fs, f"{base}/{name}", local, dst)
                if os.path.getsize(dst) != sizes[name]:
                    raise OSError(f"{uri}/{name}: copied {os.path.getsize(dst)} bytes of {sizes[name]}")
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except OSError as e:  # pyarrow's errors are OSErrors: no credentials, no bucket, network
        raise OSError(f"model {uri!r}: cannot copy it onto node {node_name()}: {e}") from e
    return len(names), sum(sizes[n] for n in names)


def _copy_file(fs, src: str, local, dst: str) -> None:
    import pyarrow.fs as pafs

    pafs.copy_files(src, dst, source_filesystem=fs, destination_filesystem=local)


# ---------------------------------------------------------------- shared
def _shards_of(index: dict, where: str) -> list[str]:
    shards = sorted(set((index.get("weight_map") or {}).values()))
    if not shards or any(os.path.isabs(s) or ".." in s.split("/") for s in shards):
        raise ValueError(f"{where}: {INDEX_FILE} names no usable weight files")
    return shards


def _weight_files(path: str) -> list[str]:
    """The weight files the loader reads from a directory that holds (at least) its
    config subset: the index's shards, else the single file."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            return _shards_of(json.load(f), index)
    return [SINGLE_FILE]


def _check_complete(path: str, config_only: bool) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no config.json in {path}")
    if config_only:
        return
    missing = [f for f in _weight_files(path) if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise FileNotFoundError(f"{path} lacks {', '.join(missing[:3])}"
                                f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''} "
                                "(pagedserve loads safetensors weights only)")


@contextlib.contextmanager
def _node_lock(path: str, what: str) -> Iterator[None]:
    """Held while one process of this node fetches ``what``; the others wait for it."""
    from filelock import FileLock, Timeout

    os.makedirs(os.path.dirname(path), exist_ok=True)
    lock = FileLock(path, thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("model %s: another process on node %s is fetching it; waiting", what, node_name())
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _announce(what: str, path: str, fetched: bool, origin: str) -> None:
    """One line per node when the files were fetched (only the lock holder fetches); one
    per process when they were already here."""
    if fetched:
        logger.info("model %s: fetched from %s onto node %s, into %s", what, origin, node_name(), path)
    elif (what, path) not in _announced:
        logger.info("model %s: on node %s already, in %s", what, node_name(), path)
    _announced.add((what, path))
