"""Hugging Face quantized checkpoints (issue 57 item 2): AWQ, GPTQ (v1 / v2, sym / asym,
act-order) and fp8 (compressed-tensors per tensor / per channel, ModelOpt) load packed and
run to the tokens transformers gives on the dequantized weights.

Story: a tiny random Llama is quantized by the test into each published layout
(tests/_hf_quant_helpers.py) and written as two safetensors shards, beside the same model
with the dequantized weights. The loader must rebuild exactly the dequantized weights from
the packed tensors; the CPU GEMM must match F.linear on them; the whole model's greedy
continuation must match transformers' on the dequantized model, prompt for prompt; the
Triton kernels must match the dequantized reference under the interpreter; tensor-parallel
slices must be whole groups (a split inside one is a startup error naming it) and put
together again give the whole weight; a config we cannot run is refused by name.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
import transformers

from _hf_quant_helpers import pack_along_inputs, quantize_fp8, quantize_int4, quantize_linear, write_quantized
from _triton_interp import emit, gemm_cases_within_rounding
from pagedserve.kernels import cpu_gguf
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.quant import Fp8Weight, Int4Weight
from pagedserve.kernels.quant.fp8 import dequantize_fp8
from pagedserve.kernels.quant.int4 import as_q4_1, dequantize_int4
from pagedserve.worker.layers.hf_quantized import Fp8Shards, Fp8Tensor, Int4Shards, Int4Tensor
from pagedserve.worker.loading.hf_quant_loader import iter_hf_quantized
from pagedserve.worker.loading.loader import load_model
from pagedserve.worker.loading.quant_config import parse_quant_config
from pagedserve.worker.loading.random_models import make_test_model
from pagedserve.worker.model_config import ModelConfig, resolve_quantization

# name: (format, options). One checkpoint each, built once per session.
FORMATS = {
    "awq-g128": ("awq", dict(group_size=128)),
    "gptq-v1-sym-g128": ("gptq", dict(group_size=128, sym=True, zero_bias=True)),
    "gptq-v1-asym-g64": ("gptq", dict(group_size=64, sym=False)),
    "gptq-v2-asym-actorder-g32": ("gptq", dict(group_size=32, sym=False, desc_act=True, checkpoint_format="gptq_v2")),
    "gptq-v1-sym-actorder-g32": ("gptq", dict(group_size=32, sym=True, desc_act=True)),
    "fp8-ct-tensor": ("fp8", dict(per_channel=False)),
    "fp8-ct-channel": ("fp8", dict(per_channel=True)),
    "fp8-modelopt": ("fp8", dict(modelopt=True)),
}
PROMPTS = 8
NEW_TOKENS = 12


@pytest.fixture(scope="session")
def quantized_models(tmp_path_factory):
    """name -> (quantized dir, dequantized dir), from the llama-mha test shape."""
    root = tmp_path_factory.getbasetemp()
    src = make_test_model("llama-mha", root / "ps-test-models")
    out = {}
    for name, (fmt, opts) in FORMATS.items():
        out[name] = (str(root / "hfq" / name), str(root / "hfq" / f"{name}-deq"))
        write_quantized(src, *out[name], fmt, **opts)
    return out


def _weights(path: str):
    from pagedserve.worker.loading.loader import iter_weight_slices

    return iter_weight_slices(path)


# ---------------------------------------------------------------- the loader rebuilds the weights
@pytest.mark.parametrize("name", FORMATS)
def test_loader_rebuilds_the_dequantized_weights_exactly(name, quantized_models):
    qdir, ddir = quantized_models[name]
    cfg = ModelConfig.from_pretrained(qdir, dtype="float32")
    assert cfg.quantization == FORMATS[name][0] and cfg.quant_config is not None
    from safetensors.torch import load_file

    want = load_file(os.path.join(ddir, "model.safetensors"))
    seen = 0
    for key, t in iter_hf_quantized(_weights(qdir), cfg.quant_config):
        if isinstance(t, Int4Tensor):
            got = dequantize_int4(t.w)
        elif isinstance(t, Fp8Tensor):
            got = dequantize_fp8(Fp8Weight(t.weight, t.scale))
        else:
            assert not key.endswith(".bias"), f"{key}: AutoGPTQ's zero bias must be dropped"
            continue
        assert torch.equal(got, want[key]), key
        seen += 1
    assert seen == 7 * cfg.num_hidden_layers
    if name == "gptq-v2-asym-actorder-g32":  # act-order survives (g_idx kept)
        t = dict(iter_hf_quantized(_weights(qdir), cfg.quant_config))["model.layers.0.mlp.down_proj.weight"]
        assert t.w.g_idx is not None and t.w.group_size == 32


# ---------------------------------------------------------------- the CPU GEMM
@pytest.mark.parametrize("fmt,opts", [("awq", dict(group_size=128)), ("gptq", dict(group_size=32, desc_act=True)),
                                      ("gptq", dict(group_size=-1, sym=False)), ("fp8", dict(per_channel=True))])
def test_cpu_linear_matches_f_linear_on_the_dequantized_weight(fmt, opts):
    from pagedserve.worker.loading.quant_config import HFQuantConfig

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g) * 0.05
    parts, deq = quantize_linear(fmt, w, "x", opts)
    qcfg = HFQuantConfig(fmt, fmt, group_size=opts.get("group_size", 128), desc_act=bool(opts.get("desc_act")),
                         zeros_minus_one=fmt == "gptq")
    [(_, t)] = list(iter_hf_quantized(parts.items(), qcfg))
    shards = type(t).collector(96, 256)
    shards.add(0, t, "x")
    weight = shards.pack()
    x, bias = torch.randn(5, 256, generator=g), torch.randn(96, generator=g)
    torch.testing.assert_close(weight.linear(x, bias), F.linear(x, deq, bias), rtol=0, atol=1e-5)
    assert weight.nbytes() < w.numel() * 4 / (3.5 if fmt == "fp8" else 6)


@pytest.mark.parametrize("sym", [True, False])
def test_int4_runs_on_the_cpu_gguf_kernel_as_q4_1(sym):
    """d = scale, m = -scale x zero: a symmetric zero (8) gives m exactly, an asymmetric one
    rounds m to fp16 (at most 2^-11 of scale x zero a weight); act-order sorts its inputs."""
    if not cpu_gguf.available():
        pytest.skip("the CPU GGUF kernel is not built here")
    t, deq = _int4(64, False) if not sym else _int4_sym()
    q4 = as_q4_1(Int4Shards.pack(_one(t)))
    rows = cpu_gguf.dequantize_rows(q4, torch.arange(t.shape[0]))
    w = t.w
    bound = 0.0 if sym else float((w.scales.float() * w.zeros.float()).max()) * 2 ** -11
    assert (rows - deq).abs().max().item() <= bound
    x = torch.randn(3, t.shape[1], generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(cpu_gguf.linear(x, q4), x @ rows.t(), rtol=1e-4, atol=1e-4)  # summation order
    # act-order: the inputs sorted by group, x gathered in that order
    t, deq = _int4(32, True)
    q4 = as_q4_1(Int4Shards.pack(_one(t)))
    assert type(q4).__name__ == "PermutedInputs"
    rows = torch.empty_like(deq)
    rows[:, q4.perm] = cpu_gguf.dequantize_rows(q4.inner, torch.arange(t.shape[0]))  # back to input order
    assert (rows - deq).abs().max().item() <= float((t.w.scales.float() * t.w.zeros.float()).max()) * 2 ** -11
    x = torch.randn(3, t.shape[1], generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(q4.linear(x), x @ rows.t(), rtol=1e-4, atol=1e-4)


def _int4_sym() -> tuple[Int4Tensor, torch.Tensor]:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    parts, deq = quantize_linear("gptq", w, "x", dict(group_size=64, sym=True))
    qcfg = parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True})
    [(_, t)] = list(iter_hf_quantized(parts.items(), qcfg))
    return t, deq


def _one(t: Int4Tensor) -> Int4Shards:
    shards = Int4Shards(*t.shape)
    shards.add(0, t, "x")
    return shards


# ---------------------------------------------------------------- whole model, greedy
def _hf_greedy(ddir: str, prompts: list[list[int]]) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(ddir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0].tolist() for p in prompts]


def _our_next_tokens(model, seqs: list[list[int]]) -> list[list[int]]:
    """Our argmax after every prefix of each whole sequence (one forward, no KV cache): our
    greedy continuation equals HF's exactly when each of its tokens is our argmax there."""
    lens = [len(s) for s in seqs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    md = AttentionMetadata(slot_mapping=torch.full((sum(lens),), -1), block_table=torch.zeros(len(seqs), 1, dtype=torch.int32),
                           seq_lens=torch.tensor(lens, dtype=torch.int32), cu_seqlens_q=cu, max_seqlen_q=max(lens),
                           max_seq_len=max(lens))
    with torch.no_grad():
        ids = torch.tensor([t for s in seqs for t in s])
        pos = torch.cat([torch.arange(n) for n in lens])
        top = model.compute_logits(model(ids, pos, None, md)).argmax(-1)
    return [t.tolist() for t in top.split(lens)]


@pytest.mark.parametrize("name", FORMATS)
def test_greedy_tokens_match_transformers_on_the_dequantized_model(name, quantized_models):
    qdir, ddir = quantized_models[name]
    cfg = ModelConfig.from_pretrained(qdir, dtype="float32")
    model = load_model(cfg, "cpu")
    kinds = {type(m._packed).__name__ for m in model.modules() if getattr(m, "_packed", None) is not None}
    # int4 runs on the CPU GGUF kernel as Q4_1 (kernels/quant/int4.as_q4_1), act-order with its inputs sorted
    on_gguf = "PermutedInputs" if cfg.quant_config.desc_act else "GGUFWeight"
    assert kinds == {"Fp8Weight" if cfg.quantization == "fp8" else on_gguf if cpu_gguf.available() else "Int4Weight"}
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 5, 8, 11, 4, 16, 6, 9)]
    full = _hf_greedy(ddir, prompts)
    ours = _our_next_tokens(model, full)
    matched = sum(o[len(p) - 1:-1] == f[len(p):] for o, p, f in zip(ours, prompts, full))
    print(f"{name}: greedy {matched}/{PROMPTS} prompts equal to transformers on the dequantized weights")
    assert matched == PROMPTS


