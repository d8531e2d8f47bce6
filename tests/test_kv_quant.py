"""Quantised KV cache (--kv-cache-dtype fp8 | fp8_e5m2 | int8) on the CPU paths.

The story: a row written to the cache comes back within the format's rounding bound of
what was written; every CPU attention path (the fused C++ decode loop, the grouped torch
decode, torch prefill) equals the fp32 oracle run on the same quantised bytes; and the
pool holds exactly budget // bytes-per-block blocks, scales included, ~2x bf16's.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels import paged_attention, paged_attention_ref, write_kv_cache
from pagedserve.kernels.attention_ref import gather_kv_ref
from pagedserve.kernels.kv_quant import (QMAX, QUANT_DTYPES, SCALE_DTYPE, check_scales, decode_amax,
                                         dequantize_rows, encode_amax, kv_cache_torch_dtype, quantize_rows, row_scales)
from pagedserve.loadtest.kernel_checks.paged_batch import make_paged_batch
from pagedserve.scheduler.kv.kv_cache_dtype import canonical_kv_cache_dtype, kv_cache_bytes_per_token

FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
# Worst-case rounding of one value, relative to its row's scale s = absmax / QMAX:
#   int8: half a step, s / 2;  fp8 with m mantissa bits: |x| 2^-(m+1) for normals, and half
#   the subnormal step below (2^-10 s for e4m3, 2^-17 s for e5m2: what the outlier row pays).
# The scale is rounded up, never down, so nothing is clipped.
REL = {torch.float8_e4m3fn: 2.0 ** -4, torch.float8_e5m2: 2.0 ** -3}
SUB = {torch.float8_e4m3fn: 2.0 ** -10, torch.float8_e5m2: 2.0 ** -17}

MIXED = ([1, 1, 1, 1, 5, 7, 16, 3], [1, 33, 130, 17, 18, 7, 16, 40])


def _rows(seed: int = 0) -> torch.Tensor:
    """Rows with very different ranges, an outlier, an all-zero row and tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(200, 4, 64, generator=g) * torch.logspace(-3, 2, 200)[:, None, None]
    x[5, 1, 7] = 900.0  # an outlier costs only its own row's resolution
    x[9] = 0.0
    x[11] *= 1e-3  # rows of absmax below 2^-15 (the scale code's floor)
    return x


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=str)
def test_round_trip_error_within_the_formats_rounding_bound(dtype):
    x = _rows()
    q, s = quantize_rows(x, dtype)
    assert q.dtype == dtype and s.dtype == SCALE_DTYPE and s.shape == x.shape[:2]
    back = dequantize_rows(q, s)
    sf = row_scales(s, dtype)[..., None]
    err = (back - x).abs()
    if dtype == torch.int8:
        bound = sf / 2 * (1 + 1e-6)
        assert int(q.view(torch.int8).min()) >= -127  # symmetric grid
    else:
        bound = torch.maximum(x.abs() * REL[dtype], sf * SUB[dtype]) * (1 + 1e-6)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert torch.equal(back[9], torch.zeros_like(back[9]))  # zero row: finite scale, zeros back
    # Relative to each row's absmax, what the formats buy (int8 is the most precise; its step is
    # at most 9/8 of absmax / 127, since the absmax code has 4 significant bits):
    normal = x.abs().amax(-1) >= 2.0 ** -15
    rel = float((err / x.abs().amax(-1, keepdim=True).clamp_min(1e-30))[normal].max())
    assert rel < {torch.int8: 0.0045, torch.float8_e4m3fn: 0.0630, torch.float8_e5m2: 0.126}[dtype]
    # The floor: below 2^-15 a row is quantised as if its absmax were 2^-15 (code 0), within the
    # same bounds as above.
    assert bool(normal[5:9].all()) and bool((s[~normal] == 0).all()) and int((~normal).sum()) >= 4


