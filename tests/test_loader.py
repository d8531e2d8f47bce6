"""The safetensors loader: single file == sharded index, pickle refused, every parameter
accounted for, and each TP rank holding exactly its slice of every weight."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve.worker.loading.loader import load_model
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.parallel_state import tp_rank_override
from pagedserve.worker.loading.random_models import make_random_llama, make_test_model


@pytest.fixture(scope="session")
def model_root(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "ps-test-models"


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sharded_index_loads_identical_weights(tmp_path, model_root):
    single = make_test_model("llama-gqa2-hd64", model_root)
    hf = transformers.AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="300KB")
    shards = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
    assert "model.safetensors.index.json" in os.listdir(sharded) and len(shards) >= 3
    a = _state(load_model(ModelConfig.from_pretrained(single)))
    b = _state(load_model(ModelConfig.from_pretrained(sharded)))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_pickle_only_directory_is_refused(tmp_path, model_root):
    src = make_test_model("llama-mha", model_root)
    (tmp_path / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    torch.save(load_file(os.path.join(src, "model.safetensors")), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"only pickle checkpoints \(pytorch_model.bin\).*safetensors only"):
        load_model(ModelConfig.from_pretrained(tmp_path))


def test_missing_and_unexpected_tensors_are_detected(tmp_path, model_root):
    src = make_test_model("llama-mha", model_root)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    cfg_text = open(os.path.join(src, "config.json")).read()

    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text(cfg_text)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.weight"},
              missing / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model.layers.1.self_attn.qkv_proj.weight \(shard k\)"):
        load_model(ModelConfig.from_pretrained(missing))

    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "config.json").write_text(cfg_text)
    save_file({**tensors, "model.layers.9.mlp.gate_proj.weight": torch.zeros(2, 2)}, extra / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.9.mlp.gate_proj.weight"):
        load_model(ModelConfig.from_pretrained(extra))

    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text(cfg_text)
    bad = dict(tensors)
    bad["model.layers.0.mlp.down_proj.weight"] = bad["model.layers.0.mlp.down_proj.weight"][:, :-1].contiguous()
    save_file(bad, wrong / "model.safetensors")
    with pytest.raises(ValueError, match="shape mismatch"):
        load_model(ModelConfig.from_pretrained(wrong))


@pytest.mark.parametrize("name", ["llama-gqa4-hd128", "qwen2-tied"])
def test_tp2_ranks_hold_exactly_their_slices(name, model_root):
    path = make_test_model(name, model_root)
    hf = load_file(os.path.join(path, "model.safetensors"))
    cfg = ModelConfig.from_pretrained(path)
    d, nh, nkv = cfg.head_dim, cfg.num_attention_heads // 2, cfg.num_key_value_heads // 2
    vocab_half = -(-cfg.vocab_size // 2)
    for rank in (0, 1):
        with tp_rank_override(rank, 2):
            m = load_model(cfg)
        p = dict(m.named_parameters())
        pre = "model.layers.1."
        q, k, v = (hf[pre + f"self_attn.{x}_proj.weight"] for x in "qkv")
        want_qkv = torch.cat([q[rank * nh * d:(rank + 1) * nh * d], k[rank * nkv * d:(rank + 1) * nkv * d],
                              v[rank * nkv * d:(rank + 1) * nkv * d]])
        assert torch.equal(p[pre + "self_attn.qkv_proj.weight"], want_qkv)
        if cfg.attention_bias:
            qb, kb, vb = (hf[pre + f"self_attn.{x}_proj.bias"] for x in "qkv")
            assert torch.equal(p[pre + "self_attn.qkv_proj.bias"], torch.cat(
                [qb.view(2, -1)[rank], kb.view(2, -1)[rank], vb.view(2, -1)[rank]]))
        o = hf[pre + "self_attn.o_proj.weight"]
        assert torch.equal(p[pre + "self_attn.o_proj.weight"], o.chunk(2, dim=1)[rank])
        gate, up = hf[pre + "mlp.gate_proj.weight"], hf[pre + "mlp.up_proj.weight"]
        assert torch.equal(p[pre + "mlp.gate_up_proj.weight"], torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]))
        assert torch.equal(p[pre + "mlp.down_proj.weight"], hf[pre + "mlp.down_proj.weight"].chunk(2, dim=1)[rank])
        emb = hf["model.embed_tokens.weight"]
        assert torch.equal(p["model.embed_tokens.weight"], emb[rank * vocab_half:(rank + 1) * vocab_half])
        # norms are replicated on every rank
        assert torch.equal(p[pre + "input_layernorm.weight"], hf[pre + "input_layernorm.weight"])
        assert m.model.layers[1].self_attn.num_kv_heads == nkv


def test_tp_that_does_not_divide_heads_is_refused(tmp_path):
    path = make_random_llama(tmp_path / "m", "llama", hidden_size=64, num_attention_heads=4,
                             num_key_value_heads=1, intermediate_size=128)
    with tp_rank_override(0, 2), pytest.raises(ValueError, match=r"num_key_value_heads \(1\) must be divisible"):
        load_model(ModelConfig.from_pretrained(path))
