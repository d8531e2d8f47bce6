"""The families beyond Llama (worker/models/*.py), each against transformers' generate()
token for token (greedy, fp32) on a tiny random checkpoint that transformers itself
builds, from its own config class, and writes as a Hugging Face directory:

    qwen3       q/k RMSNorm per head before rope; head_dim 32 while hidden 64 / 4 heads = 16
    smollm3     layer 1 of 2 without rope (no_rope_layer_interval 2)
    phi3        fused qkv_proj / gate_up_proj in the checkpoint; LongRoPE (short factors up
                to 64 tokens, long ones past them: both sets tried)
    mixtral     4 experts, top-2, renormalised
    qwen3-moe   8 experts, top-2, not renormalised (norm_topk_prob false); layer 0 dense
                (mlp_only_layers), layer 1 routed
    gemma2      4 layers alternating sliding (window 12) and global, scores and logits
                soft-capped, GeGLU, (1 + w) norms, embeddings x sqrt(hidden), scores x
                query_pre_attn_scalar ** -0.5 (24, not head_dim 16)
    gemma3      4 layers, local (window 8) / local / global / local, q/k norms, the local
                layers' rope base 10,000, the global one's 1,000,000 linear-scaled by 8

Each family runs the engine's paths over the same paged KV cache: everything at once, then
the longest prompt again from the prefix cache; chunked prefill (a 16-token budget); and
preemption (6 KV blocks for 10 blocks' worth of requests). Tensor parallelism 2 (two
processes, gloo) decodes greedily to the same tokens for Qwen3 and Qwen3-MoE.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.multiprocessing as mp

from pagedserve.cluster.engine.llm_engine import LLMEngine
from pagedserve.cluster.executors.uniproc import UniProcExecutor
from pagedserve.config import EngineConfig
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.loading.model_cache import build_once
from pagedserve.worker.loading.random_models import make_random_llama
from pagedserve.worker.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagedserve.worker.models import MODEL_REGISTRY

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.1 * i for i in range(8)],
                long_factor=[1.0 + 0.5 * i for i in range(8)])
LOCAL, GLOBAL = "sliding_attention", "full_attention"
GEMMA = dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24)  # Gemma's config defaults to head_dim 256
FAMILIES = {  # name -> (make_random_llama arch, config overrides)
    "qwen3": ("qwen3", dict(head_dim=32)),
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2)),
    "phi3": ("phi3", dict(original_max_position_embeddings=64, rope_parameters=LONGROPE)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3-moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                    mlp_only_layers=[0], norm_topk_prob=False)),
    "gemma2": ("gemma2", dict(GEMMA, sliding_window=12, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma3": ("gemma3", dict(GEMMA, sliding_window=8, layer_types=[LOCAL, LOCAL, GLOBAL, LOCAL], rope_parameters={
        LOCAL: dict(rope_type="default", rope_theta=10000.0),
        GLOBAL: dict(rope_type="linear", factor=8.0, rope_theta=1000000.0)})),
}
PROMPT_LENS = [3, 17, 33, 40]
MAX_TOKENS = 12  # the longest request: 52 tokens, within Phi-3's 64-token short-factor range
MAX_MODEL_LEN = 64  # so Phi-3 runs its short factors, as transformers does at these lengths


def _model_path(name: str, root) -> str:
    arch, overrides = FAMILIES[name]
    return build_once(os.path.join(os.fspath(root), name),
                      lambda tmp: make_random_llama(tmp, arch, **{**SMALL, **overrides}))


def _prompts(lens, seed=7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, SMALL["vocab_size"]) for _ in range(n)] for n in lens]


def _hf_greedy(path: str, prompts, max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(ids):].tolist())
    return refs


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "family-models"


_CASES: dict[str, tuple] = {}


def _case(name: str, root) -> tuple:
    """(path, prompts, transformers' greedy continuations), built once per family."""
    if name not in _CASES:
        path = _model_path(name, root)
        prompts = _prompts(PROMPT_LENS)
        _CASES[name] = path, prompts, _hf_greedy(path, prompts, MAX_TOKENS)
    return _CASES[name]


@pytest.fixture(params=sorted(FAMILIES))
def case(request, model_root):
    return _case(request.param, model_root)


def _engine(path, **overrides) -> LLMEngine:
    cfg = dict(model=path, dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64,
               max_num_seqs=8, max_num_batched_tokens=256, enable_prefix_caching=False)
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg), UniProcExecutor)