def test_engine_serves_a_quantized_checkpoint_token_for_token(quantized_models):
    """The whole serving path (scheduler, paged KV cache, chunked prefill, sampler) on the
    act-order GPTQ checkpoint: LLM.generate's greedy tokens are transformers' on the
    dequantized weights."""
    from pagedserve import SamplingParams
    from pagedserve.cluster.llm import LLM

    qdir, ddir = quantized_models["gptq-v2-asym-actorder-g32"]
    prompts = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 57))]
    llm = LLM(model=qdir, dtype="float32", max_model_len=256, max_num_batched_tokens=16)
    try:
        assert llm.engine.model_config.quantization == "gptq"
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [f[len(p):] for p, f in zip(prompts, _hf_greedy(ddir, prompts))]


def test_quantization_none_dequantizes_at_load(quantized_models):
    qdir, _ = quantized_models["awq-g128"]
    cfg = ModelConfig.from_pretrained(qdir, dtype="float32", quantization="none")
    assert cfg.quantization is None and cfg.quant_config.method == "awq"
    model = load_model(cfg, "cpu")
    assert all(getattr(m, "_packed", None) is None for m in model.modules())
    assert model.model.layers[0].mlp.down_proj.weight.shape == (128, 256)


# ---------------------------------------------------------------- tensor parallelism
def _int4(group: int, act_order: bool, n: int = 64, k: int = 256) -> tuple[Int4Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    parts, deq = quantize_linear("gptq", w, "x", dict(group_size=group, desc_act=act_order, sym=False))
    qcfg = parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": group, "sym": False,
                               "desc_act": act_order})
    [(_, t)] = list(iter_hf_quantized(parts.items(), qcfg))
    return t, deq


