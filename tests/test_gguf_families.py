"""GGUF files of the newer families, written here from small random Hugging Face checkpoints as
llama.cpp's converter writes them (loadtest/gguf_writer.py: its tensor names, stacked experts,
fused Phi-3 tensors, LongRoPE factor tensors), load and decode as the Hugging Face model does:

    qwen3      blk.N.attn_q_norm / attn_k_norm, head_dim 32 != hidden / heads
    qwen3-moe  8 experts top-2 in ffn_{gate,up,down}_exps [E, out, in], the router ffn_gate_inp
               (F32, as llama.cpp keeps it), every layer routed, top-k renormalised (llama.cpp's
               and transformers' reading of a Qwen3-MoE GGUF)
    phi3       attn_qkv and ffn_up [gate ; up] fused, LongRoPE from rope_factors_long / _short
               and rope.scaling.original_context_length (the short set: max_model_len 64)
    mixtral    arch "llama" with llama.expert_count: q/k rows permuted, 4 experts top-2 stacked
               as Qwen3-MoE's (w1 / w3 / w2), the router ffn_gate_inp

    F32   the tensors are the checkpoint's bit for bit (names mapped, experts split again);
          greedy tokens equal transformers' generate() on the Hugging Face directory (the
          CPU's native GGUF path, the default)
    F16   (Qwen3) greedy equal to the Hugging Face model with its 2-D weights rounded to fp16
    Q8_0  every weight within the format's rounding of the checkpoint's; dequantized
          (--quantization none), greedy equal to transformers on those same weights; on the
          native path (Q8_0 blocks in the GEMMs, int8 activations, the experts and the router
          dequantized), equal on most prompts
"""

from __future__ import annotations

import json
import os
import random
import re

import pytest
import torch

from _gguf_helpers import gguf_once
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.loading.gguf_loader import gguf_hf_config, iter_gguf_weights, open_gguf
from pagedserve.worker.loading.model_cache import build_once
from pagedserve.worker.loading.random_models import make_random_llama
from pagedserve.worker.model_config import ModelConfig

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.1 * i for i in range(8)],
                long_factor=[1.0 + 0.5 * i for i in range(8)])
FAMILIES = {  # name -> (make_random_llama arch, config overrides)
    "qwen3": ("qwen3", dict(head_dim=32)),
    "qwen3-moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                    norm_topk_prob=True)),
    "phi3": ("phi3", dict(original_max_position_embeddings=64, rope_parameters=LONGROPE)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
}
PROMPT_LENS = [3, 17, 33, 40, 9, 25]
MAX_TOKENS = 12  # the longest request: 52 tokens, within Phi-3's 64-token short-factor range
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "gguf-family-models"


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    """The GGUFs' prepared directories (model_source.py) in this module's own cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDSERVE_CACHE", str(tmp_path_factory.mktemp("gguf-family-cache")))
    yield
    mp.undo()


def _hf_dir(name: str, root) -> str:
    arch, overrides = FAMILIES[name]
    return build_once(os.path.join(os.fspath(root), name),
                      lambda tmp: make_random_llama(tmp, arch, **{**SMALL, **overrides}))


def _gguf(name: str, root, qtype: str) -> str:
    return gguf_once(_hf_dir(name, root), root, name, qtype)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, SMALL["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]


_REFS: dict[tuple[str, str], list[list[int]]] = {}


def _hf_greedy(name: str, root, weights: str = "checkpoint") -> list[list[int]]:
    """transformers' greedy tokens on the Hugging Face directory; ``weights`` "fp16": its 2-D
    weights rounded to fp16, as an F16 GGUF holds them; a .gguf path: the file's weights,
    dequantized (transformers' own GGUF load cannot read every file here: it takes no
    head_dim from a qwen3 file's key_length)."""
    if (name, weights) not in _REFS:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(_hf_dir(name, root), dtype=torch.float32).eval()
        with torch.no_grad():
            if weights == "fp16":
                for p in hf.parameters():
                    if p.dim() == 2:
                        p.copy_(p.half().float())
            elif weights != "checkpoint":
                state = hf.state_dict()
                for k, w in iter_gguf_weights(weights):
                    m = re.match(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj"
                                 r"|w1|w3|w2)\.weight$", k)
                    if m is None:  # transformers 5 names Mixtral's router mlp.gate as Qwen3-MoE's
                        state[k if k in state else k.replace(".block_sparse_moe.", ".mlp.")].copy_(w)
                        continue
                    # transformers keeps a layer's experts stacked: gate_up_proj [E, 2I, H] ([gate ; up]), down_proj
                    layer, e, proj = m.group(1), int(m.group(2)), m.group(3)
                    experts = next(f"{layer}.{b}.experts" for b in ("mlp", "block_sparse_moe")
                                   if f"{layer}.{b}.experts.down_proj" in state)
                    if proj in ("down_proj", "w2"):
                        state[f"{experts}.down_proj"][e].copy_(w)
                    else:
                        state[f"{experts}.gate_up_proj"][e].narrow(0, 0 if proj in ("gate_proj", "w1") else w.shape[0],
                                                                    w.shape[0]).copy_(w)
        refs = []
        for ids in _prompts():
            x = torch.tensor([ids])
            with torch.no_grad():
                out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(ids):].tolist())
        _REFS[name, weights] = refs
    return _REFS[name, weights]


