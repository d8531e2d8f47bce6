"""Tensor parallelism over Ray: two worker actors (gloo all-reduce on CPU), driven by
RayExecutor's per-step plan broadcast (ZMQ), give greedy tokens identical to the
single-process engine and to Hugging Face transformers on the same weights.

Two shapes: GQA 2:1 (each rank holds one KV head) and Qwen2 (qkv bias, tied
embeddings: the vocab-parallel embedding doubles as the LM head).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.loading.random_models import make_test_model

SHAPES = ["llama-gqa2-hd64", "qwen2-tied"]
PROMPT_LENS = [1, 7, 16, 33, 90]
MAX_TOKENS = 20


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(99)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def _hf_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = GenerationConfig(max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    refs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
            refs.append(out[0, len(ids):].tolist())
    return refs


def _engine_greedy(path: str, prompts, tp: int, async_scheduling: bool = False, speculative_config=None):
    from pagedserve.cluster.llm import LLM

    llm = LLM(model=path, tensor_parallel_size=tp, dtype="float32", max_model_len=256,
              num_gpu_blocks_override=128, max_num_seqs=8, async_scheduling=async_scheduling,
              speculative_config=speculative_config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        executor = llm.engine.executor
        return [o.outputs[0].token_ids for o in outs], executor, llm.engine.get_stats()
    finally:
        llm.shutdown()


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


# The async case sends a step's plan while the previous one runs; the last one drafts
# (speculative decoding: steps in turn while drafting, planned ahead otherwise).
@pytest.mark.parametrize("shape,async_scheduling,spec", [
    (SHAPES[0], False, None), (SHAPES[1], True, None), (SHAPES[1], True, SPEC)])
def test_tp2_on_ray_matches_tp1_and_transformers(shape, async_scheduling, spec, ray_session, tmp_path_factory):
    from pagedserve.cluster.executors.ray_executor import RayExecutor

    path = make_test_model(shape, tmp_path_factory.getbasetemp() / "tp-models")
    prompts = _prompts(512)
    refs = _hf_greedy(path, prompts)
    tp1, ex1, _ = _engine_greedy(path, prompts, tp=1)
    tp2, ex2, stats = _engine_greedy(path, prompts, tp=2, async_scheduling=async_scheduling, speculative_config=spec)
    if spec is not None:
        assert stats.spec_num_accepted_tokens > 0  # drafts were verified on both ranks
    assert not isinstance(ex1, RayExecutor)
    assert isinstance(ex2, RayExecutor)
    assert ex2.workers == []  # shut down: the actors were killed and the group released
    for i, (r, a, b) in enumerate(zip(refs, tp1, tp2)):
        assert a == r, f"tp=1 differs from transformers on prompt {i} (len {len(prompts[i])})"
        assert b == r, f"tp=2 differs from transformers on prompt {i} (len {len(prompts[i])})"


def test_one_worker_actor_at_tp1_matches_the_in_process_engine(ray_session, tmp_path_factory):
    """--distributed-executor-backend ray at TP=1: the worker steps in an actor of its own
    (outside the serving process's GIL), with the in-process engine's tokens."""
    import os

    import ray

    from pagedserve.cluster.executors.ray_executor import RayExecutor
    from pagedserve.cluster.llm import LLM
    from pagedserve.config import EngineConfig

    path = make_test_model(SHAPES[0], tmp_path_factory.getbasetemp() / "tp-models")
    prompts = _prompts(512)
    want, _, _ = _engine_greedy(path, prompts, tp=1)
    llm = LLM(model=path, dtype="float32", max_model_len=256, num_gpu_blocks_override=128, max_num_seqs=8,
              distributed_executor_backend="ray")
    try:
        ex = llm.engine.executor
        assert isinstance(ex, RayExecutor) and len(ex.workers) == 1
        assert ray.get(ex.workers[0].__ray_call__.remote(lambda self: os.getpid())) != os.getpid()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="'uni' runs tensor_parallel_size 1 only"):
        EngineConfig(model=path, tensor_parallel_size=2, distributed_executor_backend="uni")


def test_ray_executor_places_one_worker_per_bundle(ray_session, tmp_path_factory):
    """Two worker actors, each in its own bundle of one placement group; the KV pool is
    the minimum over ranks; the dispatch channel is opened on the first step."""
    import ray
    from ray.util.placement_group import placement_group_table

    from pagedserve.cluster.executors.ray_executor import RayExecutor
    from pagedserve.config import EngineConfig

    path = make_test_model("llama-gqa2-hd64", tmp_path_factory.getbasetemp() / "tp-models")
    ex = RayExecutor(EngineConfig(model=path, tensor_parallel_size=2, dtype="float32", device="cpu",
                                  kv_cache_memory_bytes=1 << 20))
    try:
        table = placement_group_table(ex.placement_group)
        assert table["state"] == "CREATED" and len(table["bundles"]) == 2
        assert all(b == {"CPU": 1.0} for b in table["bundles"].values())
        pids = ray.get([w.__ray_call__.remote(lambda self: __import__("os").getpid())
                        for w in ex.workers])
        assert len(set(pids)) == 2  # two processes, one per rank
        # 1 MiB per rank of fp32 KV: 2 layers x 2 (K,V) x 1 KV head/rank x 64 dims x 4 B
        # = 1 KiB per token -> 64 blocks of 16 tokens on each rank.
        assert ex.determine_num_available_blocks() == 64
        assert ex._bcast is None  # the plan channel opens on the first step
    finally:
        ex.shutdown()


@pytest.mark.scenarios  # under -m scenarios (pyproject.toml), not the default run
def test_serve_replica_with_tp2_workers_in_its_placement_group(serve_url, serve_model):
    """An engine replica at tensor_parallel_size 2 under Serve: the replica reserves one
    placement group (one bundle per rank, the replica's CPUs added to rank 0's), its
    RayExecutor puts the two worker actors into that group, and the served greedy tokens
    equal the offline TP=1 engine's."""
    import httpx
    from ray import serve
    from ray.util.placement_group import placement_group_table

    from pagedserve.cluster.llm import LLM
    from pagedserve.cluster.app import build_app
    from pagedserve.config import EngineConfig

    prompt = [5, 17, 99, 3, 250, 41, 8]
    llm = LLM(model=serve_model, dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    ref = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()

    cfg = EngineConfig(model=serve_model, tensor_parallel_size=2, dtype="float32", max_model_len=256,
                       num_gpu_blocks_override=64, max_num_seqs=4)
    serve.run(build_app(cfg, engine_num_cpus=0.5), name="tp2-serve", route_prefix="/tp2")
    try:
        r = httpx.post(f"{serve_url}/tp2/v1/completions", timeout=60, json=dict(
            prompt=prompt, max_tokens=16, temperature=0, ignore_eos=True, return_token_ids=True))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == ref
        live = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        groups = [g for g in live if len(g["bundles"]) == 2]
        assert len(groups) == 1  # the replica's own group, and the executor made none of its own
        assert [b for _, b in sorted(groups[0]["bundles"].items())] == [{"CPU": 1.5}, {"CPU": 1.0}]
    finally:
        serve.delete("tp2-serve")


@pytest.mark.scenarios  # under -m scenarios (pyproject.toml), not the default run
def test_tp2_contains_a_failing_step_and_a_rank_out_of_step_ends_the_engine(tmp_path_factory, monkeypatch):
    """Both ranks raise on the poisoned step and roll it back: the step is re-run in parts
    on both, the poison fails alone and the others keep TP=2's own tokens. A failure on
    rank 1 only (rank 0 then waits in the all-reduce) is the group out of step: dead."""
    from pagedserve.cluster.executors import zmq_dispatch
    from pagedserve.cluster.wire.failures import ExecutorDeadError
    from pagedserve.cluster.llm import LLM
    from fault_plugin import PLUGINS_ENV, PLUGIN_PATH, marker

    path = make_test_model(SHAPES[0], tmp_path_factory.getbasetemp() / "tp-fault-models")
    prompts = _prompts(512)[:4]
    monkeypatch.setenv(PLUGINS_ENV, PLUGIN_PATH)  # passed on to the worker actors
    monkeypatch.setattr(zmq_dispatch, "AGREE_TIMEOUT_S", 3.0)
    llm = LLM(model=path, tensor_parallel_size=2, dtype="float32", max_model_len=256,
              num_gpu_blocks_override=128, max_num_seqs=8, async_scheduling=True)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        poison = SamplingParams(temperature=0.0, max_tokens=4, stop=[marker("step")])
        outs = llm.generate(prompts[:2] + [[5, 6, 7]] + prompts[2:], [params, params, poison, params, params],
                            use_tqdm=False)
        assert outs[2].error is not None and "engine step failed" in outs[2].error
        assert [o.outputs[0].token_ids for o in outs[:2] + outs[3:]] == ref
        assert llm.engine.scheduler.kv_cache_manager.usage == 0.0
        split = SamplingParams(temperature=0.0, max_tokens=4, stop=[marker("one_rank")])
        with pytest.raises(ExecutorDeadError, match="out of step|did not report"):
            llm.generate([prompts[0], [5, 6, 7]], [params, split], use_tqdm=False)
    finally:
        llm.shutdown()