@pytest.mark.parametrize("group,act_order", [(32, False), (32, True), (-1, False)])
def test_tp2_slices_are_whole_groups_and_rebuild_the_weight(group, act_order):
    t, deq = _int4(group, act_order)
    n, k = deq.shape
    # row-parallel: each rank's input columns; column-parallel: its output rows
    for dim, size in ((1, k // 2), (0, n // 2)):
        pieces = []
        for rank in (0, 1):
            shards = Int4Shards(*((n, size) if dim == 1 else (size, k)))
            shards.add(0, t.narrow(dim, rank * size, size), "x")
            pieces.append(dequantize_int4(shards.pack()))
        assert torch.equal(torch.cat(pieces, dim), deq), (dim, group, act_order)


def test_tp_split_inside_a_group_is_a_startup_error():
    t, _ = _int4(128, False, k=128)
    with pytest.raises(ValueError, match=r"splits only at its groups of 128 inputs; this tensor-parallel shard "
                                         r"takes inputs \[64, 128\) of 128"):
        t.narrow(1, 64, 64)


def test_fused_qkv_shards_concatenate_along_outputs():
    """q, k, v of one layer at rows 0, 64, 96 of a fused weight; fp8 per-tensor scales differ
    per shard and become per-row scales."""
    g = torch.Generator().manual_seed(2)
    ws = [torch.randn(n, 128, generator=g) * s for n, s in ((64, 1.0), (32, 3.0), (32, 0.1))]
    shards, deqs = Fp8Shards(128, 128), []
    for row, w in zip((0, 64, 96), ws):
        q, scale, deq = quantize_fp8(w, per_channel=False)
        shards.add(row, Fp8Tensor(q, scale.expand(w.shape[0])), "qkv")
        deqs.append(deq)
    assert torch.equal(dequantize_fp8(shards.pack()), torch.cat(deqs))
    int4, deqs = Int4Shards(96, 128), []
    for row, w in ((64, ws[1]), (0, ws[0])):  # in any order
        codes, zeros, scales, _, deq = quantize_int4(w, 32, sym=False)
        int4.add(row, Int4Tensor(Int4Weight(pack_along_inputs(codes), scales, zeros.to(torch.uint8), None, 32)), "qkv")
        deqs.insert(0, deq) if row == 0 else deqs.append(deq)
    assert torch.equal(dequantize_int4(int4.pack()), torch.cat(deqs))


def _logits(path: str) -> torch.Tensor:
    """The logits of one 37-token sequence (no KV cache), on this process's TP rank."""
    model = load_model(ModelConfig.from_pretrained(path, dtype="float32"), "cpu")
    ids = torch.arange(3, 40)
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), None, None))


