"""The batch-1 roofline sections (b1, b1_8b): the median decode step from CUDA events against
(weight bytes + KV bytes read per step) / the device's copy bandwidth, on the ~0.85B model
and on an 8B-shaped one written for the run."""

from __future__ import annotations

import os
import shutil
import statistics
import time

from pagedserve.loadtest.gpu.checkpoint import write_random_llama_fast
from pagedserve.loadtest.gpu.harness import PROMPT_LEN, Ctx, StepTimer, engine_worker, generate, greedy, run_engine
from pagedserve.loadtest.kernel_checks import gpu_kernels as kernel_check
from pagedserve.loadtest.kernel_checks.gpu_kernels import RESULTS, row

# The 8B-shaped Llama of b1_8b (bf16, drawn on the GPU); tiny in the smoke.
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                rms_norm_eps=1e-5)
LLAMA_8B_SMOKE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024, rope_theta=500000.0,
                      rms_norm_eps=1e-5)


def weight_bytes_per_step(llm) -> tuple[int, int]:
    """(bytes a decode step reads of the weights, the parameter count). Every parameter is
    read once a step, except an untied embedding table, of which a step reads only its rows."""
    model = engine_worker(llm).runner.model
    params = dict(model.named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    tied = not any(n.startswith("lm_head") for n in params)
    embed = sum(p.numel() * p.element_size() for n, p in params.items() if "embed_tokens" in n)
    return total - (0 if tied else embed), sum(p.numel() for p in params.values())


def kv_bytes_per_token(cfg: dict, elem: int) -> int:
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * elem



def b1_roofline(ctx: Ctx, path: str, cfg: dict, section: str, label: str, max_tokens: int) -> float:
    """Batch-1 decode: median step time from CUDA events vs (weight + KV bytes) / copy GB/s."""
    copy = kernel_check.copy_gbs(ctx.dev, ctx.smoke)
    mml = PROMPT_LEN + max_tokens + 16
    prompt = [ctx.prompts[0][:PROMPT_LEN]]
    prompt = [[t % cfg["vocab_size"] for t in prompt[0]]]

    def run(llm):
        generate(ctx, llm, prompt, greedy(8))  # warm-up: compiles, first-call costs
        timer = StepTimer(ctx, llm)
        try:
            toks, wall, _ = generate(ctx, llm, prompt, greedy(max_tokens))
        finally:
            steps = timer.stop()
        return weight_bytes_per_step(llm), steps, wall, len(toks[0])

    (w_bytes, n_params), steps, wall, n = run_engine(
        ctx, path, run, dtype="bfloat16", max_num_seqs=1, max_model_len=mml,
        num_gpu_blocks_override=ctx.blocks(1, mml), enforce_eager=False)
    decode = steps[1:] or steps  # the first step is the prefill
    step_s = statistics.median(decode)
    kv = kv_bytes_per_token(cfg, 2) * (PROMPT_LEN + n / 2)  # the mean context of the decode steps
    bound_s = (w_bytes + kv) / (copy * 1e9)
    frac, wall_frac = bound_s / step_s, bound_s * n / wall
    RESULTS[section].update(model=label, params=n_params, weight_bytes_per_step=w_bytes, kv_bytes_per_step=kv,
                            copy_GBps=copy, decode_steps=len(decode), step_ms_median=step_s * 1e3,
                            step_ms_min=min(decode) * 1e3, roofline_ms=bound_s * 1e3, roofline_fraction=frac,
                            tok_s_wall=n / wall, roofline_fraction_wall=wall_frac)
    row(section, f"batch 1 step, {label} ({n_params / 1e9:.2f}B, bf16)",
        f"{step_s * 1e3:7.3f} ms (CUDA events, median of {len(decode)}) vs roofline {bound_s * 1e3:.3f} ms = "
        f"{100 * frac:5.1f}%; wall {n / wall:.1f} tok/s = {100 * wall_frac:5.1f}%")
    return frac


def check_b1(ctx: Ctx) -> None:
    frac = b1_roofline(ctx, ctx.small(), ctx.small_cfg, "b1", "random Llama ~0.85B", ctx.max_tokens)
    RESULTS.setdefault("b1_roofline_fraction_by_model", {})["llama_0.85b"] = frac
    if "b1_roofline_fraction" not in RESULTS:
        RESULTS.update(b1_roofline_fraction=frac, b1_roofline_model="llama_0.85b")



def check_b1_8b(ctx: Ctx) -> None:
    cfg = LLAMA_8B_SMOKE if ctx.smoke else LLAMA_8B
    path = os.path.join(ctx.work, "llama8b")
    need = 2 * (cfg["vocab_size"] * cfg["hidden_size"] * 2 + cfg["num_hidden_layers"] * (
        4 * cfg["hidden_size"] ** 2 + 3 * cfg["hidden_size"] * cfg["intermediate_size"]))
    free = shutil.disk_usage(ctx.work).free
    if free < need * 1.2:
        row("b1_8b", "skipped", f"{free / 1e9:.1f} GB free in {ctx.work}, the checkpoint needs ~{need / 1e9:.1f} GB")
        RESULTS["b1_8b"]["skipped"] = "disk"
        return
    try:
        t = time.time()
        nbytes = write_random_llama_fast(path, cfg, ctx.dev)
        write_s = time.time() - t
        row("b1_8b", "8B-shaped random Llama written (bf16)" if not ctx.smoke else "8B-shaped (tiny) written",
            f"{nbytes / 1e9:.2f} GB in {write_s:.1f} s")
        RESULTS["b1_8b"].update(checkpoint_bytes=nbytes, write_s=write_s)
        frac = b1_roofline(ctx, path, cfg, "b1_8b", "8B-shaped Llama", 64 if not ctx.smoke else ctx.max_tokens)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    RESULTS.setdefault("b1_roofline_fraction_by_model", {})["llama_8b_shape"] = frac
    RESULTS.update(b1_roofline_fraction=frac, b1_roofline_model="llama_8b_shape")  # the 8B's, when it ran

