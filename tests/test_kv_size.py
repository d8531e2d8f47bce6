"""KV sizing calculator: the published Llama-3-70B numbers, parameter counts equal to
transformers' own models, and the CLI on a directory that holds only config.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.cluster.cli.kv_size import GiB, count_params, kv_size, load_hf_config

ROOT = Path(__file__).resolve().parents[1]

LLAMA3_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
              "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
              "torch_dtype": "bfloat16", "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def test_llama3_70b_bytes_per_token_and_per_sequence():
    r = kv_size(LLAMA3_70B, max_model_len=4096, gpu_memory_gib=80, num_gpus=4)
    # 2 (K, V) x 80 layers x 8 KV heads x 128 head_dim x 2 bytes (bf16)
    assert r.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert r.kib_per_token == 320.0
    assert r.gib_per_seq == 1.25
    # Meta quotes 70.6B parameters for Llama 3 70B.
    assert 70.5e9 < r.num_params < 70.6e9
    # 4 x 80 GiB x 0.9 minus 131.4 GiB of weights leaves ~156.6 GiB: 125 full-length sequences.
    assert r.max_num_seqs == 125
    assert r.weight_bytes_per_gpu * 4 >= r.weight_bytes


def test_fp8_cache_halves_and_tp_replicates_kv_heads():
    fp8 = kv_size(LLAMA3_70B, max_model_len=4096, kv_cache_dtype="fp8", num_gpus=4)
    # 160 KiB of 1-byte values, plus one 1-byte scale per (token, KV head) of K and of V
    # (2 x 80 x 8 x 1 B = 1.25 KiB), which the budget counts too.
    assert fp8.kv_bytes_per_token - fp8.kv_scale_bytes_per_token == 160 * 1024
    assert fp8.kv_scale_bytes_per_token == 1280 and fp8.kib_per_token == 161.25
    assert fp8.gib_per_seq == 161.25 * 4096 / 2**20
    for name in ("fp8_e4m3", "fp8_e5m2", "int8"):
        assert kv_size(LLAMA3_70B, max_model_len=4096, kv_cache_dtype=name).kv_bytes_per_token == 165_120
    # With 16 GPUs and 8 KV heads each GPU still holds one whole KV head (replicated), so the
    # per-GPU cache per token is 1/8 of the total, not 1/16: fewer sequences than 4x the tp=4 case.
    tp4 = kv_size(LLAMA3_70B, max_model_len=4096, num_gpus=4, gpu_memory_gib=80)
    tp16 = kv_size(LLAMA3_70B, max_model_len=4096, num_gpus=16, gpu_memory_gib=80)
    per_gpu_seq_bytes = 2 * 80 * 1 * 128 * 2 * 4096
    assert tp16.max_num_seqs == tp16.kv_budget_bytes_per_gpu // per_gpu_seq_bytes
    assert tp16.max_num_seqs < 8 * tp4.max_num_seqs


GEMMA3_27B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 5376,
              "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
              "head_dim": 128, "vocab_size": 262208, "max_position_embeddings": 131072, "sliding_window": 1024,
              "sliding_window_pattern": 6, "query_pre_attn_scalar": 168, "torch_dtype": "bfloat16"}


def test_sliding_window_layers_keep_only_their_window_at_long_context():
    """Gemma 3 27B: 52 local layers (window 1,024) and 10 global ones, the hybrid KV cache's
    groups of 10 layers (one full, six sliding, the last with 2 of its 10 slots used). At
    128K tokens a full group holds 8,192 blocks and each sliding one 65 (the window's 64 and
    the newest): 8,582 blocks of 10 layers instead of 62 layers x 8,192."""
    r = kv_size(GEMMA3_27B, max_model_len=131072, gpu_memory_gib=80, num_gpus=4)
    layer_token = 2 * 16 * 128 * 2  # K and V, 16 KV heads, head_dim 128, bf16
    assert r.kv_bytes_per_token == 62 * layer_token  # a token at short context: every layer
    assert r.kv_bytes_per_seq_all_layers == 62 * layer_token * 131072
    assert r.kv_bytes_per_seq == (8192 + 6 * 65) * 16 * 10 * layer_token
    assert (r.sliding_window, r.num_sliding_layers) == (1024, 52)
    assert 0.83 < 1 - r.kv_bytes_per_seq / r.kv_bytes_per_seq_all_layers < 0.84
    per_gpu_seq = r.kv_bytes_per_seq // 4  # 16 KV heads over 4 GPUs
    assert r.max_num_seqs == r.kv_budget_bytes_per_gpu // per_gpu_seq
    # Short context: the window covers the whole sequence and the groups' idle slots would
    # cost more than it saves, so the engine keeps one group (every layer every block).
    short = kv_size(GEMMA3_27B, max_model_len=1024)
    assert short.kv_bytes_per_seq == short.kv_bytes_per_seq_all_layers and short.sliding_window is None
    # A model without sliding layers reads as before.
    assert kv_size(LLAMA3_70B, max_model_len=4096).sliding_window is None


def test_mistral_and_qwen2_windows_are_sized_as_the_engine_runs_them():
    """Mistral 7B v0.1's window (4,096) on all 32 layers: one sliding group, at 32K tokens
    257 blocks a sequence instead of 2,048. Qwen2.5's config names a window but not
    use_sliding_window: every layer keeps every token."""
    mistral = {**LLAMA3_70B, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
               "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "max_position_embeddings": 32768, "sliding_window": 4096}
    r = kv_size(mistral, max_model_len=32768)
    assert (r.sliding_window, r.num_sliding_layers) == (4096, 32)
    assert r.kv_bytes_per_seq * 2048 == r.kv_bytes_per_seq_all_layers * 257
    qwen = {**mistral, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
            "max_window_layers": 28}
    assert kv_size(qwen, max_model_len=32768).sliding_window is None
    r = kv_size({**qwen, "use_sliding_window": True}, max_model_len=32768)
    assert (r.sliding_window, r.num_sliding_layers) == (4096, 4)  # layers 28 .. 31


def test_weights_that_do_not_fit_leave_zero_sequences():
    r = kv_size(LLAMA3_70B, max_model_len=4096, gpu_memory_gib=80, num_gpus=1)
    assert r.kv_budget_bytes_per_gpu == 0 and r.max_num_seqs == 0
    with pytest.raises(ValueError, match="multiple"):
        kv_size(LLAMA3_70B, max_model_len=4096, num_gpus=3, tensor_parallel_size=2)


def test_replicas_multiply_sequences():
    cfg = {**LLAMA3_70B, "num_hidden_layers": 8}
    one = kv_size(cfg, max_model_len=2048, num_gpus=2, tensor_parallel_size=2)
    two = kv_size(cfg, max_model_len=2048, num_gpus=4, tensor_parallel_size=2)
    assert two.num_replicas == 2 and two.max_num_seqs == 2 * one.max_num_seqs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_param_count_equals_transformers(arch):
    import transformers

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":  # q/k/v biases, tied embeddings
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(cfg)
    expected = sum(p.numel() for p in model.parameters())
    assert count_params(cfg.to_dict()) == expected


def test_cli_reports_the_sliding_window_saving(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_27B))
    out = subprocess.run([sys.executable, "-m", "pagedserve.cluster.cli.kv_size", "--model", str(tmp_path),
                          "--max-model-len", "131072"], capture_output=True, text=True, check=True).stdout
    assert "52 of 62 layers slide over 1,024 tokens" in out and "62 GiB if every layer kept every token" in out
    assert "83.1" in out and "% saved" in out


def test_cli_on_a_directory_with_only_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B))
    assert load_hf_config(tmp_path)["num_hidden_layers"] == 80
    cmd = [sys.executable, "-m", "pagedserve.cluster.cli.kv_size", "--model", str(tmp_path), "--gpu-memory-gib", "80",
           "--num-gpus", "4", "--max-model-len", "4096"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "320 KiB per token" in out
    assert "1.25 GiB per 4,096-token sequence" in out
    assert "fits: 125 sequences" in out
    js = subprocess.run([*cmd, "--json"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    data = json.loads(js)
    assert data["kv_bytes_per_token"] == 327_680 and data["kv_bytes_per_seq"] == int(1.25 * GiB)
    bad = subprocess.run([*cmd[:4], str(tmp_path / "missing")], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "no config.json" in bad.stderr