def _tp_rank_main(rank: int, world_size: int, init_file: str, paths: list[str], out_dir: str) -> None:
    from pagedserve.worker.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)  # two ranks on a 2-core box
    init_tensor_parallel(rank, world_size, f"file://{init_file}", backend="gloo")
    try:
        for i, path in enumerate(paths):
            torch.save(_logits(path), os.path.join(out_dir, f"rank{rank}_{i}.pt"))
    finally:
        destroy_tensor_parallel()


def test_tp2_over_gloo_gives_the_tp1_logits(quantized_models, tmp_path):
    """Act-order int4 in groups of 32 (o_proj's 128 inputs split 64 + 64, down_proj's 256
    as 128 + 128) and per-channel fp8, each rank holding its slices packed. Symmetric int4:
    on CPU a rank's slice may or may not form whole Q4_1 blocks once sorted, and only a
    symmetric zero makes both paths exact (an asymmetric one rounds m to fp16 on one)."""
    import torch.multiprocessing as mp

    paths = [quantized_models["gptq-v1-sym-actorder-g32"][0], quantized_models["fp8-ct-channel"][0]]
    mp.spawn(_tp_rank_main, args=(2, str(tmp_path / "init"), paths, str(tmp_path)), nprocs=2, join=True)
    for i, path in enumerate(paths):
        want = _logits(path)
        for rank in (0, 1):
            torch.testing.assert_close(torch.load(os.path.join(tmp_path, f"rank{rank}_{i}.pt")), want,
                                       rtol=1e-5, atol=2e-5)


