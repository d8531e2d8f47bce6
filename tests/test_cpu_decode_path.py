"""The bound CPU decode path (worker/cpu_decode_path.py) against the modules it replaces: on
the same engine, the same prompts give the same tokens and bit-identical logprobs with the
path on and off (it calls the same kernels in the same order, LoRA's hooks included), it is
what ran the decode steps, and it stays off where it does not fit (a quantised KV cache)."""

from __future__ import annotations

import logging

import pytest

from _gguf_helpers import write_gguf_from_hf
from _hf_quant_helpers import write_quantized
from pagedserve import LLM, SamplingParams
from pagedserve.worker.loading.random_models import make_test_model

PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [300, 2, 77], list(range(20, 57))]


def _run(llm: LLM, n: int = 2, **generate_kw) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS * n, params, use_tqdm=False, **generate_kw)  # 6 at once: batched decode rows
    return [(o.outputs[0].token_ids, [(lp.token_ids, lp.logprobs) for lp in o.outputs[0].logprobs]) for o in outs]


def _graph_runner(llm: LLM):
    return llm.engine.executor.worker.runner.graph_runner


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "decode-path-models"
    llama = make_test_model("llama-gqa2-hd64", root)
    qwen2 = make_test_model("qwen2-tied", root)  # q/k/v biases, tied head
    gguf_dir = tmp_path_factory.mktemp("gguf")
    gguf = write_gguf_from_hf(str(llama), str(gguf_dir / "llama.Q4_1.gguf"), "Q4_1")
    # llama.cpp's Q4_K_M on rows that are not whole super-blocks: q, k, gate, up in Q5_0, v and
    # down in Q8_0 (fused qkv of two types: the bound path calls each part into its columns)
    mixed = write_gguf_from_hf(str(llama), str(gguf_dir / "llama.Q4_K_M.gguf"), "Q5_0",
                               {"attn_v.weight": "Q8_0", "ffn_down.weight": "Q8_0", "token_embd.weight": "Q8_0"})
    quant = tmp_path_factory.mktemp("hfq")
    write_quantized(str(llama), str(quant / "awq"), str(quant / "awq-deq"), "awq", group_size=64)
    write_quantized(str(llama), str(quant / "fp8"), str(quant / "fp8-deq"), "fp8", per_channel=True)
    return {"llama": str(llama), "qwen2": str(qwen2), "gguf-q4_1": gguf, "gguf-mixed-types": mixed,
            "awq": str(quant / "awq"),
            "fp8": str(quant / "fp8")}


def _check_on_against_off(llm: LLM, **generate_kw) -> None:
    runner = _graph_runner(llm)
    path = runner.cpu_path
    assert path is not None
    taken = []
    forward = path.forward

    def counted(*args):
        out = forward(*args)
        taken.append(out is not None)
        return out

    path.forward = counted
    on = _run(llm, **generate_kw)
    assert sum(taken) >= 10 and not all(taken)  # the decode steps; prefill ran the modules
    runner.cpu_path = None
    assert _run(llm, **generate_kw) == on  # tokens and logprobs, to the bit


@pytest.mark.parametrize("name", ["llama", "qwen2", "gguf-q4_1", "gguf-mixed-types", "awq", "fp8"])
def test_the_bound_path_runs_the_decode_steps_and_changes_no_bit(models, name):
    llm = LLM(model=models[name], dtype="float32", max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=8)
    try:
        _check_on_against_off(llm)
    finally:
        llm.shutdown()


def test_with_lora_adapters_mixed_in_the_batch(models, tmp_path):
    """Two adapters and the base model decode together: the layers' LoRA hooks run on the
    path too, in the modules' order (tests/test_lora.py holds both against peft)."""
    from _lora_helpers import make_random_adapter
    from pagedserve import LoRARequest

    a = make_random_adapter(models["llama"], tmp_path / "a", r=4, alpha=8, seed=1)
    b = make_random_adapter(models["llama"], tmp_path / "b", r=8, alpha=16, seed=2,
                            targets=["q_proj", "v_proj", "down_proj", "gate_proj"])
    llm = LLM(model=models["llama"], dtype="float32", max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=8,
              enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        loras = [LoRARequest("a", 1, a), LoRARequest("b", 2, b), None] * 2
        _check_on_against_off(llm, lora_request=loras)
    finally:
        llm.shutdown()


def test_it_stays_off_for_a_quantised_cache(models):
    llm = LLM(model=models["llama"], dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              kv_cache_dtype="int8")
    try:
        assert _graph_runner(llm).cpu_path is None
        assert len(_run(llm, 1)) == len(PROMPTS)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name,dtype", [("llama", "bfloat16"), ("gguf-q4_1", "bfloat16"), ("llama", "float32")])
def test_another_dtype_says_what_it_costs_and_names_float32(models, name, dtype, caplog):
    """bfloat16 on a CPU runs torch's reference ops between the GEMMs (the kernels there
    take float32): the start-up warns once and names --dtype float32, and for GGUF weights
    that they compute in float32 anyway. float32 warns nothing."""
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker.cuda_graphs"):
        llm = LLM(model=models[name], dtype=dtype, max_model_len=256, num_gpu_blocks_override=64)
    try:
        warned = [r.getMessage() for r in caplog.records if "--dtype float32" in r.getMessage()]
        if dtype == "float32":
            assert warned == [] and _graph_runner(llm).cpu_path is not None
        else:
            assert len(warned) == 1 and f"runs in {dtype} on the CPU" in warned[0], warned
            assert ("GGUF weights compute in float32" in warned[0]) == name.startswith("gguf")
            assert _graph_runner(llm).cpu_path is None
        assert len(_run(llm, 1)) == len(PROMPTS)
    finally:
        llm.shutdown()
