"""The built-in demo model: built once into $PAGEDSERVE_CACHE as a normal HF directory,
reused afterwards, and loadable by our loader and by transformers' AutoTokenizer."""

from __future__ import annotations

import os

import torch
import transformers

from pagedserve.worker.loading.demo import DEMO_CONFIG, demo_model_path
from pagedserve.worker.loading.loader import load_model
from pagedserve.worker.model_config import ModelConfig


def test_demo_model_builds_once_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    path = demo_model_path()
    assert path == os.path.join(tmp_path, "demo-v1")
    assert sorted(os.listdir(tmp_path)) == ["demo-v1"]  # no temp dirs left behind
    files = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    stamp = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
    assert demo_model_path() == path
    assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == stamp  # reused, not rebuilt

    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.dtype) == (
        "LlamaForCausalLM", DEMO_CONFIG["hidden_size"], DEMO_CONFIG["num_hidden_layers"], 8192, torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert len(tok) == cfg.vocab_size and tok.eos_token_id in cfg.eos_token_ids
    model = load_model(cfg)
    ids = torch.tensor(tok("hello world").input_ids)
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(len(ids)), None, None))
    assert logits.shape == (len(ids), 8192) and torch.isfinite(logits).all()
