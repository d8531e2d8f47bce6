"""Gemma 2 and Gemma 3 from GGUF, written here from small random Hugging Face checkpoints as
llama.cpp's convert_hf_to_gguf.py writes them (loadtest/gguf_writer.py): arch "gemma2" /
"gemma3", four norms a layer (attn_norm, post_attention_norm, ffn_norm for the
pre-feedforward one, post_ffw_norm; Gemma 3's attn_q_norm / attn_k_norm), every norm weight
stored as 1 + w, tied embeddings, the soft-caps and the window as metadata, Gemma 3's global
rope base and linear scaling as rope metadata. What the file cannot say is llama.cpp's
constants (worker/loading/gguf_loader.py): the layer pattern (Gemma 2 alternates, Gemma 3
slides 5 layers of 6), the query scale key_length ** -0.5, Gemma 3's local rope base 10,000;
the checkpoints here follow them.

    F32   every tensor is the checkpoint's bit for bit, the norms as (1 + w) - 1 in fp32,
          whose 1 + w the model forms again to the file's bit; the loaded models' parameters
          equal those loaded from the Hugging Face directory, bit for bit; ModelConfig reads
          the same model; greedy tokens equal transformers' generate() on the directory, on
          prompts up to 5 windows long
    Q8_0  the native path (Q8_0 blocks in the GEMMs) decodes as the file dequantized
"""

from __future__ import annotations

import os

import pytest
import torch

from _gguf_helpers import gguf_once
from pagedserve.worker.loading.gguf_loader import iter_gguf_weights
from pagedserve.worker.loading.model_cache import build_once
from pagedserve.worker.loading.random_models import make_random_llama
from pagedserve.worker.model_config import ModelConfig
from test_gguf_families import _cache  # noqa: F401 (autouse: the prepared GGUF directories in this module's cache)
from test_model_families import _engine, _hf_greedy, _prompts, _run

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
             max_position_embeddings=256, head_dim=16, query_pre_attn_scalar=16)  # llama.cpp: key_length ** -0.5
LOCAL, GLOBAL = "sliding_attention", "full_attention"
FAMILIES = {
    "gemma2": ("gemma2", dict(num_hidden_layers=4, sliding_window=12, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0)),
    "gemma3": ("gemma3", dict(num_hidden_layers=6, sliding_window=8, layer_types=[LOCAL] * 5 + [GLOBAL],
                              rope_parameters={LOCAL: dict(rope_type="default", rope_theta=10000.0),
                                               GLOBAL: dict(rope_type="linear", factor=8.0, rope_theta=1000000.0)})),
}
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "gguf-gemma-models"


def _paths(name: str, root) -> tuple[str, str]:
    arch, overrides = FAMILIES[name]
    hf_dir = build_once(os.path.join(os.fspath(root), name),
                        lambda tmp: make_random_llama(tmp, arch, **{**SMALL, **overrides}))
    return hf_dir, gguf_once(hf_dir, root, name, "F32")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_f32_gguf_is_the_checkpoint(name, root):
    from safetensors.torch import load_file

    hf_dir, path = _paths(name, root)
    theirs = load_file(os.path.join(hf_dir, "model.safetensors"))
    ours = dict(iter_gguf_weights(path))
    assert sorted(ours) == sorted(theirs)
    norms = [k for k in theirs if k.endswith("norm.weight")]
    assert len(norms) == 1 + FAMILIES[name][1]["num_hidden_layers"] * (4 if name == "gemma2" else 6)
    for k, w in theirs.items():
        if k in norms:  # stored as 1 + w: what the model computes from it is the file's value
            assert torch.equal(ours[k], (w + 1) - 1) and torch.equal(1 + ours[k], 1 + w), k
        else:
            assert torch.equal(ours[k], w), k


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_f32_gguf_is_the_same_model(name, root):
    from pagedserve.worker.loading.loader import load_model

    hf_dir, path = _paths(name, root)
    cfg = ModelConfig.from_pretrained(path, dtype="float32", max_model_len=MAX_MODEL_LEN)
    ref = ModelConfig.from_pretrained(hf_dir, dtype="float32", max_model_len=MAX_MODEL_LEN)
    assert cfg.architecture == ref.architecture and cfg.gguf_file == path
    for field in ("layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                  "final_logit_softcapping", "rope_theta", "rope_scaling", "local_rope_theta", "local_rope_scaling",
                  "hidden_act", "tie_word_embeddings", "head_dim", "num_key_value_heads"):  # eps: fp32 in a GGUF
        assert getattr(cfg, field) == getattr(ref, field), field
    ours, theirs = (dict(load_model(c).named_parameters()) for c in (cfg, ref))
    assert sorted(ours) == sorted(theirs)
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_f32_gguf_decodes_as_transformers(name, root):
    hf_dir, path = _paths(name, root)
    prompts = _prompts([3, 17, 33, 40])
    refs = _hf_greedy(hf_dir, prompts, 12)
    engine = _engine(path, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True)
    assert engine.model_config.quantization == "gguf"  # the CPU's native GGUF path, F32 tensors as they are
    assert _run(engine, prompts) == refs
    assert _run(engine, prompts[-1:]) == refs[-1:]  # from the prefix cache


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_q8_0_gguf_runs_its_blocks_as_its_dequantized_weights(name, root):
    """Q8_0: the CPU's native path (the blocks in the GEMMs) decodes as the same file
    dequantized at load (--quantization none) on most prompts (the two sum in other orders)."""
    hf_dir, _ = _paths(name, root)
    path = gguf_once(hf_dir, root, name, "Q8_0")
    prompts = _prompts([3, 17, 33, 40])
    native = _run(_engine(path, max_model_len=MAX_MODEL_LEN), prompts)
    dequantized = _run(_engine(path, max_model_len=MAX_MODEL_LEN, quantization="none"), prompts)
    assert sum(a == b for a, b in zip(native, dequantized)) >= 3
