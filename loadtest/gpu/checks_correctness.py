"""The sections that must hold token for token, or not at all: the engine's greedy tokens equal
transformers' in fp32 (exact), CUDA graphs equal eager on a context that splits the KV
(long_context), TensorParallel 2 equal HF (tp2), and no optional package loaded on the
single-GPU path (imports)."""

from __future__ import annotations

import gc
import importlib.util
import sys

import torch

from pagedserve.loadtest.gpu import image
from pagedserve.loadtest.gpu.harness import PROMPT_LEN, Ctx, agreement, engine_worker, generate, greedy, run_engine
from pagedserve.loadtest.kernel_checks.gpu_kernels import RESULTS, row

# Packages the single-GPU path must not load: the image lacks them (gpu_check_setup.sh).
OPTIONAL_PACKAGES = ("ray", "zmq", "msgspec", "xgrammar", "pydantic", "fastapi", "uvicorn", "gguf")


def check_exact(ctx: Ctx) -> None:
    """HF generate() vs the engine (graphs, then eager), greedy, fp32, 8 prompts."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = ctx.small()
    n, bsz = ctx.max_tokens if ctx.smoke else 64, 8
    prompts = ctx.prompts[:bsz]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(ctx.dev).eval()
    cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                           eos_token_id=hf.config.eos_token_id)
    with torch.no_grad():
        ids = torch.tensor(prompts, device=ctx.dev)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    ref = out[:, PROMPT_LEN:].tolist()
    del hf, out
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    ctx.hf_exact = ref
    res = RESULTS["exact"]
    res.update(dtype="float32", seqs=bsz, tokens_per_seq=n, ok=True)
    mml = PROMPT_LEN + n + 16
    for mode, eager in (("graphs", False), ("eager", True)):
        toks = run_engine(ctx, path, lambda llm: generate(ctx, llm, prompts, greedy(n, exact=True))[0],
                          dtype="float32", max_num_seqs=bsz, max_model_len=mml,
                          num_gpu_blocks_override=ctx.blocks(bsz, mml), enforce_eager=eager)
        agree = agreement(toks, ref)
        ok = agree["seqs_equal"] == bsz
        res[mode] = agree
        res["ok"] = res["ok"] and ok
        row("exact", f"engine ({mode}) vs HF generate(), fp32, {bsz} x {n} greedy",
            f"{agree['seqs_equal']}/{bsz} sequences equal {'PASS' if ok else 'FAIL'}"
            + ("" if ok else f" (mean prefix {agree['mean_prefix_match']:.2f})"))



def check_long_context(ctx: Ctx) -> None:
    """Graphs vs eager on a decode batch long enough that the kernel splits the KV, fp32."""
    from pagedserve.kernels.triton_paged_attention import choose_num_splits

    bsz, ctx_len = 4, (300 if ctx.smoke else 6000)
    n = ctx.max_tokens if ctx.smoke else 32
    mml = 512 if ctx.smoke else 8192
    kvh = ctx.small_cfg["num_key_value_heads"]
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(10, ctx.small_cfg["vocab_size"], (bsz, ctx_len), generator=gen).tolist()
    res = RESULTS["long_context"]
    out = {}
    for mode, eager in (("graphs", False), ("eager", True)):
        def run(llm):
            gr = engine_worker(llm).runner.graph_runner
            replays = [0]
            inner = gr.forward

            def counted(inputs, kv_caches):
                if getattr(inputs, "padded", False) and inputs.num_rows in gr.graphs:
                    replays[0] += 1
                return inner(inputs, kv_caches)

            gr.forward = counted
            try:
                toks, dt, _ = generate(ctx, llm, prompts, greedy(n, exact=True))
            finally:
                del gr.forward
            return toks, replays[0]

        out[mode] = run_engine(ctx, ctx.small(), run, dtype="float32", max_num_seqs=bsz, max_model_len=mml,
                               num_gpu_blocks_override=ctx.blocks(bsz, mml), enforce_eager=eager)
    splits_graph = choose_num_splits(bsz, kvh, mml, 64, ctx.dev)
    splits_eager = choose_num_splits(bsz, kvh, ctx_len + n, 64, ctx.dev)
    agree = agreement(out["graphs"][0], out["eager"][0])
    ok = agree["seqs_equal"] == bsz and (out["graphs"][1] > 0 or not ctx.cuda)
    res.update(batch=bsz, context=ctx_len, max_model_len=mml, tokens=n, dtype="float32",
               num_splits_graph=splits_graph, num_splits_eager=splits_eager, graph_replays=out["graphs"][1],
               ok=ok, **agree)
    row("long_context", f"{bsz} x {ctx_len} ctx, {n} tok, fp32: graphs vs eager",
        f"{agree['seqs_equal']}/{bsz} equal, {out['graphs'][1]} graph replays, splits {splits_graph} (graph) / "
        f"{splits_eager} (eager) {'PASS' if ok else 'FAIL'}")



def check_imports(ctx: Ctx) -> None:
    blocked = image.BLOCKED
    loaded = sorted(m for m in OPTIONAL_PACKAGES if sys.modules.get(m) is not None)
    ok = not loaded
    RESULTS["imports"].update(loaded_optional=loaded, ok=ok, image_packages_only=blocked is not None,
                              blocked=len(blocked[0]) if blocked else None)
    row("imports", "optional packages loaded by the TP=1 sections", ", ".join(loaded) or "none PASS")
    if blocked is not None:
        RESULTS["imports"]["loaded_before_block"] = blocked[1]
        RESULTS["imports"]["ok"] = ok and not blocked[1]
        row("imports", "packages outside the GPU image, made unimportable",
            f"{len(blocked[0])} ({', '.join(m for m in blocked[0] if m in OPTIONAL_PACKAGES)}, ...)"
            + (f"; already loaded: {blocked[1]} FAIL" if blocked[1] else ""))


def check_tp2(ctx: Ctx) -> None:
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    reason = None
    if gpus < 2:
        reason = f"{gpus} CUDA device(s): TP=2 needs two"
    elif importlib.util.find_spec("ray") is None:
        reason = "ray is not importable (its wheel is over the 64 MiB carry limit; gpu_check_setup.sh pypi --tp)"
    if reason:
        row("tp2", "skipped", reason)
        RESULTS["tp2"]["skipped"] = reason
        return
    bsz, n = 8, (ctx.max_tokens if ctx.smoke else 64)  # the exact section's prompts and length
    mml = PROMPT_LEN + n + 16
    prompts = ctx.prompts[:bsz]

    def run(llm):
        generate(ctx, llm, prompts[:1], greedy(8))
        toks, dt, _ = generate(ctx, llm, prompts, greedy(n, exact=True))
        _, dt1, _ = generate(ctx, llm, prompts[:1], greedy(n))
        return toks, bsz * n / dt, n / dt1

    toks, tps8, tps1 = run_engine(ctx, ctx.small(), run, dtype="float32", tensor_parallel_size=2, max_num_seqs=bsz,
                                  max_model_len=mml, num_gpu_blocks_override=ctx.blocks(bsz, mml))
    ref = ctx.hf_exact if ctx.hf_exact and len(ctx.hf_exact[0]) == n else None
    agree = agreement(toks, ref) if ref else None
    ok = agree is None or agree["seqs_equal"] == bsz
    RESULTS["tp2"].update(tok_s_batch8=tps8, tok_s_batch1=tps1, vs_hf=agree, ok=ok, dtype="float32")
    row("tp2", "TP=2 over NCCL, fp32", f"batch 8 {tps8:.1f} tok/s, batch 1 {tps1:.1f} tok/s; "
        + (f"{agree['seqs_equal']}/{bsz} equal HF {'PASS' if ok else 'FAIL'}" if agree else "no HF tokens to compare"))

