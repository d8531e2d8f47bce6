"""GGUF weights run in their blocks (``--quantization gguf``, kernels/cpu_gguf.py), against the
same weights dequantized (the gguf package's ``dequantize``; ``--quantization none``):

    kernel      every block type, rows of x M = 1, 2, 3, 8, 17, 70 (the register path up to 4,
                the strip path beyond, 64 rows of x a pass), odd N: within fp32 rounding of
                F.linear on the dequantized weight (measured against float64, relative to
                sum |w x|); dequantized rows bit-exact
    model       a small random Llama written as a GGUF of each type (Q4_K_M-style mixed types
                too, so one fused projection holds two types): greedy tokens of the native
                engine against the dequantized one, and the bytes it keeps
    default     SmolLM2-135M-Instruct (Q4_1, a Q8_0 tied embedding) served natively answers the
                README's example; greedy native against dequantized on eight chat prompts
    refusals    a type the kernel lacks is a startup error naming it and the supported list

The K-quants have no quantizer in the gguf package: loadtest/gguf_writer.quantize_k writes them.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _gguf_helpers import quantize, write_gguf_from_hf
from pagedserve.kernels import cpu_gguf
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.loading.random_models import make_test_model

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="the GGUF C++ extension does not build here")

TYPES = list(cpu_gguf.QTYPES)
ROWS = (1, 2, 3, 8, 17, 70)


def _dequantize(raw: np.ndarray, qtype: str) -> torch.Tensor:
    import gguf

    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype)),
                                       dtype=np.float32))


def _weight(qtype: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """(GGUF rows, the same weight dequantized) of a random [n, k] weight."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quantize(w, qtype)
    return raw, _dequantize(raw, qtype)


def _check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """y within fp32 rounding of x w^T + b: its error against float64 at most 1e-6 of
    sum |x w| + |b| per output (an fp32 dot product's error bound is ~K eps of that; the
    measured is ~1e-7), and no worse than 4x F.linear's own fp32 error."""
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    if bias is not None:
        ref, scale = ref + bias.double(), scale + bias.double().abs()
    err = ((y.double() - ref).abs() / scale).max().item()
    aten = ((F.linear(x, w, bias).double() - ref).abs() / scale).max().item()
    assert err <= max(1e-6, 4 * aten), (err, aten)


