"""Prompt logprobs, prompt truncation and best_of in the offline engine.

The oracle for prompt logprobs is Hugging Face: log_softmax of its logits on the same
weights, fp32, at every prompt position (position p's logits score token p + 1). The
engine must give the same numbers to 1e-4 however the prompt was computed: in one
prefill, in 32-token chunks, and again after the prompt's blocks went into the prefix
cache (a request that asks never takes hits, so no position is skipped).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.cluster.llm import LLM
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.loading.random_models import make_test_model

TOP = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_test_model("llama-gqa2-hd64", tmp_path_factory.getbasetemp() / "plp-models")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(7)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in (1, 2, 17, 100)]
    refs = []
    for ids in prompts:
        with torch.no_grad():
            refs.append(hf(torch.tensor([ids])).logits[0].float().log_softmax(-1))
    return path, prompts, refs


def _check(out, ids, ref):
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        lp = plp[p]
        row = ref[p - 1]
        assert lp.token_ids[0] == ids[p]
        assert abs(lp.logprobs[0] - row[ids[p]].item()) < 1e-4, p
        assert lp.sampled_rank == int((row > row[ids[p]]).sum()) + 1
        top_lp, top_ids = row.topk(TOP)
        assert lp.token_ids[1:] == top_ids.tolist()
        assert max(abs(a - b) for a, b in zip(lp.logprobs[1:], top_lp.tolist())) < 1e-4


@pytest.mark.parametrize("budget", [512, 32])
def test_prompt_logprobs_equal_hf(model, budget):
    path, prompts, refs = model
    llm = LLM(model=path, max_model_len=256, num_gpu_blocks_override=128, dtype="float32",
              max_num_batched_tokens=budget, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP, detokenize=False)
    # Twice: the second round finds every full prompt block cached, and must not use it.
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out, ids, ref in zip(outs, prompts, refs):
            _check(out, ids, ref)
    # Without prompt_logprobs the same prompt does hit the cache, and has none.
    plain = llm.generate([prompts[-1]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens >= 96
    # n=2: one set of prompt logprobs, the samples unaffected.
    two = llm.generate([prompts[-1]], SamplingParams(n=2, max_tokens=3, temperature=0.0,
                                                     prompt_logprobs=0), use_tqdm=False)[0]
    assert len(two.outputs) == 2 and two.outputs[0].token_ids == two.outputs[1].token_ids
    assert [lp.token_ids for lp in two.prompt_logprobs[1:]] == [[t] for t in prompts[-1][1:]]
    llm.shutdown()


def test_truncate_prompt_tokens_and_best_of(model):
    path, prompts, _ = model
    llm = LLM(model=path, max_model_len=64, num_gpu_blocks_override=64, dtype="float32")
    long = prompts[-1]  # 100 tokens > max_model_len 64
    greedy = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([long], SamplingParams(**greedy), use_tqdm=False)
    got = llm.generate([long], SamplingParams(truncate_prompt_tokens=40, **greedy), use_tqdm=False)[0]
    ref = llm.generate([long[-40:]], SamplingParams(**greedy), use_tqdm=False)[0]
    assert got.prompt_token_ids == long[-40:]
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([long], SamplingParams(truncate_prompt_tokens=65, **greedy), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    # -1: max_model_len tokens, leaving no room for a completion: the length check says so.
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([long], SamplingParams(truncate_prompt_tokens=-1, **greedy), use_tqdm=False)

    # best_of=4, n=2: the two of the four seeded samples with the highest cumulative
    # logprob (the four are the n=4 samples of the same seed: sample i has seed + i).
    sample = dict(temperature=1.0, max_tokens=6, ignore_eos=True, seed=11)
    four = llm.generate([prompts[2]], SamplingParams(n=4, logprobs=0, **sample), use_tqdm=False)[0]
    score = {tuple(c.token_ids): sum(lp.logprobs[0] for lp in c.logprobs) for c in four.outputs}
    want = sorted(score, key=lambda t: -score[t])[:2]
    best = llm.generate([prompts[2]], SamplingParams(n=2, best_of=4, **sample), use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in best.outputs] == want
    assert [c.index for c in best.outputs] == [0, 1]
    assert all(c.logprobs is None for c in best.outputs)  # not asked for
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    llm.shutdown()


def test_prompt_logprobs_survive_preemption(model):
    """A pool too small for the batch preempts requests mid-decode; they recompute their
    prompt (no prefix hits for them) and the prompt logprobs are still HF's, whole."""
    path, prompts, refs = model
    llm = LLM(model=path, max_model_len=256, num_gpu_blocks_override=16, dtype="float32",
              max_num_batched_tokens=64, enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, prompt_logprobs=TOP,
                            detokenize=False)
    long = [prompts[-1], prompts[-1][::-1], prompts[-1][1:] + prompts[-1][:1]]
    outs = llm.generate(long, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for out, ids in zip(outs, long):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        _check(out, ids, ref)
    llm.shutdown()


def test_prompt_logprobs_tensor_parallel_2(model, ray_session):
    """At TP=2 every rank computes the prompt rows (the LM head all-gathers the vocab, a
    collective all ranks must join); rank 0's result carries them, still HF's numbers."""
    path, prompts, refs = model
    llm = LLM(model=path, tensor_parallel_size=2, max_model_len=256, num_gpu_blocks_override=64,
              dtype="float32", max_num_batched_tokens=32)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP, detokenize=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for out, ids, ref in zip(outs, prompts, refs):
        _check(out, ids, ref)
