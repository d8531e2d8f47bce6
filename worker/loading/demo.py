"""The built-in demo model, ``--model pagedserve-demo``: fast, with exact known shapes, for
tests and benchmarks (the default model is a real one: worker/loading/model_source.py).

A small Llama (hidden 256, 4 layers, 8 heads / 4 KV heads, vocab 8192, 2048 positions,
fp32, ~7.3M parameters, 29 MB) with deterministic random weights (its text is gibberish) and
the offline BPE tokenizer, written once as a normal HF directory and loaded like any checkpoint:

    $PAGEDSERVE_CACHE/demo-v1/     (default ~/.cache/pagedserve/demo-v1)
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  special_tokens_map.json

Bump ``DEMO_VERSION`` whenever the shape or the recipe changes, so stale caches are
not reused.
"""

from __future__ import annotations

import os

from pagedserve.worker.loading.model_cache import build_once, cache_root

DEMO_MODEL_NAME = "pagedserve-demo"  # the --model name, and the id /v1/models lists
DEMO_VERSION = "demo-v1"
DEMO_CONFIG = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, vocab_size=8192, max_position_embeddings=2048,
)


def demo_model_path() -> str:
    """Path of the demo model directory, building it on first use (a few seconds)."""
    from pagedserve.worker.loading.random_models import make_random_llama  # transformers only when building

    return build_once(os.path.join(cache_root(), DEMO_VERSION),
                      lambda tmp: make_random_llama(tmp, "llama", seed=0, **DEMO_CONFIG))