def test_tp2_split_inside_a_group_fails_at_load(quantized_models, monkeypatch):
    """AWQ in groups of 128: o_proj has 128 inputs, so rank 0 of 2 would hold half a group."""
    from pagedserve.worker import parallel_state

    monkeypatch.setattr(parallel_state, "_TP_SIZE", 2)  # loading alone needs no collective
    cfg = ModelConfig.from_pretrained(quantized_models["awq-g128"][0], dtype="float32")
    with pytest.raises(ValueError, match=r"an int4 weight splits only at its groups of 128 inputs; this "
                                         r"tensor-parallel shard takes inputs \[0, 64\) of 128"):
        load_model(cfg, "cpu")


# ---------------------------------------------------------------- bad input, named
@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes' is not supported; supported: awq, gptq, fp8"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, r"gptq bits 8 is not supported; supported: 4"),
    ({"quant_method": "awq", "bits": 4, "group_size": 256}, r"awq group_size 256 is not supported; supported: 32, 64, 128, -1"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"awq version 'gemv' .* supported: gemm"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     r"gptq checkpoint_format 'marlin' .* supported: gptq, gptq_v2"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, r"weight_block_size \[128, 128\] is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, r"modelopt quant_algo 'NVFP4' .* supported: FP8, FP8_PER_CHANNEL_PER_TOKEN"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, r"compressed-tensors format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized", "config_groups": {"group_0": {
        "weights": {"type": "int", "num_bits": 8, "strategy": "channel"}}}}, r"group_0 weights 'int 8-bit' .* float 8-bit"),
])
def test_unsupported_quantization_configs_are_refused_by_name(qc, message):
    with pytest.raises(ValueError, match=message):
        parse_quant_config(qc)


def test_quantization_flag_must_match_the_checkpoint(quantized_models):
    qdir, _ = quantized_models["awq-g128"]
    with pytest.raises(ValueError, match=r"--quantization gptq does not match the checkpoint's quantization_config "
                                         r"\(quant_method 'awq'\)"):
        ModelConfig.from_pretrained(qdir, dtype="float32", quantization="gptq")
    ct = parse_quant_config(json.load(open(os.path.join(quantized_models["fp8-ct-tensor"][0], "config.json")))
                            ["quantization_config"])
    assert resolve_quantization("compressed-tensors", None, "cpu", ct) == "fp8"
    assert resolve_quantization("fp8", None, "cpu", ct) == "fp8"
    with pytest.raises(ValueError, match="--quantization awq needs a checkpoint whose config.json has a "
                                         "quantization_config"):
        resolve_quantization("awq", None, "cpu")


