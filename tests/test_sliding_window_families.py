"""Sliding windows outside Gemma, as transformers 5 runs them (worker/loading/sliding_window.py):
Mistral's, Mixtral's and Phi-3's on every layer (sliding_window set), Qwen2's and Qwen3's on
the layers from max_window_layers on (use_sliding_window), Qwen3-MoE's on every layer
(use_sliding_window). Each tiny random model has a window of 8, smaller than its prompts
(up to 40 tokens, decoded 24 more), and runs on the hybrid KV cache (one sliding group of
every layer, or a full group and a sliding one): greedy tokens equal to transformers'
generate() all at once then from the prefix cache, in 16-token chunks, and preempted; the
sliding groups hold at most the blocks their window reaches; and transformers' tokens with
the window differ from the same weights' without it, so the window is what ran.
"""

from __future__ import annotations

import os

import pytest

from pagedserve.scheduler.kv.hybrid import HybridKVCacheManager
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.loading.model_cache import build_once
from pagedserve.worker.loading.random_models import make_random_llama
from pagedserve.worker.model_config import ModelConfig
from test_model_families import SMALL, _engine, _hf_greedy, _prompts, _run

WINDOW = 8
FAMILIES = {  # name -> (make_random_llama arch, overrides, the KV cache groups' windows)
    "mistral": ("mistral", dict(sliding_window=WINDOW), (WINDOW,)),
    "mixtral": ("mixtral", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2), (WINDOW,)),
    "phi3": ("phi3", dict(sliding_window=WINDOW), (WINDOW,)),
    "qwen2": ("qwen2", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW,
                            max_window_layers=2), (None, WINDOW)),
    "qwen3": ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), (None, WINDOW)),
    "qwen3-moe": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=WINDOW, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=64), (WINDOW,)),
}
PROMPT_LENS = [3, 17, 33, 40]
NEW_TOKENS = 24


def _path(name: str, root, **extra) -> str:
    arch, overrides, _ = FAMILIES[name]
    suffix = "-".join(f"{k}{v}" for k, v in extra.items())
    return build_once(os.path.join(os.fspath(root), f"{name}{suffix}"),
                      lambda tmp: make_random_llama(tmp, arch, **{**SMALL, **overrides, **extra}))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "sliding-models"


_CASES: dict[str, tuple] = {}


# Mistral (one sliding group) and Qwen2 (a full group and a sliding one) in the default run,
# the other four under -m scenarios (the same two layouts, over other layers).
DEFAULT_RUN = ("mistral", "qwen2")


@pytest.fixture(params=[n if n in DEFAULT_RUN else pytest.param(n, marks=pytest.mark.scenarios) for n in FAMILIES])
def case(request, root):
    name = request.param
    if name not in _CASES:
        path = _path(name, root)
        prompts = _prompts(PROMPT_LENS)
        _CASES[name] = name, path, prompts, _hf_greedy(path, prompts, NEW_TOKENS)
    return _CASES[name]


def test_config_reads_the_windowed_layers(case):
    name, path, _, _ = case
    cfg = ModelConfig.from_pretrained(path, max_model_len=128)
    windows = FAMILIES[name][2]
    assert cfg.max_model_len == 128 and cfg.sliding_window == WINDOW  # no longer capped at the window
    assert cfg.kv_cache_groups().windows == windows
    assert [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)] == (
        [None] * (cfg.num_hidden_layers // 2) + [WINDOW] * (cfg.num_hidden_layers // 2) if windows[0] is None
        else [WINDOW] * cfg.num_hidden_layers)
    short = ModelConfig.from_pretrained(path, max_model_len=WINDOW)  # no row reaches past the window
    assert (short.layer_types, short.sliding_window, short.kv_cache_groups()) == ((), None, None)


def test_all_at_once_then_a_prefix_cache_hit(case):
    _, path, prompts, refs = case
    engine = _engine(path, max_model_len=128, enable_prefix_caching=True)
    assert isinstance(engine.scheduler.kv_cache_manager, HybridKVCacheManager)
    assert _run(engine, prompts, NEW_TOKENS) == refs
    hits = engine.get_stats().prefix_cache_hits
    assert _run(engine, prompts[-1:], NEW_TOKENS) == refs[-1:]  # the 40-token prompt again
    assert engine.get_stats().prefix_cache_hits - hits >= 32  # its two full blocks


def test_chunked_prefill_and_preemption(case):
    name, path, prompts, refs = case
    assert _run(_engine(path, max_model_len=128, max_num_batched_tokens=16), prompts, NEW_TOKENS) == refs
    # Decoding to 64 tokens, a request holds 4 blocks in a full group, 2 in a sliding one.
    engine = _engine(path, max_model_len=128, num_gpu_blocks_override=8 if name.startswith("qwen") else 5,
                     max_num_batched_tokens=32)
    assert _run(engine, prompts, NEW_TOKENS) == refs
    assert engine.get_stats().num_preemptions > 0


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_sliding_groups_hold_the_window_and_the_window_is_what_ran(name, root):
    """Prompts of 30 and 24 tokens decoded 50 more (up to 10 windows): after every step each
    sliding group of each request holds at most 2 blocks (the window's first key's and the
    newest); transformers' tokens differ from those of the same weights with a window past
    the context."""
    path = _path(name, root)
    prompts = _prompts([30, 24], seed=5)
    refs = _hf_greedy(path, prompts, 50)
    engine = _engine(path, max_model_len=128, async_scheduling=False)
    kv = engine.scheduler.kv_cache_manager
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"w-{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        for r in engine.scheduler.running:
            held = kv.held_blocks(r.req_id)
            assert all(h <= 2 for h, w in zip(held, kv.windows) if w), (r.req_id, held)
    assert [done["w-0"], done["w-1"]] == refs
    unwindowed = _path(name, root, sliding_window=4096)
    assert _hf_greedy(unwindowed, prompts, 50) != refs
