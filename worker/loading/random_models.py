"""Tiny random checkpoints of the families in worker/models for tests and the demo, built offline.

``make_random_llama`` uses transformers' own model classes (so our loader reads exactly
what HF writes), seeded weights, ``save_pretrained(safe_serialization=True)`` and the
offline BPE tokenizer. HF's default init (std 0.02) gives near-uniform logits, and greedy
near-ties would make a token-exact oracle flaky. What matters is the top-1/top-2 gap
relative to the float error between two correct implementations; on the test shapes
(8 prompts x 64 greedy tokens) that error grows much faster than the gaps with the weight
scale, so a small init keeps it far below the gaps. So: std 0.05 inside, the output layer
scaled by ``logit_scale`` (4x) to spread the
logits, random (not zero/one) biases and norm weights.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pagedserve.worker.loading.model_cache import build_once
from pagedserve.worker.loading.tokenizer_build import BOS_ID, EOS_ID, PAD_ID, save_tokenizer

_BASE: dict[str, Any] = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-6,
    initializer_range=0.05, tie_word_embeddings=False,
)

# name -> (arch, config overrides). The acceptance shapes: qwen2-tied, llama-gqa4-hd128, llama-mha.
TIED_LAYER_GAIN = 6.0  # a gain of 3 still mostly repeats; 12 gave greedy near-ties

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
             "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
             "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
             "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM),
             "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
             "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
             "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
             "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
             "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM)}
    if arch not in table:
        raise ValueError(f"arch must be one of {sorted(table)}, got {arch!r}.")
    return table[arch]


def make_random_llama(path: str | os.PathLike, arch: str = "llama", seed: int = 0,
                      logit_scale: float = 4.0, **config_overrides: Any) -> str:
    """Write a random HF checkpoint + tokenizer to ``path`` (overwritten) and return it."""
    cfg_cls, model_cls = _hf_classes(arch)
    kwargs = {**_BASE, **config_overrides}
    kwargs.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    # HF initialises biases to 0 and norm weights to 1; randomise both so a loader that
    # drops a bias or swaps two norms cannot pass the HF comparison by accident.
    g = torch.Generator().manual_seed(seed + 1)
    # Gemma's norms scale by (1 + w): their w is drawn around 0, so the gain is around 1.
    one = 0.0 if arch.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * config.initializer_range)
            elif "norm" in name:
                p.copy_(one + 0.2 * torch.randn(p.shape, generator=g))
        # Small weights inside (float error grows fast with weight scale), logits spread
        # out by the final norm's gain so greedy is decisive (see the module docstring).
        model.model.norm.weight.add_(1.0 - one).mul_(logit_scale).sub_(1.0 - one)
        if config.tie_word_embeddings:
            # Tied, the residual stream ~ the input token's embedding = its own output row,
            # so the model would just repeat its last token. Louder layers break that.
            for name, p in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(TIED_LAYER_GAIN)
    path = os.fspath(path)
    model.save_pretrained(path, safe_serialization=True)
    if model.generation_config is not None:  # plain greedy unless a test asks otherwise
        model.generation_config.save_pretrained(path)
    save_tokenizer(path, config.vocab_size, model_max_length=config.max_position_embeddings)
    return path


def make_test_model(name: str, root: str | os.PathLike) -> str:
    """``TEST_SHAPES[name]`` under ``root/name``, built once and reused."""
    if name not in TEST_SHAPES:
        raise KeyError(f"unknown test shape {name!r}; known: {sorted(TEST_SHAPES)}.")
    arch, overrides = TEST_SHAPES[name]
    return build_once(os.path.join(os.fspath(root), name), lambda tmp: make_random_llama(tmp, arch, **overrides))


# sentence-transformers' module list, as its checkpoints write modules.json (worker/pooler.py reads it).
_ST_MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
_ST_NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
_ST_MODE_KEYS = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}


def make_random_embedder(path: str | os.PathLike, arch: str = "qwen3", pooling: str = "LAST",
                         normalize: bool = True, headless: bool = True, seed: int = 0,
                         config_updates: dict[str, Any] | None = None, **config_overrides: Any) -> str:
    """A random decoder embedding model, as sentence-transformers ships one: the weights of
    the bare decoder (``headless``: transformers' ``<X>Model``, names without ``model.`` and
    no lm_head, as Qwen3-Embedding's; else the ``<X>ForCausalLM`` checkpoint), config.json
    naming ``<X>ForCausalLM`` (Qwen3-Embedding's does), modules.json with its Pooling module
    (``pooling``: LAST / MEAN / CLS) and a Normalize module if ``normalize``.
    ``config_updates``: keys written into config.json as they are (``is_matryoshka``, ...)."""
    import json

    import transformers as tf

    cfg_cls, causal_cls = _hf_classes(arch)
    model_cls = getattr(tf, causal_cls.__name__.replace("ForCausalLM", "Model")) if headless else causal_cls
    kwargs = {**_BASE, **config_overrides}
    kwargs.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # as make_random_llama: no zero bias or unit norm weight passes by accident
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * config.initializer_range)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    path = os.fspath(path)
    model.save_pretrained(path, safe_serialization=True)
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        hf = json.load(f)
    hf.update({"architectures": [causal_cls.__name__], **(config_updates or {})})
    with open(cfg_file, "w") as f:
        json.dump(hf, f, indent=2)
    modules = _ST_MODULES + ([_ST_NORMALIZE] if normalize else [])
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f, indent=2)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    pool_cfg = {"word_embedding_dimension": config.hidden_size, "include_prompt": True,
                **{key: pooling == mode for mode, key in _ST_MODE_KEYS.items()},
                "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
                "pooling_mode_weightedmean_tokens": False}
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump(pool_cfg, f, indent=2)
    if normalize:
        os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    save_tokenizer(path, config.vocab_size, model_max_length=config.max_position_embeddings)
    return path