def test_scale_byte_is_the_absmax_rounded_up_to_four_significant_bits():
    """UE5M3: 2^-15 .. 114,688 in steps of 1/8 per binade; codes round up (nothing clips), the
    floor and the ceiling saturate, NaN rows keep NaN (code 255)."""
    a = torch.tensor([0.0, 1e-9, 2.0 ** -15, 1.0, 1.0 + 2 ** -20, 1.125, 1.126, 448.0, 65504.0, 114688.0, 3e5,
                      float("inf"), float("nan")])
    codes = encode_amax(a)
    assert codes.dtype == torch.uint8
    assert codes.tolist() == [0, 0, 0, 120, 121, 121, 122, 190, 248, 254, 254, 254, 255]
    back = decode_amax(codes)
    assert back[:10].tolist() == [2.0 ** -15] * 3 + [1.0, 1.125, 1.125, 1.25, 448.0, 65536.0, 114688.0]
    assert bool(torch.isnan(back[-1]))
    # every finite code decodes to a value that encodes back to itself, and they increase
    every = decode_amax(torch.arange(255, dtype=torch.uint8))
    assert torch.equal(encode_amax(every), torch.arange(255, dtype=torch.uint8))
    assert bool((every[1:] > every[:-1]).all()) and float((every[1:] / every[:-1]).max()) <= 1.125


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=str)
def test_write_then_read_back_through_the_cache(dtype):
    x, y = _rows(1), _rows(2)
    k = torch.zeros(40, 16, 4, 64, dtype=dtype)
    v, ks, vs = torch.zeros_like(k), torch.zeros(40, 16, 4, dtype=SCALE_DTYPE), torch.zeros(40, 16, 4, dtype=SCALE_DTYPE)
    slots = torch.randperm(40 * 16, generator=torch.Generator().manual_seed(3))[:200]
    slots[::9] = -1  # skipped rows leave their slots untouched
    write_kv_cache(x, y, k, v, slots, "torch", ks, vs)
    keep = slots >= 0
    want_k, want_s = quantize_rows(x[keep], dtype)
    flat = k.view(torch.uint8).view(-1, 4, 64)
    assert torch.equal(flat[slots[keep]], want_k.view(torch.uint8))
    assert torch.equal(ks.view(-1, 4)[slots[keep]], want_s)
    written = torch.zeros(40 * 16, dtype=torch.bool)
    written[slots[keep]] = True
    assert not flat[~written].any() and not ks.view(-1, 4)[~written].any()
    # gather_kv_ref: one sequence's blocks back as fp32
    blocks = torch.tensor([3, 0])
    got = gather_kv_ref(v, vs, blocks, 20)
    ref = dequantize_rows(v[blocks].reshape(-1, 4, 64)[:20], vs[blocks].reshape(-1, 4)[:20])
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=str)
@pytest.mark.parametrize("path", ["fused", "grouped"])
def test_cpu_paths_equal_the_oracle_on_the_same_bytes(dtype, path, monkeypatch):
    from pagedserve.kernels import attention_torch, cpu_decode_attention

    if path == "grouped":
        monkeypatch.setattr(attention_torch, "decode_attention_cpu", lambda *a, **k: False)
    else:
        assert cpu_decode_attention.available()
    for nh, nkv, hd, bs in ((8, 2, 64, 16), (6, 2, 32, 32), (4, 4, 128, 16)):
        b = make_paged_batch(*MIXED, nh, nkv, hd, bs, seed=nh + hd, kv_dtype=dtype)
        md = b.attn_metadata
        ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, md.block_table, md.seq_lens, md.cu_seqlens_q, b.scale,
                                  k_scale=b.k_scale, v_scale=b.v_scale)
        out = torch.full_like(b.q, float("nan"))
        got = paged_attention(b.q, b.k_cache, b.v_cache, md, b.scale, "torch", out, b.k_scale, b.v_scale)
        assert not torch.isnan(got).any()  # NaN scales of unowned slots were never read
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_fused_decode_kernel_takes_quantised_caches():
    from pagedserve.kernels.cpu_decode_attention import decode_attention_cpu

    b = make_paged_batch([1] * 4, [300, 17, 1, 64], 8, 2, 64, seed=5, kv_dtype=torch.float8_e4m3fn)
    md = b.attn_metadata
    out = torch.empty_like(b.q)
    assert decode_attention_cpu(b.q, b.k_cache, b.v_cache, md.block_table, md.seq_lens, b.scale, out,
                                b.k_scale, b.v_scale)
    # No scales: it declines (the torch path then raises the clear error below).
    assert not decode_attention_cpu(b.q, b.k_cache, b.v_cache, md.block_table, md.seq_lens, b.scale, out)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        paged_attention(b.q, b.k_cache, b.v_cache, md, b.scale, "torch")
    with pytest.raises(ValueError, match="must be a contiguous torch.uint8"):
        check_scales(b.k_cache, b.v_cache, b.k_scale.float(), b.v_scale)


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=str)
def test_quantised_attention_stays_close_to_unquantised(dtype):
    b = make_paged_batch(*MIXED, 8, 2, 64, seed=11, poison=False)
    md = b.attn_metadata
    full = paged_attention(b.q, b.k_cache, b.v_cache, md, b.scale, "torch")
    (kq, ks), (vq, vs) = quantize_rows(b.k_cache, dtype), quantize_rows(b.v_cache, dtype)
    got = paged_attention(b.q, kq, vq, md, b.scale, "torch", None, ks, vs)
    err = float((got - full).abs().max() / full.abs().max())
    assert err < {torch.int8: 0.02, torch.float8_e4m3fn: 0.1, torch.float8_e5m2: 0.2}[dtype], err


