"""int8 activations on GGUF weights (``--cpu-int8-activations``, kernels/cpu_gguf.cpp): the
kernel against its arithmetic done in float64 (x quantized per 32 as the kernel does, the
weight dequantized by the gguf package), for 1 to 70 rows of x, with a bias and in a weight of
two parts; then a tiny GGUF model served with the flag: its layers' GEMMs take the path (not
the LM head), and the logprobs it gives a text move by far less than the 4-bit weights' do.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _gguf_helpers import quantize, write_gguf_from_hf
from pagedserve.kernels import cpu_gguf
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.loading.random_models import make_test_model

pytestmark = pytest.mark.skipif(not cpu_gguf.available() or cpu_gguf.isa() == "scalar",
                                reason="the int8 path is the AVX2 and AVX-512 VNNI builds'")

ROWS = (1, 3, 4, 5, 7, 70)  # decode-sized and prefill-sized (VNNI: tiles of 1 to 8 rows)


def _weight(qtype: str, n: int, k: int, seed: int):
    """(raw GGUF rows, dequantized [n, k] float64, per-block min [n, k / 32] or None)."""
    import gguf

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quantize(w, qtype)
    deq = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype)),
                                      dtype=np.float64))
    mins = None
    if qtype in ("Q4_1", "Q5_1"):  # block bytes: d (f16), m (f16), (Q5_1: 4 of fifth bits,) 16 of quants
        raw_b = raw.reshape(n, k // 32, cpu_gguf.BLOCKS[qtype][1])
        mins = torch.from_numpy(raw_b[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
    elif qtype in ("Q4_K", "Q5_K"):  # d, dmin (f16), 12 bytes of 6-bit scales and mins: the mins, dmin mn
        blocks = raw.reshape(n, k // 256, -1)
        dmin = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        q = blocks[:, :, 4:16].astype(np.int64)
        mn = np.stack([q[..., j + 4] & 63 if j < 4 else (q[..., j + 4] >> 4) | ((q[..., j] >> 6) << 4)
                       for j in range(8)], axis=-1)
        mins = torch.from_numpy((-dmin[..., None] * mn).reshape(n, k // 32))  # w = d sc q + min
    return raw, deq, mins


def _reference(x: torch.Tensor, deq: torch.Tensor, mins) -> torch.Tensor:
    """The int8 path's arithmetic in float64: x per 32 quantized (dx = max|x| / 127, round
    half to even); Q4_1's and Q5_1's min times the block's exact sum of x."""
    m, k = x.shape
    xb = x.double().view(m, k // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    xq = (xb / torch.where(d > 0, d, torch.ones_like(d))).round() * d
    if mins is None:
        return xq.reshape(m, k) @ deq.T
    # d q x_q + m x (m: the block's or sub-block's min): (deq - m) against x_q, the min against x
    m_full = mins.repeat_interleave(32, dim=1)
    return xq.reshape(m, k) @ (deq - m_full).T + x.double() @ m_full.T


@pytest.mark.parametrize("qtype", cpu_gguf.INT8_QTYPES)
def test_int8_kernel_equals_its_arithmetic(qtype):
    n, k = 37, 160 if cpu_gguf.BLOCKS[qtype][0] == 32 else 512  # a last group of 5 rows; several blocks along K
    raw, deq, mins = _weight(qtype, n, k, seed=1)
    part = cpu_gguf.pack(torch.from_numpy(raw.view(np.uint8).reshape(n, -1)), qtype, k)
    w8, w32 = cpu_gguf.GGUFWeight([part], int8=True), cpu_gguf.GGUFWeight([part])
    bias = torch.randn(n)
    g = torch.Generator().manual_seed(0)
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        x[:, 7] *= 40  # an outlier channel, as real activations have
        y = cpu_gguf.linear(x, w8, bias)
        # AVX2 builds keep Q5_K and Q6_K on the fp32 strip above 4 rows (gemm_int8 says why)
        fp32 = qtype in ("Q5_K", "Q6_K") and m > 4 and cpu_gguf.isa() == "avx2"
        ref = (x.double() @ deq.T if fp32 else _reference(x, deq, mins)) + bias.double()
        scale = x.double().abs() @ deq.abs().T + bias.double().abs()
        assert ((y.double() - ref).abs() / scale).max().item() < 1e-6, (qtype, m)
        # and it is not the fp32 path (x's rounding shows against that one), but where Q5_K
        # and Q6_K take the fp32 strip for more rows than a decode step has
        exact = cpu_gguf.linear(x, w32, bias).double()
        assert (((y.double() - exact).abs() / scale).max().item() > 1e-5) != fp32


def test_a_weight_of_two_types_takes_int8_in_each_part():
    k = 64
    (ra, da, _), (rb, db, _) = _weight("Q8_0", 16, k, 2), _weight("Q4_0", 9, k, 3)
    parts = [cpu_gguf.pack(torch.from_numpy(r.view(np.uint8).reshape(r.shape[0], -1)), t, k)
             for r, t in ((ra, "Q8_0"), (rb, "Q4_0"))]
    x = torch.randn(3, k)
    y = cpu_gguf.linear(x, cpu_gguf.GGUFWeight(parts, int8=True))
    ref = _reference(x, torch.cat([da, db]), None)
    assert torch.allclose(y.double(), ref, rtol=0, atol=1e-5)


PROMPTS = [[1, 5, 9, 2, 77, 31, 300, 12, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 60, 61, 8, 8, 8, 8, 250, 251, 3,
            99, 100, 101, 17, 18, 19, 20, 400, 401, 402, 7, 6, 5]]


def _prompt_logprobs(path, **kw):
    """(each GEMM's int8 flag, the logprob of each prompt token given those before it)."""
    from pagedserve.cluster.llm import LLM

    llm = LLM(model=path, dtype="float32", max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=8, **kw)
    try:
        model = llm.engine.executor.worker.runner.model
        int8 = [m._packed.int8 for m in model.model.modules() if isinstance(getattr(m, "_packed", None), cpu_gguf.GGUFWeight)]
        assert not getattr(model.lm_head._packed, "int8", False)  # the logits take fp32 activations
        params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0, detokenize=False)
        out = llm.generate(PROMPTS, params, use_tqdm=False)[0]
        logprobs = [p.logprobs[0] for p in out.prompt_logprobs[1:]]
        return int8, torch.tensor(logprobs, dtype=torch.float64)
    finally:
        llm.shutdown()


def test_served_with_int8_activations_moves_logprobs_by_rounding_only(tmp_path):
    """A random tiny model's greedy tokens are near ties at every step, so the model is
    compared by the logprob it gives each prompt token: int8 activations move them by x's
    rounding, far less than the quantization of the weights does."""
    path = str(tmp_path / "m.gguf")
    hf = make_test_model("llama-gqa2-hd64", tmp_path / "hf")
    write_gguf_from_hf(hf, path, "Q4_1", {"token_embd.weight": "Q8_0"})
    on, lp_on = _prompt_logprobs(path, cpu_int8_activations=True)
    off, lp_off = _prompt_logprobs(path)
    _, lp_hf = _prompt_logprobs(hf)  # the unquantized weights
    assert on and all(on) and not any(off)  # every layer's GEMM takes the flag
    int8_shift = (lp_on - lp_off).abs().mean().item()
    weight_shift = (lp_off - lp_hf).abs().mean().item()
    print(f"mean |d logprob|: int8 activations {int8_shift:.4f}, 4-bit weights {weight_shift:.4f}")
    assert 0 < int8_shift < 0.5 * weight_shift