@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_equals_the_dequantized_weight_within_float_rounding(qtype):
    block = cpu_gguf.BLOCKS[qtype][0]
    for n, k in ((37, 2 * max(block, 256)), (13, max(block, 256)), (8, 3 * block if block == 256 else 96)):
        raw, w = _weight(qtype, n, k, seed=n)
        packed = cpu_gguf.GGUFWeight([cpu_gguf.pack(torch.from_numpy(raw), qtype, k)])
        ids = torch.tensor([0, n - 1, n // 2, 0])
        assert torch.equal(cpu_gguf.dequantize_rows(packed, ids), w[ids])  # bit for bit, as gguf
        assert torch.equal(cpu_gguf.dequantize_rows(packed, torch.arange(n)), w)
        for m in ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            bias = torch.randn(n) if m % 2 else None
            _check_close(cpu_gguf.linear(x, packed, bias), x, w, bias)
        # a leading batch dim and bf16 activations (computed in fp32, returned in bf16)
        x3 = torch.randn(2, 3, k)
        assert torch.allclose(cpu_gguf.linear(x3, packed), F.linear(x3, w), rtol=1e-4, atol=1e-5)
        assert cpu_gguf.linear(x3.bfloat16(), packed).dtype == torch.bfloat16


def test_a_weight_of_two_types_writes_each_part_into_its_columns():
    # A Q4_K_M fused QKV: q and k in Q4_K, v in Q6_K, each part its own packed run.
    raw_a, wa = _weight("Q4_K", 21, 256, seed=1)
    raw_b, wb = _weight("Q6_K", 11, 256, seed=2)
    packed = cpu_gguf.GGUFWeight([cpu_gguf.pack(torch.from_numpy(raw_a), "Q4_K", 256),
                                  cpu_gguf.pack(torch.from_numpy(raw_b), "Q6_K", 256)])
    w = torch.cat([wa, wb])
    assert (packed.n, packed.k, packed.qtypes()) == (32, 256, ["Q4_K", "Q6_K"])
    for m in ROWS:
        x, bias = torch.randn(m, 256), torch.randn(32)
        _check_close(cpu_gguf.linear(x, packed, bias), x, w, bias)
    ids = torch.tensor([30, 0, 21, 20])
    assert torch.equal(cpu_gguf.dequantize_rows(packed, ids), w[ids])


def test_packing_keeps_the_files_bytes():
    # 8 rows a group: a block type's packed bytes are the file's (Q4_K, Q5_K: 6-bit scales
    # unpacked to a byte each, +2.8% and +2.3%); the padding rows of the last group are zero
    # blocks, which dequantize to 0.
    for qtype in TYPES:
        block, block_bytes = cpu_gguf.BLOCKS[qtype]
        raw, _ = _weight(qtype, 16, 256 if block == 256 else 64, seed=0)
        part = cpu_gguf.pack(torch.from_numpy(raw), qtype, raw.shape[1] // block_bytes * block)
        assert part.nbytes() / raw.nbytes <= {"Q4_K": 1.028, "Q5_K": 1.023}.get(qtype, 1.0)
    raw, _ = _weight("Q4_1", 3, 64, seed=0)
    part = cpu_gguf.pack(torch.from_numpy(raw), "Q4_1", 64)
    assert part.packed.shape[0] == 1
    padded = cpu_gguf.GGUFWeight([cpu_gguf.GGUFPart("Q4_1", 8, 64, part.packed)])
    assert torch.equal(cpu_gguf.dequantize_rows(padded, torch.arange(3, 8)), torch.zeros(5, 64))


# ---------------------------------------------------------------- whole models
PROMPTS = [[5, 17, 99, 300, 20, 21, 22, 23], [7], list(range(40, 90)), [260, 261, 3, 3, 3],
           [100, 200, 300, 400], [9, 8, 7, 6, 5, 4], [311, 12, 12, 12, 90, 91], list(range(400, 430))]
MAX_TOKENS = 16
# (test shape, file type, per-tensor overrides): hidden 256 for the K-quants' 256-weight blocks
MODELS = {
    "Q8_0": ("llama-gqa2-hd64", "Q8_0", None),
    "Q4_0": ("llama-gqa2-hd64", "Q4_0", None),
    "Q4_1-tied-qwen2": ("qwen2-tied", "Q4_1", None),  # tied head on the embedding's blocks, qkv bias
    "Q4_K": ("llama-gqa2-hd64", "Q4_K", None),
    "Q5_K": ("llama-gqa2-hd64", "Q5_K", None),
    "Q6_K": ("llama-gqa2-hd64", "Q6_K", None),
    "Q4_K_M": ("llama-gqa2-hd64", "Q4_K", {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K",
                                           "token_embd.weight": "Q8_0"}),
    # Q4_K_M on a model whose rows are not whole super-blocks (SmolLM2-135M's 576): llama.cpp's
    # quantize falls back to Q5_0 for Q4_K (and to Q5_1 for Q5_K's, in Q5_K_M)
    "Q4_K_M-fallback": ("llama-gqa2-hd64", "Q5_0", {"ffn_down.weight": "Q5_1", "token_embd.weight": "Q8_0"}),
}


@pytest.fixture(scope="module")
def gguf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-native")


def _model_file(root, key: str) -> str:
    shape, qtype, types = MODELS[key]
    out = root / f"{key}.gguf"
    if not out.exists():
        write_gguf_from_hf(make_test_model(shape, root / "hf"), str(out), qtype, types)
    return str(out)


def _engine(model, **kw):
    from pagedserve.cluster.llm import LLM

    return LLM(model=model, dtype="float32", max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=8, **kw)


def _greedy(model, prompts=PROMPTS, **kw) -> list[list[int]]:
    llm = _engine(model, **kw)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def _worker_model(llm):
    return llm.engine.executor.worker.runner.model


@pytest.mark.parametrize("key", list(MODELS))
def test_greedy_native_equals_dequantized_on_most_prompts(gguf_root, key):
    path = _model_file(gguf_root, key)
    llm = _engine(path)
    try:
        model = _worker_model(llm)
        packed = [m._packed for m in model.modules() if isinstance(getattr(m, "_packed", None), cpu_gguf.GGUFWeight)]
        n_layers = len(model.model.layers)
        assert len(packed) == 4 * n_layers + 1  # qkv, o, gate_up, down a layer, and the head
        if key == "Q4_K_M":
            assert model.model.layers[0].self_attn.qkv_proj._packed.qtypes() == ["Q4_K", "Q6_K"]
            assert model.lm_head._packed.qtypes() == ["Q4_K"]
        if "tied" in key:
            assert model.lm_head._packed is model.model.embed_tokens._quant
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
        native = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    dequantized = _greedy(path, quantization="none")
    same = sum(a == b for a, b in zip(native, dequantized))
    print(f"{key}: greedy native == dequantized on {same} of {len(PROMPTS)} prompts")
    assert same >= len(PROMPTS) - 1, (native, dequantized)


def test_the_weights_stay_in_their_blocks(gguf_root):
    # What a step reads: the blocks (within 3% of the file's bytes), not an fp32 copy; the
    # plain parameters left are the norms.
    from pagedserve.worker.loading.gguf_index import read_gguf_index

    path = _model_file(gguf_root, "Q4_K_M")
    index = read_gguf_index(path)
    file_blocks = sum(t.nbytes for t in index.tensors.values() if t.qtype != "F32")
    llm = _engine(path)
    try:
        model = _worker_model(llm)
        packed = {id(m._packed): m._packed.nbytes() for m in model.modules()
                  if isinstance(getattr(m, "_packed", None), cpu_gguf.GGUFWeight)}
        packed[id(model.model.embed_tokens._quant)] = model.model.embed_tokens._quant.nbytes()
        plain = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name)
    finally:
        llm.shutdown()
    assert file_blocks <= sum(packed.values()) <= 1.03 * file_blocks
    assert plain == 0


def test_a_type_the_kernel_lacks_is_a_startup_error_naming_it(gguf_root):
    path = str(gguf_root / "tq2_0.gguf")  # llama.cpp's ternary type (BitNet): no kernel here
    write_gguf_from_hf(make_test_model("llama-gqa2-hd64", gguf_root / "hf"), path, "Q8_0",
                       {"ffn_up.weight": "TQ2_0"})
    with pytest.raises(ValueError, match=r"type TQ2_0 \(e\.g\. blk\.\d\.ffn_up\.weight\).*supported: Q8_0, Q4_0, "
                                         r"Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F32, F16, BF16\. --quantization none"):
        _engine(path)
    assert len(_greedy(path, prompts=PROMPTS[:1], quantization="none")[0]) == MAX_TOKENS  # dequantized, it runs


def test_quantization_flag_is_checked():
    from pagedserve.worker.model_config import resolve_quantization

    with pytest.raises(ValueError, match="quantization must be one of gguf, awq, gptq, fp8, compressed-tensors, "
                                         "modelopt, none"):
        resolve_quantization("bitsandbytes", None, "cpu")
    with pytest.raises(ValueError, match="--quantization awq needs a checkpoint whose config.json has a "
                                         "quantization_config"):  # tests/test_hf_quant.py runs those
        resolve_quantization("awq", "x.gguf", "cpu")
    with pytest.raises(ValueError, match="needs a GGUF checkpoint"):
        resolve_quantization("gguf", None, "cpu")
    assert resolve_quantization("none", "x.gguf", "cpu") is None  # test_gguf_cuda.py: on CUDA


# ---------------------------------------------------------------- the default model
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "What is 12 plus 7?", "Translate 'good morning' into Spanish.", "Give me one tip for sleeping better.",
             "Who wrote Romeo and Juliet?", "Explain what a CPU does in one sentence."]


def _chat(quantization):
    from pagedserve.cluster.llm import LLM

    llm = LLM(model=None, dtype="float32", max_model_len=512, quantization=quantization)
    try:
        assert llm.engine.model_config.quantization == (None if quantization == "none" else "gguf")
        tok = llm.engine.tokenizer
        prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False).input_ids
                   for q in QUESTIONS]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], outs[0].outputs[0].text
    finally:
        llm.shutdown()


def test_default_model_served_natively_answers_the_readme_example():
    native, paris = _chat(None)
    assert paris == "The capital of France is Paris."  # README.md's example answer
    dequantized, _ = _chat("none")
    same = sum(a == b for a, b in zip(native, dequantized))
    print(f"SmolLM2-135M-Instruct Q4_1: greedy native == dequantized on {same} of {len(QUESTIONS)} chat prompts")
    assert same >= len(QUESTIONS) - 1
