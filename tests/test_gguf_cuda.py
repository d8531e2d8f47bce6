"""A GGUF on CUDA (worker/layers/quantized.py's pack_cuda): Q4_0 and Q4_1 linear layers stay
4-bit as an Int4Weight of groups of 32 (kernels/quant/int4.py's from_gguf_q4; Q4_1's m as a
per-group min) and run on the Triton int4 GEMM; every other layer, and the embedding table,
is dequantized at load, as --quantization none loads it. Checked here without a GPU:

    blocks      from_gguf_q4's weights are the gguf package's fp32 values, bit for bit
    layers      what pack_cuda makes of one-type, mixed-type, padded and embedding shards
    model       a random Llama's GGUF packed for CUDA (on CPU tensors): every Q4 linear an
                Int4Weight whose weights are the dequantized model's, the rest plain and equal
    resolve     a GGUF on CUDA resolves to "gguf" (it used to be dequantized whole)
    Triton      the int4 kernel with mins (Q4_1) and zeros (Q4_0) against the reference, under
                the interpreter (fp32 and fp16 activations: it has no bf16), and compiled for
                sm_90 in bf16, fp16 and fp32 (-m scenarios)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _gguf_helpers import quantize, write_gguf_from_hf
from _triton_interp import aot_compiled, emit, gemm_cases_within_rounding
from pagedserve.kernels.quant.int4 import Int4Weight, dequantize_int4, from_gguf_q4


def _gguf_weight(qtype: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the file's rows, uint8; the gguf package's fp32 dequantization) of a random [n, k]."""
    import gguf

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quantize(w, qtype)
    deq = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype))
    return torch.from_numpy(raw), torch.from_numpy(np.asarray(deq, dtype=np.float32))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_blocks_as_int4_are_the_gguf_weights(qtype):
    raw, deq = _gguf_weight(qtype, 37, 96, seed=1)
    w = from_gguf_q4(raw, qtype, 96)
    assert (w.n, w.k, w.group_size) == (37, 96, 32)
    assert (w.zeros is None) == (qtype == "Q4_1") and (w.mins is None) == (qtype == "Q4_0")
    assert torch.equal(dequantize_int4(w), deq)  # bit for bit
    assert w.nbytes() < raw.numel() * 1.3  # 4-bit codes + an fp16 scale (and min, or a zero byte) per 32
    with pytest.raises(ValueError, match="Q4_0 or Q4_1"):
        from_gguf_q4(raw, "Q8_0", 96)


def _shards(rows: int, cols: int, parts: list[tuple[int, str, torch.Tensor]]):
    from pagedserve.worker.layers.quantized import QuantShards, QuantTensor

    s = QuantShards(rows, cols)
    for row, qtype, raw in parts:
        s.add(row, QuantTensor(qtype, (raw.shape[0], cols), raw), "w")
    return s


def test_pack_cuda_keeps_q4_gemms_and_dequantizes_the_rest():
    qa, da = _gguf_weight("Q4_1", 24, 64, seed=2)
    qb, db = _gguf_weight("Q4_1", 8, 64, seed=3)
    fused = _shards(32, 64, [(0, "Q4_1", qa), (24, "Q4_1", qb)]).pack_cuda(gemm=True)  # q, k of one QKV
    assert isinstance(fused, Int4Weight) and torch.equal(dequantize_int4(fused), torch.cat([da, db]))
    x = torch.randn(5, 64)
    assert torch.allclose(fused.linear(x), F.linear(x, torch.cat([da, db])), rtol=1e-5, atol=1e-6)
    q8, d8 = _gguf_weight("Q8_0", 8, 64, seed=4)
    mixed = _shards(32, 64, [(0, "Q4_1", qa), (24, "Q8_0", q8)]).pack_cuda(gemm=True)  # Q4_K_M-style
    assert isinstance(mixed, torch.Tensor) and torch.equal(mixed, torch.cat([da, d8]))
    table = _shards(32, 64, [(0, "Q4_1", qa), (24, "Q4_1", qb)]).pack_cuda(gemm=False)  # an embedding
    assert isinstance(table, torch.Tensor) and torch.equal(table, torch.cat([da, db]))
    padded = _shards(40, 64, [(0, "Q4_1", qa), (24, "Q4_1", qb)]).pack_cuda(gemm=True)  # a vocab shard's padding
    assert isinstance(padded, torch.Tensor) and torch.equal(padded[32:], torch.zeros(8, 64))


