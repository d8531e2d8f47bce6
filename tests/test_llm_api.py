"""The offline API as a user sees it: seeds, stop strings, n > 1, logprobs, errors,
aborts, and the CLI on the built-in demo model (``--model pagedserve-demo``; the default,
SmolLM2, is tests/test_gguf_model.py's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedserve.cluster.llm import LLM
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.loading.random_models import make_test_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_test_model("llama-mha", tmp_path_factory.getbasetemp() / "api-models")
    engine = LLM(model=path, max_model_len=512, num_gpu_blocks_override=256, max_num_seqs=32)
    yield engine
    engine.shutdown()


def _assert_pool_empty(llm: LLM):
    stats = llm.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_seeded_sample_same_alone_and_in_a_batch(llm):
    target = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["the same prompt"], target, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7 + 0.05 * i, max_tokens=8 + i, ignore_eos=True,
                             seed=None if i % 2 else i) for i in range(16)]
    prompts = [f"other prompt number {i}" for i in range(16)]
    prompts.insert(5, "the same prompt")
    others.insert(5, target)
    batched = llm.generate(prompts, others, use_tqdm=False)[5].outputs[0].token_ids
    assert len(alone) == 24
    assert alone == batched
    # A different seed gives a different sample (24 tokens at temperature 1: not by chance).
    other_seed = llm.generate(["the same prompt"], target.clone(seed=99), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone
    _assert_pool_empty(llm)


def test_stop_string_is_cut_like_openai(llm):
    base = llm.generate(["tell me a story"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 12
    stop = text[8:11]
    first = text.index(stop)
    out = llm.generate(["tell me a story"], SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                                           ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(["tell me a story"], SamplingParams(
        temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True, ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:first + len(stop)]
    _assert_pool_empty(llm)


def test_n_samples_share_the_prompt_blocks(llm):
    before = llm.stats()["prefix_cache_hits"]
    prompt = list(range(10, 10 + 100))  # 6 full blocks
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different samples
    # Samples 1 and 2 found the 6 full prompt blocks of sample 0 in the prefix cache.
    assert llm.stats()["prefix_cache_hits"] - before >= 2 * 96
    _assert_pool_empty(llm)


def test_logprobs_are_log_softmax_of_the_model(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_ids[0] == tok and lp.sampled_rank == 1  # greedy picks rank 1
        assert len(lp.token_ids) == 4  # sampled + top-3
        assert lp.logprobs[0] == pytest.approx(lp.logprobs[1])
        assert all(a >= b for a, b in zip(lp.logprobs[1:], lp.logprobs[2:]))
        assert all(v <= 0.0 for v in lp.logprobs)


def test_bad_input_is_a_clear_error_and_leaks_nothing(llm):
    with pytest.raises(ValueError, match="maximum context length is 512"):
        llm.generate([[5] * 600], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[5] * 500], SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 512\)"):
        llm.generate([[5, 99999]], SamplingParams(max_tokens=4), use_tqdm=False)
    # A good request right after still works, and nothing was left behind.
    out = llm.generate(["fine"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    _assert_pool_empty(llm)


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("keep", list(range(3, 60)), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("drop", list(range(3, 90)), SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.get_stats().num_free_blocks < engine.get_stats().num_blocks
    engine.abort_request("drop")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert set(done) == {"keep"} and len(done["keep"].outputs[0].token_ids) == 30
    _assert_pool_empty(llm)


def test_cli_generate_on_the_demo_model(tmp_path):
    env = dict(os.environ, PAGEDSERVE_CACHE=os.environ.get("PAGEDSERVE_CACHE", str(tmp_path)))
    # The installed console script, as a user types it.
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "pagedserve"), "generate", "--prompt", "hello", "--max-tokens", "8",
         "--ignore-eos", "--kv-cache-memory", "64MiB", "--model", "pagedserve-demo"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()  # the completion text
    assert "finish_reason=length, tokens=8" in proc.stderr
    assert "KV cache:" in proc.stderr
