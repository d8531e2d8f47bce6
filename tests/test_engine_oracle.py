"""The exactness oracle: greedy output equals Hugging Face ``generate()`` token for token
on the same weights, whatever the scheduler does to the batch.

Three shapes (Qwen2 with qkv bias + tied embeddings; head_dim 128 with GQA 4:1; plain
MHA), 16 prompts of 1..300 tokens with up to 64 new tokens each, and five modes that
exercise different scheduler paths over the same paged KV cache:

    all_at_once   every prompt admitted together (mixed prefill + decode batches)
    staggered     two new requests join every step while others decode
    chunked_32    a 32-token budget: long prompts prefill in chunks inside decode steps
    preempt       a KV pool too small for the batch: preemption by recompute (asserted)
    prefix        prompts share a prefix; the cache serves it (hits asserted)
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.cluster.llm import LLM
from pagedserve.cluster.engine.llm_engine import LLMEngine
from pagedserve.cluster.executors.uniproc import UniProcExecutor
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.worker.loading.random_models import make_test_model

SHAPES = ["qwen2-tied", "llama-gqa4-hd128", "llama-mha"]
PROMPT_LENS = [1, 2, 3, 5, 9, 16, 17, 31, 33, 64, 100, 129, 150, 200, 257, 300]
MAX_TOKENS = [64, 1, 17, 64, 33, 64, 2, 64, 48, 16, 64, 5, 64, 31, 64, 40]
SHARED_PREFIX_LEN = 70  # shared by the prompts of 100+ tokens: 4 full blocks + a partial one


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    prefix = [rng.randrange(3, vocab) for _ in range(SHARED_PREFIX_LEN)]
    prompts = []
    for n in PROMPT_LENS:
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        if n >= 100:
            ids[:SHARED_PREFIX_LEN] = prefix
        prompts.append(ids)
    return prompts


def _params() -> list[SamplingParams]:
    # EOS is honoured (a request may stop early, as HF's does); the comparison covers it.
    return [SamplingParams(temperature=0.0, max_tokens=m, detokenize=False) for m in MAX_TOKENS]


@pytest.fixture(scope="module", params=SHAPES)
def shape_case(request, tmp_path_factory):
    return oracle_case(make_test_model(request.param, tmp_path_factory.getbasetemp() / "oracle-models"))


def oracle_case(path) -> tuple:
    """(path, the 16 prompts, transformers' greedy outputs for them)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size)
    refs = []
    for ids, max_new in zip(prompts, MAX_TOKENS):
        x = torch.tensor([ids])
        cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False,
                               eos_token_id=hf.config.eos_token_id, pad_token_id=0)
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
        refs.append(out[0, len(ids):].tolist())
    return path, prompts, refs


def _engine(path, **overrides) -> LLMEngine:
    cfg = dict(model=path, max_model_len=512, num_gpu_blocks_override=512, max_num_seqs=16,
               max_num_batched_tokens=512)
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg), UniProcExecutor)


def _run(engine: LLMEngine, prompts, params, per_step: int | None = None) -> list[list[int]]:
    ids = [f"r{i}" for i in range(len(prompts))]
    pending = list(zip(ids, prompts, params))
    done: dict[str, list[int]] = {}
    while pending or engine.has_unfinished_requests():
        take = len(pending) if per_step is None else per_step
        for rid, prompt, p in pending[:take]:
            engine.add_request(rid, prompt, p)
        pending = pending[take:]
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[r] for r in ids]


def _assert_same(got, refs):
    for i, (g, r) in enumerate(zip(got, refs)):
        assert g == r, f"prompt {i} (len {PROMPT_LENS[i]}): first mismatch at token " \
                       f"{next(k for k in range(min(len(g), len(r)) + 1) if k >= len(g) or k >= len(r) or g[k] != r[k])}"


def test_all_at_once(shape_case):
    path, prompts, refs = shape_case
    llm = LLM(model=path, max_model_len=512, num_gpu_blocks_override=512, max_num_seqs=16,
              enable_prefix_caching=False)
    outs = llm.generate(prompts, _params(), use_tqdm=False)
    _assert_same([o.outputs[0].token_ids for o in outs], refs)
    eos = llm.engine.eos_token_ids[0]
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == ("stop" if c.token_ids[-1] == eos else "length")


def test_staggered_arrivals(shape_case):
    path, prompts, refs = shape_case
    engine = _engine(path, enable_prefix_caching=False)
    _assert_same(_run(engine, prompts, _params(), per_step=2), refs)


def test_chunked_prefill_budget_32(shape_case):
    path, prompts, refs = shape_case
    engine = _engine(path, max_num_batched_tokens=32, enable_prefix_caching=False)
    _assert_same(_run(engine, prompts, _params()), refs)
    # Every step respected the budget, so a 300-token prompt took >= 10 steps to prefill.
    assert engine.get_stats().step_id >= 300 // 32


def test_preemption_small_pool(shape_case):
    path, prompts, refs = shape_case
    # 24 blocks x 16 = 384 slots: enough for the longest request (300 + 40), far too few
    # for all 16 at once, so running requests get preempted and recomputed.
    engine = _engine(path, num_gpu_blocks_override=24, max_num_batched_tokens=128,
                     enable_prefix_caching=False)
    _assert_same(_run(engine, prompts, _params()), refs)
    stats = engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == 24


def test_prefix_caching_shared_prefix(shape_case):
    path, prompts, refs = shape_case
    engine = _engine(path, enable_prefix_caching=True)
    params = _params()
    # The 150-token prompt first, alone: its blocks are cached when the others arrive.
    first = PROMPT_LENS.index(150)
    got_first = _run(engine, [prompts[first]], [params[first]])
    got = _run(engine, prompts, params)
    _assert_same(got, refs)
    assert got_first[0] == refs[first]
    stats = engine.get_stats()
    # 5 other prompts share 4 full blocks (64 tokens) of prefix, and the 150-token prompt
    # itself is served from cache the second time (up to its last full block).
    assert stats.prefix_cache_hits >= 5 * 64