# ---------------------------------------------------------------- sizing
def test_kv_size_counts_the_packed_linear_bytes():
    """Llama-3-70B's shape in bf16 does not fit one 80 GiB GPU; as AWQ int4 (group 128) its
    linear layers take 4 bits a weight plus an fp16 scale and a zero byte per 128 inputs and
    output, and the rest of the 80 GiB goes to the KV cache."""
    from pagedserve.cluster.cli.kv_size import format_report, kv_size

    cfg = dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
               num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, torch_dtype="bfloat16")
    plain = kv_size(cfg, max_model_len=4096, gpu_memory_gib=80)
    awq = kv_size({**cfg, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}},
                  max_model_len=4096, gpu_memory_gib=80)
    shapes = [(8192, 8192), (1024, 8192), (1024, 8192), (8192, 8192), (28672, 8192), (28672, 8192), (8192, 28672)]
    linear = 80 * sum(n * k for n, k in shapes)
    packed = 80 * sum(n * k // 2 + (k // 128) * n * 3 for n, k in shapes)
    assert awq.weight_bytes == plain.weight_bytes - 2 * linear + packed
    assert plain.kv_budget_bytes_per_gpu == 0 and awq.kv_budget_bytes_per_gpu > 30 * (1 << 30)
    assert "(linear layers awq int4 group 128, asymmetric)" in format_report(awq)


def test_kv_size_reads_a_modelopt_hf_quant_config(quantized_models):
    from pagedserve.cluster.cli.kv_size import DTYPE_BYTES, kv_size, load_hf_config

    cfg = load_hf_config(quantized_models["fp8-modelopt"][0])
    assert cfg["quantization_config"]["quant_method"] == "modelopt"
    r = kv_size(cfg, max_model_len=64, gpu_memory_gib=1)
    assert r.quantization == "modelopt fp8 e4m3 per-tensor scales"
    plain = kv_size({k: v for k, v in cfg.items() if k != "quantization_config"}, max_model_len=64, gpu_memory_gib=1)
    # 2 layers of (q, k, v, o: 128 x 128; gate, up, down: 256 x 128) at 1 byte + a 4-byte scale per row
    linear = 2 * (4 * 128 * 128 + 3 * 256 * 128)
    scales = 2 * 4 * (4 * 128 + 256 + 256 + 128)
    assert plain.weight_bytes - r.weight_bytes == linear * (DTYPE_BYTES[plain.weight_dtype] - 1) - scales


# ---------------------------------------------------------------- Triton, under the interpreter
def _triton_case(kind: str, m: int, dtype: str, **kw) -> dict:
    from pagedserve.kernels.quant.triton_fp8_gemm import fp8_gemm_triton
    from pagedserve.kernels.quant.triton_int4_gemm import int4_gemm_triton

    g = torch.Generator().manual_seed(m)
    n, k = kw.get("n", 80), kw.get("k", 256)
    w = torch.randn(n, k, generator=g) * 0.05
    dt = getattr(torch, dtype)
    x = torch.randn(m, k, generator=g).to(dt)
    bias = torch.randn(n, generator=g).to(dt) if kw.get("bias") else None
    if kind == "int4":
        qcfg = parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": kw["group"], "sym": False,
                                   "desc_act": kw.get("act_order", False)})
        parts, deq = quantize_linear("gptq", w, "x", dict(group_size=kw["group"], sym=False,
                                                        desc_act=kw.get("act_order", False)))
        [(_, t)] = list(iter_hf_quantized(parts.items(), qcfg))
        out = int4_gemm_triton(x, t.w, bias)
    else:
        q, scale, deq = quantize_fp8(w, per_channel=kw.get("per_channel", False))
        out = fp8_gemm_triton(x, Fp8Weight(q, scale.reshape(-1).expand(n).contiguous()), bias)
    ref = F.linear(x.float(), deq, None if bias is None else bias.float())
    return {"err": (out.float() - ref).abs().max().item(), "scale": ref.abs().max().item(),
            "dtype": str(out.dtype), "shape": list(out.shape)}


TRITON_CASES = {
    "int4_g128_m1_fp32": ("int4", 1, "float32", dict(group=128)),
    "int4_g32_actorder_m37_fp32_bias": ("int4", 37, "float32", dict(group=32, act_order=True, bias=True)),
    "int4_gall_m5_fp16": ("int4", 5, "float16", dict(group=-1, n=72)),
    "int4_g64_m70_fp16": ("int4", 70, "float16", dict(group=64)),
    "fp8_tensor_m1_fp32": ("fp8", 1, "float32", dict()),
    "fp8_channel_m37_fp16_bias": ("fp8", 37, "float16", dict(per_channel=True, bias=True, n=72)),
}


def test_triton_kernels_match_the_dequantized_reference_under_the_interpreter():
    for name, r in gemm_cases_within_rounding(__file__, TRITON_CASES).items():
        assert r["dtype"] == ("torch.float32" if "fp32" in name else "torch.float16")


if __name__ == "__main__":  # a child of interpreter_results: TRITON_INTERPRET=1 is set
    for case, (kind, m, dtype, kw) in TRITON_CASES.items():
        emit(case, lambda kind=kind, m=m, dtype=dtype, kw=kw: _triton_case(kind, m, dtype, **kw))