# ---------------------------------------------------------------- sizing
SMOLLM2_135M = dict(layers=30, kv_heads=3, head_dim=64)  # real-shaped: 9 q heads, hidden 576
LLAMA3_8B = dict(layers=32, kv_heads=8, head_dim=128)


def test_names_and_bytes_per_token():
    assert canonical_kv_cache_dtype("fp8") == "fp8_e4m3" and canonical_kv_cache_dtype("FP8_E5M2") == "fp8_e5m2"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        canonical_kv_cache_dtype("fp4")
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    s = SMOLLM2_135M
    # 2 (K, V) x 30 layers x 3 KV heads x (64 values x 1 B + one 1 B scale)
    for kv in ("fp8", "fp8_e5m2", "int8"):
        assert kv_cache_bytes_per_token(s["layers"], s["kv_heads"], s["head_dim"], kv, 4) == 2 * 30 * 3 * 65 == 11_700
    assert kv_cache_bytes_per_token(s["layers"], s["kv_heads"], s["head_dim"], "auto", 2) == 2 * 30 * 3 * 128


def _worker(tmp_path, shape: dict, dtype: str, kv_cache_dtype: str, budget: int):
    from pagedserve.config import EngineConfig
    from pagedserve.worker.model_config import ModelConfig
    from pagedserve.worker.worker import Worker

    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64 * shape["kv_heads"] * 3,
          "intermediate_size": 128, "num_hidden_layers": shape["layers"], "num_attention_heads": 3 * shape["kv_heads"],
          "num_key_value_heads": shape["kv_heads"], "head_dim": shape["head_dim"], "vocab_size": 256,
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
    w = Worker(EngineConfig(model=str(tmp_path), device="cpu", kv_cache_memory_bytes=budget, dtype=dtype,
                            kv_cache_dtype=kv_cache_dtype))
    w.model_config = ModelConfig.from_dict(hf, str(tmp_path), dtype=dtype)
    return w


@pytest.mark.parametrize("shape,ratio_bf16,ratio_fp32", [(SMOLLM2_135M, 1.9, 3.8), (LLAMA3_8B, 1.9, 3.8)],
                         ids=["smollm2-135m", "llama3-8b"])
