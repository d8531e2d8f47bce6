"""gguf: a GGUF checkpoint on the device (issue 57). The engine sections' random Llama, with
GGUF_LAYERS of its layers, written as Q4_1 by loadtest/gguf_writer.py (the gguf package's own
quantizer, as llama.cpp's converter lays the file out), then served two ways:

    native        ``quantization="gguf"``: on CUDA each Q4_0 / Q4_1 layer becomes an Int4Weight
                  of groups of 32 with the file's d and m, run by the Triton int4 GEMM (its
                  HAS_MIN path); the embedding and other types are dequantized at load
    dequantized   ``quantization="none"``: every tensor dequantized at load (the reference)

Rows: greedy tokens in fp32, native against dequantized (the same weights; the int4 GEMM and
cuBLAS on the dequantized copy differ in rounding only, so every sequence is expected equal);
then batch-1 decode in bf16, the median step (CUDA events) and the device memory each engine
holds after its start (the same KV pool: the difference is the weights).

Needs the ``gguf`` package, which the GPU image lacks: gpu_check_setup.sh carries its wheel
(CARRY). Runs after the imports section, which checks that the other single-GPU sections
load no gguf."""

from __future__ import annotations

import importlib.util
import os
import statistics
import time

import torch

from pagedserve.loadtest.gpu.harness import PROMPT_LEN, Ctx, StepTimer, agreement, generate, greedy, run_engine
from pagedserve.loadtest.kernel_checks.gpu_kernels import RESULTS, row

GGUF_LAYERS = 4  # of the small model's 16 (~0.3B weights): a short write (HF's init, the numpy quantizer)
QTYPE = "Q4_1"


def check_gguf(ctx: Ctx) -> None:
    res = RESULTS["gguf"]
    if importlib.util.find_spec("gguf") is None:
        res.update(skipped="the gguf package is not installed (gpu_check_setup.sh carries its wheel)", ok=True)
        row("gguf", "GGUF Q4_1 on the device", "skipped: no gguf package")
        return
    from pagedserve.loadtest.gguf_writer import write_gguf_from_hf
    from pagedserve.worker.loading.random_models import make_random_llama

    cfg = dict(ctx.small_cfg, num_hidden_layers=min(GGUF_LAYERS, ctx.small_cfg["num_hidden_layers"]))
    t = time.time()
    hf_dir = make_random_llama(os.path.join(ctx.work, "gguf_hf"), **cfg)
    path = write_gguf_from_hf(hf_dir, os.path.join(ctx.work, f"small.{QTYPE}.gguf"), QTYPE)
    res.update(qtype=QTYPE, layers=cfg["num_hidden_layers"], file_bytes=os.path.getsize(path))
    row("gguf", f"random Llama ({cfg['num_hidden_layers']} layers) written as {QTYPE}",
        f"{os.path.getsize(path) / 1e6:.0f} MB in {time.time() - t:.1f} s")

    vocab = cfg["vocab_size"]
    n, bsz = (ctx.max_tokens if ctx.smoke else 64), 8
    prompts = [[tok % vocab for tok in p] for p in ctx.prompts[:bsz]]
    mml = PROMPT_LEN + n + 16
    toks = {q: run_engine(ctx, path, lambda llm: generate(ctx, llm, prompts, greedy(n, exact=True))[0],
                          dtype="float32", quantization=q, max_num_seqs=bsz, max_model_len=mml,
                          num_gpu_blocks_override=ctx.blocks(bsz, mml))
            for q in ("gguf", "none")}
    agree = agreement(toks["gguf"], toks["none"])
    res.update(fp32=agree, ok=agree["seqs_equal"] == bsz)
    row("gguf", f"native vs dequantized, fp32, {bsz} x {n} greedy",
        f"{agree['seqs_equal']}/{bsz} sequences equal {'PASS' if res['ok'] else 'FAIL'}"
        + ("" if res["ok"] else f" (mean prefix {agree['mean_prefix_match']:.2f})"))

    steps_n = ctx.max_tokens
    mml = PROMPT_LEN + steps_n + 16
    for q, label in (("gguf", "native"), ("none", "dequantized")):
        def run(llm):
            held = torch.cuda.memory_allocated() if ctx.cuda else None
            generate(ctx, llm, prompts[:1], greedy(8))  # warm-up
            timer = StepTimer(ctx, llm)
            try:
                generate(ctx, llm, prompts[:1], greedy(steps_n))
            finally:
                steps = timer.stop()
            return held, steps

        held, steps = run_engine(ctx, path, run, dtype="bfloat16", quantization=q, max_num_seqs=1,
                                 max_model_len=mml, num_gpu_blocks_override=ctx.blocks(1, mml))
        step_ms = 1000 * statistics.median(steps[1:] or steps)
        res[f"b1_{label}"] = {"step_ms": step_ms, "tok_s": 1000 / step_ms, "device_bytes": held}
        row("gguf", f"b1 decode, bf16, {label}",
            f"{step_ms:.2f} ms a step ({1000 / step_ms:.0f} tok/s)"
            + (f", {held / 1e9:.2f} GB held" if held is not None else ""))
    res["b1_native_speedup"] = res["b1_dequantized"]["step_ms"] / res["b1_native"]["step_ms"]