def _greedy(model: str, quantization: str | None = None) -> list[list[int]]:
    from pagedserve.cluster.llm import LLM

    llm = LLM(model=model, dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64,
              max_num_seqs=8, quantization=quantization)
    try:
        assert llm.engine.model_config.quantization == (None if quantization == "none" else "gguf")
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
        return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    finally:
        llm.shutdown()


def _fp32(value):
    """LongRoPE's factors as rotary.py uses them (fp32; the GGUF stores them so)."""
    if isinstance(value, dict):
        return {k: _fp32(v) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], float):
        return torch.tensor(value, dtype=torch.float32).tolist()
    return value


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_f32_gguf_is_the_checkpoint_and_decodes_as_transformers(name, root):
    from safetensors.torch import load_file

    path = _gguf(name, root, "F32")
    theirs = load_file(os.path.join(_hf_dir(name, root), "model.safetensors"))
    ours = dict(iter_gguf_weights(path))
    assert sorted(ours) == sorted(theirs)
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []

    hf_cfg = json.load(open(os.path.join(_hf_dir(name, root), "config.json")))
    cfg = ModelConfig.from_pretrained(path, max_model_len=MAX_MODEL_LEN)
    assert cfg.architecture == hf_cfg["architectures"][0] and cfg.gguf_file == path
    ref = ModelConfig.from_pretrained(_hf_dir(name, root), max_model_len=MAX_MODEL_LEN)
    for field in ("head_dim", "num_key_value_heads", "intermediate_size", "rope_theta", "rope_scaling",
                  "moe_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "tie_word_embeddings", "attention_bias"):
        assert _fp32(getattr(cfg, field)) == _fp32(getattr(ref, field)), field

    assert _greedy(path) == _hf_greedy(name, root)  # the native path: F32 tensors as they are


def test_f16_qwen3_gguf_decodes_as_transformers_on_fp16_weights(root):
    assert _greedy(_gguf("qwen3", root, "F16")) == _hf_greedy("qwen3", root, "fp16")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_q8_0_gguf_decodes_within_the_format_rounding(name, root):
    path = _gguf(name, root, "Q8_0")
    ours = dict(iter_gguf_weights(path))
    from safetensors.torch import load_file

    theirs = load_file(os.path.join(_hf_dir(name, root), "model.safetensors"))
    for k, w in theirs.items():
        if w.dim() == 2 and not k.endswith("mlp.gate.weight"):
            # Q8_0: a scale d = max |w| / 127 per 32 weights, each rounded to a multiple of it
            # (half a step), d itself then stored in fp16 (up to 127 x its rounding more)
            step = w.reshape(-1, 32).abs().amax(-1, keepdim=True) / 127
            bound = step * 0.5 + 127 * (step - step.half().float()).abs() + 1e-7
            assert ((ours[k].reshape(-1, 32) - w.reshape(-1, 32)).abs() <= bound).all(), k
        else:
            assert torch.equal(ours[k], w), k
    refs = _hf_greedy(name, root, path)  # transformers on the file's weights, dequantized
    assert _greedy(path, quantization="none") == refs  # so do we: the same fp32 weights
    # The native path: Q8_0 blocks in the GEMMs, x rounded to int8 per 32 values as llama.cpp
    # does (kernels/cpu_gguf.py): the activations' rounding on top of the weights'.
    got = _greedy(path)
    assert sum(g == r for g, r in zip(got, refs)) >= len(refs) - 2, (got, refs)


def test_qwen3_moe_gguf_config_reads_llama_cpp_conventions(root):
    """Every layer routed, norm_topk_prob true when the file does not say (llama.cpp's graph),
    the experts' width from expert_feed_forward_length."""
    hf = gguf_hf_config(open_gguf(_gguf("qwen3-moe", root, "F32")), "x")
    assert (hf["architectures"], hf["model_type"]) == (["Qwen3MoeForCausalLM"], "qwen3_moe")
    assert (hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]) == (8, 2, 64)
    assert hf["norm_topk_prob"] is True and hf["mlp_only_layers"] == [] and hf["decoder_sparse_step"] == 1