def test_exact_block_counts_at_one_budget(tmp_path, shape, ratio_bf16, ratio_fp32):
    budget = 1 << 30
    per_row = {"float32": shape["head_dim"] * 4, "bfloat16": shape["head_dim"] * 2, "fp8": shape["head_dim"] + 1}
    counts = {}
    for dt, kv in (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8"), ("bfloat16", "fp8_e5m2"),
                   ("float32", "int8")):
        w = _worker(tmp_path, shape, dt, kv, budget)
        per_block = 16 * 2 * shape["layers"] * shape["kv_heads"] * per_row[dt if kv == "auto" else "fp8"]
        assert w.kv_bytes_per_block() == per_block
        counts[dt, kv] = w.determine_num_available_blocks()
        assert counts[dt, kv] == budget // per_block
    q = counts["bfloat16", "fp8"]
    assert q == counts["bfloat16", "fp8_e5m2"] == counts["float32", "int8"]  # scales, not the model dtype
    assert q / counts["bfloat16", "auto"] >= ratio_bf16 and q / counts["float32", "auto"] >= ratio_fp32
    if shape is SMOLLM2_135M:  # the numbers BENCHMARKS.md quotes
        assert (counts["float32", "auto"], counts["bfloat16", "auto"], q) == (1456, 2912, 5735)


def test_allocated_pool_is_what_the_budget_paid_for(tmp_path):
    """The runner's tensors, scales included, take exactly num_blocks x bytes per block."""
    from pagedserve.worker.model_runner import ModelRunner

    shape = dict(layers=3, kv_heads=2, head_dim=64)
    for kv in ("auto", "fp8", "int8"):
        w = _worker(tmp_path, shape, "float32", kv, 3 << 20)
        n = w.determine_num_available_blocks()
        runner = ModelRunner(torch.nn.Module(), w.model_config, block_size=16, device=torch.device("cpu"))
        runner.initialize_cache(n, shape["kv_heads"], w.kv_cache_dtype)
        assert len(runner.kv_caches) == 3 and len(runner.kv_caches[0]) == (2 if kv == "auto" else 4)
        nbytes = sum(t.numel() * t.element_size() for layer in runner.kv_caches for t in layer)
        assert nbytes == n * w.kv_bytes_per_block() <= 3 << 20
        assert math.floor((3 << 20) / w.kv_bytes_per_block()) == n


def test_kv_size_cli_reports_values_and_scales(tmp_path):
    import json
    import subprocess
    import sys

    from test_kv_size import LLAMA3_70B

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B))
    out = subprocess.run([sys.executable, "-m", "pagedserve.cluster.cli.kv_size", "--model", str(tmp_path),
                          "--kv-cache-dtype", "fp8", "--max-model-len", "4096"], capture_output=True, text=True,
                         check=True).stdout
    assert ("KV cache per token: 165,120 bytes = 161.25 KiB per token (160 KiB of fp8_e4m3 values + 1.25 KiB of "
            "1-byte scales, one per token and KV head)") in out


# ---------------------------------------------------------------- the engine, unchanged paths
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_prefix_caching_and_preemption_unchanged_on_a_quantised_cache(tmp_path, kv):
    """A cached block's bytes depend only on its tokens, so a prefix-cache hit, and the
    recompute after a preemption, give the outputs of a plain run on the same cache format."""
    from test_engine_oracle import PROMPT_LENS, _engine, _params, _prompts, _run

    from pagedserve.worker.loading.random_models import make_test_model

    # "Same tokens, same bytes" needs K/V computed the same whatever the batch: oneDNN's packed
    # GEMM and the panel GEMM are batch-invariant here, plain F.linear (MKL) is not (a prefill
    # chunk and a decode row round differently, and a random model has near ties). The default
    # probe picks per engine, by timing; pin one.
    pin = dict(kv_cache_dtype=kv, cpu_linear="onednn")
    path = make_test_model("llama-gqa4-hd128", tmp_path)
    prompts = _prompts(512)
    plain = _run(_engine(path, enable_prefix_caching=False, **pin), prompts, _params())
    small = _engine(path, num_gpu_blocks_override=24, max_num_batched_tokens=128, enable_prefix_caching=False,
                    **pin)
    assert _run(small, prompts, _params()) == plain
    assert small.get_stats().num_preemptions > 0
    cached = _engine(path, enable_prefix_caching=True, **pin)
    first = PROMPT_LENS.index(150)
    _run(cached, [prompts[first]], [_params()[first]])
    assert _run(cached, prompts, _params()) == plain
    assert cached.get_stats().prefix_cache_hits >= 5 * 64