def _run(engine: LLMEngine, prompts, max_new: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, detokenize=False)
    ids = [f"r{engine.get_stats().step_id}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[r] for r in ids]


def test_all_at_once_then_a_prefix_cache_hit(case):
    path, prompts, refs = case
    engine = _engine(path, enable_prefix_caching=True)
    assert _run(engine, prompts) == refs
    assert _run(engine, prompts[-1:]) == refs[-1:]  # the 40-token prompt again
    assert engine.get_stats().prefix_cache_hits >= 32  # its two full blocks


def test_chunked_prefill(case):
    path, prompts, refs = case
    engine = _engine(path, max_num_batched_tokens=16)
    assert _run(engine, prompts) == refs


@pytest.mark.parametrize("name", sorted(n for n in FAMILIES if not n.startswith("gemma")))
def test_preemption(name, model_root):
    path, prompts, refs = _case(name, model_root)
    # 6 blocks of 16 slots; the four requests need 1 + 2 + 3 + 4 blocks by their end.
    engine = _engine(path, num_gpu_blocks_override=6, max_num_batched_tokens=64)
    assert _run(engine, prompts) == refs
    assert engine.get_stats().num_preemptions > 0


@pytest.mark.parametrize("name, num_blocks", [("gemma2", 10), ("gemma3", 28)])
def test_gemma_preemption(name, num_blocks, model_root):
    """Gemma's hybrid KV cache takes a block per group of layers (2 groups of 2 layers, 4
    of 1), and its sliding groups free blocks as decoding moves on, so the full groups'
    growth over 40 tokens is what preempts; the recomputed requests give the same tokens."""
    path = _model_path(name, model_root)
    prompts = _prompts(PROMPT_LENS)
    engine = _engine(path, num_gpu_blocks_override=num_blocks, max_num_batched_tokens=64, max_model_len=128)
    assert _run(engine, prompts, 40) == _hf_greedy(path, prompts, 40)
    assert engine.get_stats().num_preemptions > 0


def test_phi3_long_factors_past_the_original_length(model_root):
    """Past original_max_position_embeddings (64) transformers rotates every position with
    the long factors; an engine longer than that uses them throughout."""
    path = _model_path("phi3", model_root)
    prompts = _prompts([70, 90], seed=11)
    engine = _engine(path, max_model_len=256)
    assert engine.model_config.rope_scaling["ext_factors"] == LONGROPE["long_factor"]
    assert _run(engine, prompts, 8) == _hf_greedy(path, prompts, 8)
    short = ModelConfig.from_pretrained(path, max_model_len=64).rope_scaling
    assert short["ext_factors"] == LONGROPE["short_factor"] and short["attention_factor"] > 1.0


# ---- Gemma: prompts many windows long -----------------------------------------------------------
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_prompts_many_windows_long(name, model_root):
    """Prompts of 70 and 100 tokens, 6-12 windows, decoded past them: every path (one pass,
    16-token chunks whose rows start their windows in different blocks) gives transformers'
    tokens, and those differ from what the same weights give with no window, so the window
    is what the local layers computed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _model_path(name, model_root)
    prompts = _prompts([70, 100], seed=5)
    refs = _hf_greedy(path, prompts, 10)
    assert _run(_engine(path, max_model_len=128), prompts, 10) == refs
    assert _run(_engine(path, max_model_len=128, max_num_batched_tokens=16), prompts, 10) == refs
    config = AutoConfig.from_pretrained(path)
    config.sliding_window = 4096
    hf = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    x = torch.tensor(prompts[1:])
    with torch.no_grad():
        unwindowed = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, 100:].tolist()
    assert unwindowed != refs[1]


def test_gemma3_local_layers_hold_a_window_of_blocks_at_8x_the_window(model_root):
    """Gemma 3 (window 8, 3 local layers, 1 global: 4 KV cache groups of one layer each,
    scheduler/kv/hybrid.py) decoding to 100 tokens, 12 windows: after every step the pool
    is read. The global group holds every block of the context; each local group never more
    than the blocks its window reaches (2: the window's first key's block and the newest),
    the pool's used blocks are exactly those, and the tokens are transformers'."""
    from pagedserve.scheduler.kv.hybrid import HybridKVCacheManager

    path = _model_path("gemma3", model_root)
    prompts = _prompts([30, 24], seed=9)
    refs = _hf_greedy(path, prompts, 70)
    engine = _engine(path, max_model_len=128, max_num_batched_tokens=64, async_scheduling=False)
    kv = engine.scheduler.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager) and kv.groups.windows == (None, 8, 8, 8)
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"long-{i}", prompt, params)
    done, seen = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        held = {r.req_id: kv.held_blocks(r.req_id) for r in engine.scheduler.running}
        for rid, (full, *local) in held.items():
            n = engine.scheduler.requests[rid].num_computed_tokens
            assert full == -(-n // 16) and all(h <= 2 for h in local), (rid, n, full, local)
            seen = max(seen, n)
        assert kv.num_blocks - kv.num_free_blocks == sum(map(sum, held.values()))
    assert seen >= 8 * 8 + 16 and [done["long-0"], done["long-1"]] == refs


def test_gemma_configs_of_the_hub(tmp_path):
    """The older config.json dialect (transformers 4: sliding_window_pattern, rope_theta +
    rope_local_base_freq + rope_scaling, no layer_types) reads as the new one does."""
    import json

    base = dict(hidden_size=64, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=512, sliding_window=512, query_pre_attn_scalar=16)
    (tmp_path / "config.json").write_text(json.dumps(dict(
        base, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window_pattern=6,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.layer_types == (LOCAL,) * 5 + (GLOBAL, LOCAL)
    assert (cfg.rope_theta, cfg.rope_scaling) == (1000000.0, {"rope_type": "linear", "factor": 8.0})
    assert (cfg.local_rope_theta, cfg.local_rope_scaling) == (10000.0, None)
    assert cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh" and cfg.attn_logit_softcapping is None
    assert [cfg.layer_window(i) for i in (4, 5)] == [512, None]
    assert cfg.max_model_len == 2048  # not capped at the window
    (tmp_path / "config.json").write_text(json.dumps(dict(
        base, architectures=["Gemma2ForCausalLM"], model_type="gemma2", num_hidden_layers=3,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh")))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.layer_types == (LOCAL, GLOBAL, LOCAL) and cfg.sliding_window == 512
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    (tmp_path / "config.json").write_text(json.dumps(dict(
        base, architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True)))
    with pytest.raises(ValueError, match="bidirectional"):
        ModelConfig.from_pretrained(tmp_path)


# ---- rope scalings the families' configs use ----------------------------------------------------
ROPES = {  # rope_parameters of a tiny Llama (max_position_embeddings 256)
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
}


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rope_scaling_matches_transformers(rope, model_root):
    """Linear (positions slowed by the factor), dynamic NTK (plain rope up to
    max_position_embeddings, which max_model_len never passes) and YaRN (frequencies blended
    over a ramp, cos/sin scaled by 0.1 ln(factor) + 1): cos and sin bit for bit against
    transformers' rotary embedding at every position, and greedy tokens of prompts past
    YaRN's original 64 positions against generate()."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from pagedserve.worker.layers.rotary import RotaryEmbedding

    path = build_once(os.path.join(os.fspath(model_root), f"rope-{rope}"),
                      lambda tmp: make_random_llama(tmp, "llama", **{**SMALL, "rope_parameters": ROPES[rope]}))
    cfg = ModelConfig.from_pretrained(path, dtype="float32")
    ours = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    theirs = LlamaRotaryEmbedding(AutoConfig.from_pretrained(path))
    positions = torch.arange(cfg.max_position_embeddings)
    cos, sin = ours(positions)
    hf_cos, hf_sin = theirs(torch.zeros(1, dtype=torch.float32), positions[None])
    assert torch.equal(cos[:, 0], hf_cos[0]) and torch.equal(sin[:, 0], hf_sin[0])
    plain, _ = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)(positions)
    assert torch.equal(cos, plain) == (rope == "dynamic")
    prompts = _prompts([20, 90], seed=3)
    assert _run(_engine(path, max_model_len=128), prompts, 10) == _hf_greedy(path, prompts, 10)


