"""GGUF checkpoints on small files the gguf writer makes here (loadtest/gguf_writer.py, laid
out as llama.cpp's converter lays them out): our dequantized weights equal transformers' own
GGUF load bit for bit, greedy equals its generate(), TP=2 over gloo equals TP=1 (dequantizing
on load, or from the cached copy), the prepared directory is keyed by the file's hash, model names resolve, and every bad --model is one clear
line and exit code 1 before anything starts. The real default model: test_gguf_model.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from _gguf_helpers import parse_gguf_once, write_foreign_gguf, write_gguf_from_hf
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.loading.gguf_loader import iter_gguf_weights
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.loading.model_source import (DEFAULT_MODEL_NAME, default_model_file, file_sha256,
                                            resolve_model)
from pagedserve.worker.loading.random_models import make_test_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 17, 99, 300, 20, 21, 22, 23], [7], list(range(40, 90)), [260, 261, 3, 3, 3]]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def gguf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def _gguf(root, shape: str, qtype: str) -> str:
    src = make_test_model(shape, root / "hf")
    (root / f"{shape}-{qtype}").mkdir(exist_ok=True)
    out = str(root / f"{shape}-{qtype}" / f"{shape}.{qtype}.gguf")
    return out if os.path.isfile(out) else write_gguf_from_hf(src, out, qtype)


def _hf_gguf(path: str):
    from transformers import AutoModelForCausalLM

    with parse_gguf_once():
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()


def _hf_greedy(hf, prompts) -> list[list[int]]:
    refs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(ids):].tolist())
    return refs


def _greedy(model: str, tp: int = 1, quantization: str | None = None) -> list[list[int]]:
    from pagedserve.cluster.llm import LLM

    llm = LLM(model=model, tensor_parallel_size=tp, dtype="float32", max_model_len=256,
              num_gpu_blocks_override=64, max_num_seqs=8, quantization=quantization)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()


# Llama: q/k rows un-permuted, GQA 2:1, untied head. Qwen2: no permutation, qkv bias, tied.
@pytest.mark.parametrize("shape,qtype", [("llama-gqa2-hd64", "Q8_0"), ("qwen2-tied", "Q4_1")])
def test_weights_and_greedy_equal_transformers_gguf_load(gguf_root, shape, qtype):
    path = _gguf(gguf_root, shape, qtype)
    hf = _hf_gguf(path)
    ours = dict(iter_gguf_weights(path))
    theirs = {k: v for k, v in hf.state_dict().items() if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.architecture, cfg.num_key_value_heads, cfg.tie_word_embeddings, cfg.gguf_file) == (
        type(hf).__name__, hf.config.num_key_value_heads, hf.config.tie_word_embeddings, path)
    assert _greedy(path) == _hf_greedy(hf, PROMPTS)


def test_tp2_over_gloo_equals_tp1_on_a_gguf(gguf_root, ray_session, tmp_path, monkeypatch):
    # SmolLM2-135M has 9 query / 3 KV heads, which 2 ranks cannot split; this file can.
    # Dequantized (--quantization none): TP=2's ranks write the prepared directory's fp32
    # copy on first need and load it; TP=1 then reads the copy, and without the cache
    # (PAGEDSERVE_GGUF_WEIGHT_CACHE=0) dequantizes the GGUF itself. A native run (the CPU
    # default; tests/test_gguf_native.py compares it) writes no copy.
    path = _gguf(gguf_root, "llama-gqa2-hd64", "Q4_1")
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "with-weights"))
    copy = os.path.join(resolve_model(path).path, "dequantized", "model.safetensors")
    _greedy(path, tp=1)
    assert not os.path.exists(copy)
    tp2 = _greedy(path, tp=2, quantization="none")
    assert os.path.isfile(copy)
    assert _greedy(path, tp=1, quantization="none") == tp2
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "gguf-only"))
    monkeypatch.setenv("PAGEDSERVE_GGUF_WEIGHT_CACHE", "0")
    assert _greedy(path, tp=1, quantization="none") == tp2
    assert not os.path.exists(os.path.join(resolve_model(path).path, "dequantized"))
    assert tp2 == _hf_greedy(_hf_gguf(path), PROMPTS)


def test_prepared_directory_is_keyed_by_the_file_hash(gguf_root, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path = _gguf(gguf_root, "llama-gqa2-hd64", "Q8_0")
    first = resolve_model(path)
    digest = file_sha256(path)
    assert os.path.basename(first.path) == f"llama-gqa2-hd64.Q8_0-{digest[:16]}"
    assert (first.served_model_name, first.source) == ("llama-gqa2-hd64.Q8_0", path)
    cfg = json.load(open(os.path.join(first.path, "config.json")))
    assert (cfg["gguf_file"], cfg["gguf_sha256"]) == (path, digest)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(first.path))
    assert "dequantized" not in os.listdir(first.path)  # written only when a load dequantizes
    stamp = os.stat(os.path.join(first.path, "tokenizer.json")).st_mtime_ns
    # The same bytes elsewhere (a directory holding one .gguf): the same entry, re-pointed.
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    copy = shutil.copy(path, copy_dir / os.path.basename(path))
    again = resolve_model(str(copy_dir))
    assert again.path == first.path
    assert os.stat(os.path.join(first.path, "tokenizer.json")).st_mtime_ns == stamp  # not rebuilt
    assert json.load(open(os.path.join(first.path, "config.json")))["gguf_file"] == os.path.abspath(copy)
    # Other bytes under the same name: a new entry.
    write_gguf_from_hf(make_test_model("llama-gqa2-hd64", gguf_root / "hf"), str(copy), "Q4_1")
    assert resolve_model(str(copy)).path != first.path


def test_model_names_resolve_and_an_existing_path_wins(tmp_path, monkeypatch):
    assert resolve_model(None).served_model_name == DEFAULT_MODEL_NAME
    assert resolve_model(DEFAULT_MODEL_NAME).source == default_model_file()
    demo = resolve_model("pagedserve-demo")
    assert demo.served_model_name == "pagedserve-demo" and os.path.isfile(os.path.join(demo.path, "config.json"))
    monkeypatch.chdir(tmp_path)
    local = make_test_model("llama-mha", tmp_path / "x")
    os.rename(local, tmp_path / "pagedserve-demo")
    assert resolve_model("pagedserve-demo").path == "pagedserve-demo"  # the directory, not the built-in
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\)"):
        resolve_model(str(tmp_path / "two"))


def _bad_models(root, tmp_path) -> dict[str, tuple[str, str]]:
    good = open(_gguf(root, "llama-gqa2-hd64", "Q8_0"), "rb").read()
    (tmp_path / "truncated.gguf").write_bytes(good[: len(good) // 2])
    (tmp_path / "header-only.gguf").write_bytes(good[:64])
    (tmp_path / "not-gguf.gguf").write_bytes(b"PK\x03\x04 a zip file")
    write_foreign_gguf(str(tmp_path / "gpt2.gguf"), "gpt2")
    hf = make_test_model("llama-mha", tmp_path / "hf")  # a checkpoint directory, then parts of it
    for name, files in (("config-only", ("config.json",)), ("no-tokenizer", ("config.json", "model.safetensors"))):
        (tmp_path / name).mkdir()
        for f in files:
            shutil.copy(os.path.join(hf, f), tmp_path / name / f)
    return {
        "no-weights": (str(tmp_path / "config-only"), r"no model\.safetensors or model\.safetensors\.index\.json in"),
        "no-tokenizer": (str(tmp_path / "no-tokenizer"), r"no tokenizer in .*--tokenizer"),
        "truncated": (str(tmp_path / "truncated.gguf"), r"truncated\.gguf'?: it is truncated or corrupt"),
        "header-only": (str(tmp_path / "header-only.gguf"), r"it is truncated or corrupt"),
        "not-gguf": (str(tmp_path / "not-gguf.gguf"), r"is not a GGUF file"),
        "unsupported": (str(tmp_path / "gpt2.gguf"), r"is a 'gpt2' model; pagedserve runs the Llama family"),
        "missing": (str(tmp_path / "nope" / "model.gguf"), r"model\.gguf' does not exist"),
    }


@pytest.mark.parametrize("case", ["truncated", "header-only", "not-gguf", "unsupported", "missing", "no-weights",
                                  "no-tokenizer"])
def test_serve_refuses_a_bad_model_with_one_clear_line_and_exit_code_1(gguf_root, tmp_path, case):
    model, message = _bad_models(gguf_root, tmp_path)[case]
    cmd = [sys.executable, "-m", "pagedserve.cluster.cli.main", "serve", "--model", model, "--port", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PAGEDSERVE_CACHE=str(tmp_path / "cache")))
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --model {model!r}: ") and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert __import__("re").search(message, last), last
    assert "ray" not in proc.stderr.lower().replace("array", "")  # refused before Ray started
