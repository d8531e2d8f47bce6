"""Multi-LoRA at tensor_parallel_size 2 (two CPU workers joined by gloo) against the same
oracle as test_lora.py: transformers with the adapter merged by ``peft``.

Each rank holds its shard of every adapter, cut the way the base layer is cut
(worker/lora/slot_pool.py): q/k/v and gate/up keep their rank's rows of B, o and down their
rank's columns of A, whose partial delta joins the layer's own partial sum before its one
all-reduce. A slip in any of the four shows as wrong tokens: both adapters target all three
kinds (plain: every module; rslora: q, v, down), with the base model's rows beside them in the
same steps, and a 16-token budget cuts the prompts into chunks, so steps mix prefill chunks
and decode rows of different adapters.
"""

from __future__ import annotations

import pytest

from pagedserve import LLM, LoRARequest, SamplingParams
from test_lora import NUM_NEW, models, oracle  # noqa: F401 (the fixtures: tiny Llama, two adapters, HF's tokens)


@pytest.mark.slow  # Ray, two worker actors and the oracle's fixtures
@pytest.mark.scenarios  # so under -m scenarios (pyproject.toml), not the default run
def test_tp2_mixed_batch_equals_peft_merged(models, oracle, ray_session):  # noqa: F811
    base, adapters = models
    prompts, ref = oracle
    llm = LLM(model=base, tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
              max_model_len=256, block_size=8, num_gpu_blocks_override=128, max_num_batched_tokens=16)
    try:
        loras = {None: None, "plain": LoRARequest("plain", 1, adapters["plain"]),
                 "rslora": LoRARequest("rslora", 2, adapters["rslora"])}
        order = [(n, i) for i in range(len(prompts)) for n in (None, "plain", "rslora")]
        outs = llm.generate([prompts[i] for _, i in order],
                            SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True),
                            use_tqdm=False, lora_request=[loras[n] for n, _ in order])
    finally:
        llm.shutdown()
    for (n, i), out in zip(order, outs):
        assert out.outputs[0].token_ids == ref[n][i], (n, i)


def test_tp2_shards_follow_the_base_layers(models, monkeypatch):
    """The slot pool of rank 1 of 2 holds the second half of q/k/v's and gate/up's B rows
    and of o's and down's A columns; the rest of each adapter whole."""
    import torch

    from pagedserve.worker import parallel_state
    from pagedserve.worker.lora.peft_adapter import load_peft_adapter
    from pagedserve.worker.lora.slot_pool import LoRASlotPool
    from pagedserve.worker.model_config import ModelConfig

    base, adapters = models
    cfg = ModelConfig.from_pretrained(base, dtype="float32")
    adapter = load_peft_adapter(LoRARequest("plain", 1, adapters["plain"]), cfg, max_lora_rank=8)
    monkeypatch.setattr(parallel_state, "_TP_RANK", 1)  # as init_tensor_parallel leaves rank 1 of 2
    monkeypatch.setattr(parallel_state, "_TP_SIZE", 2)
    pool = LoRASlotPool(cfg, 1, 8, torch.device("cpu"), torch.float32)
    q, kv = cfg.num_attention_heads * cfg.head_dim // 2, cfg.num_key_value_heads * cfg.head_dim // 2
    assert pool.layout["qkv"] == (cfg.hidden_size, [("q_proj", 0, q), ("k_proj", q, q + kv),
                                                    ("v_proj", q + kv, q + 2 * kv)])
    assert pool.layout["down"] == (cfg.intermediate_size // 2, [("down_proj", 0, cfg.hidden_size)])
    (slot,) = pool.slots_for([adapter])
    views = pool.views(slot)[0]  # layer 0
    a, b = adapter.weights[(0, "k_proj")]
    a_qkv, subs = views["qkv"]
    c0, c1, b_k, o0, o1 = subs[1]  # k: the second module of qkv
    assert torch.equal(b_k, b[kv:]) and torch.equal(a_qkv[c0:c1], a) and (o0, o1) == (q, q + kv)
    a, b = adapter.weights[(0, "down_proj")]
    a_down, [(_, _, b_down, _, _)] = views["down"]
    assert torch.equal(a_down, a[:, cfg.intermediate_size // 2:]) and torch.equal(b_down, b)
