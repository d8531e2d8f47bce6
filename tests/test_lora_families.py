"""LoRA adapters on the families beyond Llama, against transformers with the adapter merged
by ``peft`` (as tests/test_lora.py does for Llama):

    mistral     every module (the Llama path, Mistral's config)
    qwen2       every module, beside q/k/v biases; both also at tensor_parallel_size 2
    qwen3       every module (q/k norms and head_dim 32 do not touch LoRA's shapes)
    phi3        the checkpoint's fused names: PEFT writes qkv_proj and gate_up_proj, one A
                and one B over the stacked outputs; served split into q/k/v and gate/up
    mixtral     attention only (its MLPs are experts)
    qwen3-moe   attention (PEFT under transformers 5 names the dense layer's MLP and the
                experts' fused gate_up_proj alike, so an adapter cannot target only the first)

An adapter on a mixture-of-experts layer's experts is refused naming them, at load and from
a request, and the engine serves the others.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from _lora_helpers import hf_greedy, make_random_adapter, merged_model
from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.worker.loading.model_cache import build_once
from pagedserve.worker.loading.random_models import make_random_llama
from pagedserve.worker.lora.peft_adapter import LoRAError, load_peft_adapter
from pagedserve.worker.model_config import ModelConfig

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[0],
                 norm_topk_prob=False)
FAMILIES = {  # name -> (make_random_llama arch, config overrides, PEFT target_modules)
    "mistral": ("mistral", dict(sliding_window=None), None),
    "qwen2": ("qwen2", dict(), None),  # q/k/v biases beside the adapter's deltas
    "qwen3": ("qwen3", dict(head_dim=32), None),
    "phi3": ("phi3", dict(), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "qwen3-moe": ("qwen3_moe", QWEN3_MOE, ["q_proj", "v_proj", "o_proj"]),
}
NUM_NEW = 10


def _base(name: str, root) -> str:
    arch, overrides, _ = FAMILIES[name]
    return build_once(os.path.join(os.fspath(root), name),
                      lambda tmp: make_random_llama(tmp, arch, **{**SMALL, **overrides}))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "lora-family-models"


# Phi-3 (its fused names) in the default run; the others, whose adapters take the Llama
# path's names, under -m scenarios (CI runs both).
DEFAULT_RUN = ("phi3",)


@pytest.mark.parametrize("name", [n if n in DEFAULT_RUN else pytest.param(n, marks=pytest.mark.scenarios)
                                  for n in sorted(FAMILIES)])
def test_adapter_and_base_in_one_batch_equal_peft_merged(name, root, tmp_path):
    _check_against_peft(name, root, tmp_path)


# TP=2 (two gloo workers over Ray): each rank holds its shard of the adapter, cut as the base
# layer is (tests/test_lora_tp.py does Llama).
@pytest.mark.slow
@pytest.mark.scenarios
@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_tp2_adapter_and_base_equal_peft_merged(name, root, tmp_path, ray_session):
    _check_against_peft(name, root, tmp_path, tensor_parallel_size=2)


def _check_against_peft(name, root, tmp_path, **engine) -> None:
    base = _base(name, root)
    adapter = make_random_adapter(base, tmp_path / "adapter", r=8, alpha=16, seed=1, targets=FAMILIES[name][2])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (37, 9)]
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ref_base = [hf_greedy(plain, p, NUM_NEW) for p in prompts]
    merged = merged_model(base, adapter)
    ref = [hf_greedy(merged, p, NUM_NEW) for p in prompts]
    assert ref != ref_base  # the adapter changes the tokens: the comparison means something
    llm = LLM(model=base, enable_lora=True, max_loras=1, max_lora_rank=8, dtype="float32", max_model_len=128,
              block_size=8, **engine)
    try:
        lora = LoRARequest("a", 1, adapter)
        outs = llm.generate(prompts + prompts, SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True),
                            use_tqdm=False, lora_request=[lora, lora, None, None])
    finally:
        llm.shutdown()
    got = [o.outputs[0].token_ids for o in outs]
    assert got[:2] == ref and got[2:] == ref_base


def test_phi3_fused_adapter_is_split_into_its_modules(root, tmp_path):
    """One A for q, k and v (and for gate and up), each module with its rows of B."""
    base = _base("phi3", root)
    adapter = make_random_adapter(base, tmp_path / "adapter", r=4, alpha=8, seed=3, targets=["qkv_proj", "gate_up_proj"])
    cfg = ModelConfig.from_pretrained(base, dtype=torch.float32)
    got = load_peft_adapter(LoRARequest("a", 1, adapter), cfg, max_lora_rank=8)
    assert got.modules == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    assert [got.weights[(0, m)][1].shape[0] for m in ("q_proj", "k_proj", "v_proj")] == [q, kv, kv]
    assert torch.equal(got.weights[(1, "q_proj")][0], got.weights[(1, "v_proj")][0])


def test_adapter_on_experts_is_refused_naming_them(root, tmp_path):
    base = _base("qwen3-moe", root)
    experts = make_random_adapter(base, tmp_path / "experts", r=4, alpha=8, seed=2, targets=["q_proj", "down_proj"])
    cfg = ModelConfig.from_pretrained(base, dtype=torch.float32)
    with pytest.raises(LoRAError, match="mixture-of-experts layer's experts"):
        load_peft_adapter(LoRARequest("experts", 1, experts), cfg, max_lora_rank=16)
    llm = LLM(model=base, enable_lora=True, max_loras=1, max_lora_rank=16, dtype="float32", max_model_len=128,
              block_size=8)
    try:
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        with pytest.raises(ValueError, match="experts"):  # refused alone (a 400 over HTTP)
            llm.generate([[5, 6, 7]], sp, use_tqdm=False, lora_request=LoRARequest("experts", 1, experts))
        assert len(llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
