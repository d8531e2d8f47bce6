"""Tiny random Llama-family checkpoints for tests and the demo, built offline.

``make_random_llama`` uses transformers' own model classes (so our loader reads exactly
what HF writes), seeded weights, ``save_pretrained(safe_serialization=True)`` and the
offline BPE tokenizer. Weights are drawn wider than HF's default (std 0.02 makes logits
nearly uniform, and greedy near-ties would make a token-exact oracle flaky): with
``initializer_range`` ~0.2-0.3 the top-1/top-2 logit gaps are typically >= 1e-3.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import torch

from worker.tokenizer_build import BOS_ID, EOS_ID, PAD_ID, save_tokenizer

_BASE: dict[str, Any] = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-6,
    initializer_range=0.25, tie_word_embeddings=False,
)

# name -> (arch, config overrides). The acceptance shapes: qwen2-tied, llama-gqa4-hd128, llama-mha.
TEST_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),  # qkv bias + tied embeddings
    "llama-gqa4-hd128": ("llama", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                                       head_dim=128)),
    "llama-mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa2-hd64": ("llama", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)),
    "mistral": ("mistral", dict(sliding_window=None)),
    "llama3-rope": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
}


def _hf_classes(arch: str):
    import transformers as tf
    table = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
             "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
             "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}
    if arch not in table:
        raise ValueError(f"arch must be one of {sorted(table)}, got {arch!r}.")
    return table[arch]


def make_random_llama(path: str | os.PathLike, arch: str = "llama", seed: int = 0,
                      **config_overrides: Any) -> str:
    """Write a random HF checkpoint + tokenizer to ``path`` (overwritten) and return it."""
    cfg_cls, model_cls = _hf_classes(arch)
    kwargs = {**_BASE, **config_overrides}
    kwargs.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    path = os.fspath(path)
    model.save_pretrained(path, safe_serialization=True)
    if model.generation_config is not None:  # plain greedy unless a test asks otherwise
        model.generation_config.save_pretrained(path)
    save_tokenizer(path, config.vocab_size, model_max_length=config.max_position_embeddings)
    return path


def make_test_model(name: str, root: str | os.PathLike) -> str:
    """``TEST_SHAPES[name]`` under ``root/name``, built once and reused (atomic rename)."""
    if name not in TEST_SHAPES:
        raise KeyError(f"unknown test shape {name!r}; known: {sorted(TEST_SHAPES)}.")
    final = os.path.join(os.fspath(root), name)
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(os.fspath(root), exist_ok=True)
    arch, overrides = TEST_SHAPES[name]
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=os.fspath(root))
    try:
        make_random_llama(tmp, arch, **overrides)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