def test_a_gguf_model_packed_for_cuda_is_the_dequantized_model(tmp_path):
    from pagedserve.worker.layers.quantized import finish_quantized
    from pagedserve.worker.loading.gguf_loader import iter_gguf_native, iter_gguf_weights
    from pagedserve.worker.loading.loader import get_model_class
    from pagedserve.worker.loading.random_models import make_test_model
    from pagedserve.worker.model_config import ModelConfig

    path = write_gguf_from_hf(make_test_model("llama-gqa2-hd64", tmp_path / "hf"), str(tmp_path / "m.gguf"), "Q4_1",
                              {"token_embd.weight": "Q8_0"})
    cfg = ModelConfig.from_pretrained(path, dtype="float32", device="cpu", quantization="none")
    cls = get_model_class(cfg.architecture)
    native, plain = cls(cfg), cls(cfg)
    native.load_weights(iter_gguf_native(path, cfg.hf_config))
    sizes = finish_quantized(native, device_type="cuda")
    plain.load_weights(iter_gguf_weights(path))
    assert set(sizes) == {"int4"}
    layers = 0
    for (name, m), (_, ref) in zip(native.named_modules(), plain.named_modules()):
        packed = getattr(m, "_packed", None)
        if isinstance(packed, Int4Weight):
            layers += 1
            assert torch.equal(dequantize_int4(packed), ref.weight.data), name
        elif getattr(m, "weight", None) is not None and m.weight.numel():
            assert torch.equal(m.weight.data, ref.weight.data), name  # norms, the Q8_0 table
    assert layers == 4 * cfg.num_hidden_layers + (not cfg.tie_word_embeddings)  # qkv, o, gate_up, down; the head


def test_a_gguf_on_cuda_resolves_to_its_blocks(tmp_path):
    from pagedserve.worker.loading.random_models import make_test_model
    from pagedserve.worker.model_config import resolve_quantization

    path = write_gguf_from_hf(make_test_model("llama-gqa2-hd64", tmp_path / "hf"), str(tmp_path / "m.gguf"), "Q4_0")
    assert resolve_quantization(None, path, "cuda") == "gguf"
    assert resolve_quantization("gguf", path, "cuda") == "gguf"
    assert resolve_quantization("none", path, "cuda") is None
    assert resolve_quantization(None, path, "auto") is None  # the device is not decided yet


# ---------------------------------------------------------------- Triton, under the interpreter
def _triton_case(qtype: str, m: int, dtype: str, bias: bool) -> dict:
    from pagedserve.kernels.quant.triton_int4_gemm import int4_gemm_triton

    raw, deq = _gguf_weight(qtype, 72, 256, seed=m)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=g).to(getattr(torch, dtype))
    b = torch.randn(72, generator=g).to(x.dtype) if bias else None
    out = int4_gemm_triton(x, from_gguf_q4(raw, qtype, 256), b)
    ref = F.linear(x.float(), deq, None if b is None else b.float())
    return {"err": (out.float() - ref).abs().max().item(), "scale": ref.abs().max().item(), "dtype": str(out.dtype)}


TRITON_CASES = {
    "Q4_1_m1_fp32": ("Q4_1", 1, "float32", False),
    "Q4_1_m37_fp16_bias": ("Q4_1", 37, "float16", True),
    "Q4_0_m5_fp32_bias": ("Q4_0", 5, "float32", True),
    "Q4_0_m16_fp16": ("Q4_0", 16, "float16", False),
}


def test_the_triton_int4_gemm_runs_gguf_q4_under_the_interpreter():
    for name, r in gemm_cases_within_rounding(__file__, TRITON_CASES).items():
        assert r["dtype"] == f"torch.{TRITON_CASES[name][2]}"


@pytest.mark.slow  # twelve ptxas compiles
@pytest.mark.scenarios  # so under -m scenarios (pyproject.toml), not the default run
def test_the_int4_gemm_compiles_for_sm90_without_a_gpu():
    """Frontend + ptxas for the real target, bf16 included (the default dtype of a GGUF on CUDA)."""
    assert aot_compiled("--int4") == 12


if __name__ == "__main__":  # a child of interpreter_results: TRITON_INTERPRET=1 is set
    for case, args in TRITON_CASES.items():
        emit(case, lambda args=args: _triton_case(*args))