# ---- tensor parallelism 2: two processes joined by gloo, the model driven directly ----------
def _greedy_direct(path: str, prompts, max_new: int, tp_size: int) -> list[list[int]]:
    """Each prompt prefilled in one step over scattered paged blocks, then decoded greedily."""
    from test_tp import BLOCK_SIZE, _metadata

    from pagedserve.worker.loading.loader import load_model

    # the engines' max_model_len: Phi-3's LongRoPE factor set is picked from it
    cfg = ModelConfig.from_pretrained(path, dtype="float32", max_model_len=MAX_MODEL_LEN)
    model = load_model(cfg)
    shape = (32, BLOCK_SIZE, cfg.get_num_kv_heads(tp_size), cfg.head_dim)
    outs = []
    for ids in prompts:
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
        blocks = list(range(31, 31 - (len(ids) + max_new) // BLOCK_SIZE - 1, -1))
        seq, start, new = list(ids), 0, []
        with torch.no_grad():
            for _ in range(max_new):
                h = model(torch.tensor(seq[start:]), torch.arange(start, len(seq)), caches,
                          _metadata([(start, len(seq), blocks)]))
                token = int(model.compute_logits(h)[-1].argmax())
                start = len(seq)
                seq.append(token)
                new.append(token)
        outs.append(new)
    return outs


def _tp_rank(rank: int, world_size: int, init_file: str, path: str, prompts, out_dir: str) -> None:
    from pagedserve.worker.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)  # two ranks on a 2-core box
    init_tensor_parallel(rank, world_size, f"file://{init_file}", backend="gloo")
    try:
        torch.save(_greedy_direct(path, prompts, MAX_TOKENS, world_size), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_tensor_parallel()


@pytest.mark.slow  # two spawned ranks: about 30-40 s each on 2 cores
@pytest.mark.scenarios  # so under -m scenarios (pyproject.toml), not the default run
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tensor_parallel_2_greedy(name, model_root, tmp_path):
    """Heads, the MLP's and every expert's intermediate features split over two ranks
    (and Qwen3's and Gemma 3's per-head norms whole on each, Gemma's windows per layer,
    Phi-3's fused qkv / gate_up split by heads and rows, SmolLM3's rope-less layers):
    the same greedy tokens as transformers."""
    path, prompts, refs = _case(name, model_root)
    mp.spawn(_tp_rank, args=(2, str(tmp_path / "init"), path, prompts[2:], str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        assert torch.load(os.path.join(tmp_path, f"rank{rank}.pt")) == refs[2:]


# ---- what is not implemented says so --------------------------------------------------------
def test_registry_is_the_supported_list():
    assert tuple(MODEL_REGISTRY) == SUPPORTED_ARCHITECTURES


def test_an_architecture_we_do_not_run_is_a_startup_error_naming_it(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, vocab_size=512)))
    with pytest.raises(ValueError, match="'GptOssForCausalLM'.*supported: " + ", ".join(SUPPORTED_ARCHITECTURES)):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GptOssForCausalLM"):
        LLMEngine(EngineConfig(model=str(tmp_path)), UniProcExecutor)
