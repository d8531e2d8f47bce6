"""Sliding-window models (Gemma 2, Gemma 3, and Mistral's window on every layer: one sliding
group) at tensor_parallel_size 2 on the hybrid KV cache, engine end to end: two Ray worker
actors (gloo all-reduce on CPU) each hold their half of the KV heads in the pool's
group_size tensors, and read the per-group block tables and slot mappings that the
scheduler's plan interleaves (scheduler/kv/hybrid.py, worker/step_buffers.py).

One engine per model runs its four prompts in 16-token chunks over a pool too small for all
of them (so requests are preempted and recomputed), then the longest one twice, the second
time from the prefix cache (the full groups' blocks and the sliding groups' window blocks):
greedy tokens equal to transformers' generate() on the same weights, every time.
"""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from test_model_families import _hf_greedy, _model_path, _prompts, model_root  # noqa: F401 (fixture)
from test_sliding_window_families import _path as _sliding_path
from test_sliding_window_families import root  # noqa: F401 (fixture)

NEW_TOKENS = 24


@pytest.mark.slow  # Ray and two worker actors per model
@pytest.mark.scenarios  # so under -m scenarios (pyproject.toml), not the default run
@pytest.mark.parametrize("name, num_blocks", [("gemma2", 12), ("gemma3", 30), ("mistral", 5)])
def test_tp2_hybrid_cache_chunked_preempted_and_a_prefix_hit(name, num_blocks, model_root, root,  # noqa: F811
                                                             ray_session):
    from pagedserve.cluster.executors.ray_executor import RayExecutor
    from pagedserve.scheduler.kv.hybrid import HybridKVCacheManager

    path = _sliding_path(name, root) if name == "mistral" else _model_path(name, model_root)
    prompts = _prompts([3, 17, 33, 40])
    refs = _hf_greedy(path, prompts, NEW_TOKENS)
    llm = LLM(model=path, tensor_parallel_size=2, dtype="float32", max_model_len=128,
              num_gpu_blocks_override=num_blocks, max_num_seqs=8, max_num_batched_tokens=16,
              enable_prefix_caching=True)
    try:
        engine = llm.engine
        assert isinstance(engine.executor, RayExecutor) and len(engine.executor.workers) == 2
        assert isinstance(engine.scheduler.kv_cache_manager, HybridKVCacheManager)
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = engine.get_stats()
        assert first == refs
        assert stats.num_preemptions > 0
        # The 40-token prompt alone (the preempted run's window blocks may have been
        # evicted), then again: a hit of its two full blocks in every group's table.
        for _ in range(2):
            hits = engine.get_stats().prefix_cache_hits
            again = [o.outputs[0].token_ids for o in llm.generate(prompts[-1:], params, use_tqdm=False)]
            assert again == refs[-1:]
        assert engine.get_stats().prefix_cache_hits - hits >= 32
    finally:
        llm.shutdown()
