"""Our Llama-family model against transformers on the same weights.

Story: for every test shape, HF greedily continues two prompts; we replay the same
tokens through a paged KV cache (scattered block ids, block_size 8) as the engine
would - a 37-token prompt prefilled in chunks of 16, 16, 5 next to a short prompt, then
both decoded together - and every row's logits must match HF's full-sequence logits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.worker.loading.loader import load_model
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models import get_model_class
from pagedserve.worker.loading.random_models import TEST_SHAPES, make_random_llama, make_test_model

BLOCK_SIZE = 8


@pytest.fixture(scope="session")
def model_root(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "ps-test-models"


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def paged_step(model, kv_caches, rows):
    """rows: [(token_ids, start, end, block_ids)], decode rows (end - start == 1) first.
    Runs tokens[start:end] of each sequence in one mixed batch; returns logits per row group."""
    ids, pos, slots, lens, cu = [], [], [], [], [0]
    for tokens, start, end, blocks in rows:
        ids += tokens[start:end]
        pos += range(start, end)
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
        lens.append(end)
        cu.append(cu[-1] + end - start)
    width = max(len(r[3]) for r in rows)
    table = torch.tensor([r[3] + [0] * (width - len(r[3])) for r in rows], dtype=torch.int32)
    query_lens = [end - start for _, start, end, _ in rows]
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_table=table, seq_lens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), max_seqlen_q=max(query_lens), max_seq_len=max(lens),
        num_decode_tokens=sum(1 for q in query_lens if q == 1), seq_lens_cpu=lens, query_lens_cpu=query_lens)
    with torch.no_grad():
        h = model(torch.tensor(ids), torch.tensor(pos), kv_caches, md)
        logits = model.compute_logits(h)
    return logits.split(query_lens)


def make_kv_caches(cfg, num_blocks=32):
    shape = (num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]


@pytest.mark.parametrize("shape", sorted(TEST_SHAPES))
def test_paged_prefill_chunks_and_decode_match_hf(shape, model_root):
    path = make_test_model(shape, model_root)
    cfg = ModelConfig.from_pretrained(path)
    ours = load_model(cfg, "cpu")
    hf = hf_model(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g) for n in (37, 5)]
    new = 4
    with torch.no_grad():
        full = [hf.generate(p[None], max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=2)[0]
                for p in prompts]
        ref = [hf(f[None]).logits[0] for f in full]
    a, b = (f.tolist() for f in full)
    blocks_a, blocks_b = [7, 2, 30, 11, 5, 19], [3, 25]  # scattered on purpose
    caches = make_kv_caches(cfg)

    got_a, got_b = [], []
    # step 1: first chunk of A with all of B; step 2, 3: rest of A's prompt in chunks
    la, lb = paged_step(ours, caches, [(a, 0, 16, blocks_a), (b, 0, 5, blocks_b)])
    got_a.append(la), got_b.append(lb)
    got_a += paged_step(ours, caches, [(a, 16, 32, blocks_a)])
    # B decodes (row first) while A finishes its prompt
    lb, la = paged_step(ours, caches, [(b, 5, 6, blocks_b), (a, 32, 37, blocks_a)])
    got_a.append(la), got_b.append(lb)
    for k in range(new - 1):  # both decode
        la, lb = paged_step(ours, caches, [(a, 37 + k, 38 + k, blocks_a), (b, 6 + k, 7 + k, blocks_b)])
        got_a.append(la), got_b.append(lb)
    got_a, got_b = torch.cat(got_a), torch.cat(got_b)
    # A: every position but the last generated token's; B decoded one step earlier: all of it
    assert got_a.shape == (37 + new - 1, cfg.vocab_size) and got_b.shape == (5 + new, cfg.vocab_size)
    assert got_a.dtype == torch.float32
    torch.testing.assert_close(got_a, ref[0][: 37 + new - 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_b, ref[1], rtol=1e-4, atol=1e-4)
    # greedy continuations agree token for token
    assert got_a[36:].argmax(-1).tolist() == a[37:]
    assert got_b[4:-1].argmax(-1).tolist() == b[5:]


def test_no_cache_forward_matches_hf_per_sequence(model_root):
    """kv_caches=None (profile run): each sequence attends only within its own chunk."""
    path = make_test_model("llama-gqa2-hd64", model_root)
    cfg = ModelConfig.from_pretrained(path)
    ours, hf = load_model(cfg, "cpu"), hf_model(path)
    seqs = [torch.randint(3, cfg.vocab_size, (n,)) for n in (9, 20)]
    md = AttentionMetadata(slot_mapping=torch.full((29,), -1), block_table=torch.zeros(2, 1, dtype=torch.int32),
                           seq_lens=torch.tensor([9, 20], dtype=torch.int32),
                           cu_seqlens_q=torch.tensor([0, 9, 29], dtype=torch.int32), max_seqlen_q=20, max_seq_len=20)
    with torch.no_grad():
        got = ours.compute_logits(ours(torch.cat(seqs), torch.cat([torch.arange(9), torch.arange(20)]), None, md))
        ref = torch.cat([hf(s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_llama3_rope_scaling_matches_hf_inv_freq(model_root):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from pagedserve.worker.layers.rotary import compute_inv_freq
    path = make_test_model("llama3-rope", model_root)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg)
    got = compute_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(got, want)
    plain = compute_inv_freq(cfg.head_dim, cfg.rope_theta, None)
    assert not torch.equal(got, plain)  # the scaling really changes the low frequencies
    assert got[0] == plain[0] and got[-1] == plain[-1] / 8.0


def test_qwen2_has_qkv_bias_but_no_o_proj_bias(model_root):
    path = make_test_model("qwen2-tied", model_root)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias
    ours, hf = load_model(cfg, "cpu"), hf_model(path)
    attn, hf_attn = ours.model.layers[1].self_attn, hf.model.layers[1].self_attn
    want = torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias])
    assert torch.equal(attn.qkv_proj.bias, want) and want.abs().sum() > 0
    assert attn.o_proj.bias is None


def test_tied_embeddings_share_one_tensor(model_root):
    path = make_test_model("qwen2-tied", model_root)
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    ours = load_model(ModelConfig.from_pretrained(path), "cpu")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    untied = load_model(ModelConfig.from_pretrained(make_test_model("llama-mha", model_root)), "cpu")
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def _write_config(tmp_path, **fields):
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=128, vocab_size=300, max_position_embeddings=256)
    base.update(fields)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in base.items() if v is not None}))
    return tmp_path


def test_unsupported_architecture_is_refused_naming_supported(tmp_path):
    _write_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        get_model_class("FalconForCausalLM")


@pytest.mark.parametrize("fields, message", [
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(hidden_size=None), "lacks required field 'hidden_size'"),
    (dict(rope_scaling={"rope_type": "proportional", "factor": 4.0}), "rope type 'proportional'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "needs 'low_freq_factor'"),
    (dict(vocab_size=0), "vocab_size must be >= 1"),
])
def test_bad_configs_are_refused(tmp_path, fields, message):
    _write_config(tmp_path, **fields)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(tmp_path)


def test_model_config_fields_and_kv_bytes(tmp_path):
    _write_config(tmp_path, rope_theta=500000.0, dtype="bfloat16", eos_token_id=[5, 7], head_dim=32)
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert (cfg.head_dim, cfg.rope_theta, cfg.rope_scaling) == (32, 500000.0, None)
    assert cfg.dtype == torch.bfloat16 and cfg.eos_token_ids == [5, 7] and cfg.max_model_len == 256
    # 2 (K,V) x 2 layers x 2 kv heads x 32 x 2 bytes
    assert cfg.kv_cache_bytes_per_token() == 512
    assert cfg.kv_cache_bytes_per_token(tp_size=2, cache_dtype="float32") == 512
    assert ModelConfig.from_pretrained(tmp_path, dtype="float32").dtype == torch.float32
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == [5, 7, 9]
    with pytest.raises(ValueError, match="divisible by tensor_parallel_size"):
        cfg.get_num_kv_heads(4)
    with pytest.raises(ValueError, match="max_model_len 300"):
        ModelConfig.from_pretrained(tmp_path, max_model_len=300)


def test_bf16_model_runs_and_tracks_fp32(tmp_path):
    path = make_random_llama(tmp_path / "m", "llama", hidden_size=64, intermediate_size=128)
    ids, pos = torch.randint(3, 512, (12,)), torch.arange(12)
    out = {}
    for dt in ("float32", "bfloat16"):
        m = load_model(ModelConfig.from_pretrained(path, dtype=dt), "cpu")
        assert m.model.embed_tokens.weight.dtype == getattr(torch, dt)
        with torch.no_grad():
            out[dt] = m.compute_logits(m(ids, pos, None, None))
    assert out["bfloat16"].dtype == torch.float32
    agree = (out["bfloat16"].argmax(-1) == out["float32"].argmax(-1)).float().mean()
    assert agree >= 0.75


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_and_rotary_match_hf(dtype, model_root):
    """Rotary is bit-identical; so is RMSNorm in bf16 (torch ops). In fp32 on CPU the norm is
    one C++ loop (kernels/cpu_fused.py) whose sum of squares runs in another order: within
    ~1e-7 relative, and the greedy oracle tests hold on top of it."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb
    from pagedserve.worker.layers.norm import RMSNorm
    from pagedserve.worker.layers.rotary import RotaryEmbedding, apply_rotary
    ours, theirs = RMSNorm(256, 1e-6, dtype), LlamaRMSNorm(256, 1e-6).to(dtype)
    ours.weight.data.copy_(torch.randn(256))
    theirs.weight.data.copy_(ours.weight)
    x, r = (torch.randn(40, 256) * 3).to(dtype), torch.randn(40, 256).to(dtype)
    same = torch.equal if dtype != torch.float32 else (
        lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6) and not torch.equal(a, torch.zeros_like(a)))
    assert same(ours(x.clone()), theirs(x))
    normed, summed = ours(x.clone(), r)  # fused residual add
    assert torch.equal(summed, x + r) and same(normed, theirs(x + r))

    path = make_test_model("llama3-rope", model_root)
    cfg = ModelConfig.from_pretrained(path)
    rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, dtype)
    hf_rope = LlamaRotaryEmbedding(transformers.AutoConfig.from_pretrained(path))
    positions = torch.tensor([0, 1, 5, 63, 64, 300, 1023])
    q, k = torch.randn(7, 4, cfg.head_dim).to(dtype), torch.randn(7, 2, cfg.head_dim).to(dtype)
    hf_cos, hf_sin = hf_rope(q, positions[None])
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    cos, sin = rope(positions)
    assert torch.equal(cos[:, 0], hf_cos[0]) and torch.equal(sin[:, 0], hf_sin[0])
    assert torch.equal(apply_rotary(q, cos, sin), hq[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), hk[0].transpose(0, 1))
