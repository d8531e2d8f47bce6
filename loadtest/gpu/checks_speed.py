"""The speed sections of the engine: decode tok/s by batch with CUDA graphs and async
scheduling on and off (throughput), the fp8 KV cache against the bf16 one (fp8_kv), top-p
sampling against greedy (top_p), time to the first token (ttft), transformers generate() at
the same batches (hf_generate), and prompt-lookup speculation on vs off (spec_decode)."""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch

from pagedserve.loadtest.gpu.harness import PROMPT_LEN, Ctx, agreement, engine_worker, generate, greedy, run_engine
from pagedserve.loadtest.kernel_checks.gpu_kernels import RESULTS, row


def _throughput_run(ctx: Ctx, path: str, batches, n: int, **kw) -> tuple[dict, dict, list[int]]:
    """tok/s and tokens per batch on one engine (a short warm-up first), and its graph sizes."""
    mml = PROMPT_LEN + n + 16
    kw = dict(dtype="bfloat16", max_num_seqs=max(batches), max_model_len=mml,
              num_gpu_blocks_override=ctx.blocks(max(batches), mml), **kw)

    def run(llm):
        runner = engine_worker(llm).runner
        sizes = sorted(runner.graph_runner.graphs) if ctx.cuda else []
        generate(ctx, llm, ctx.prompts[:4], greedy(8))
        tps, toks = {}, {}
        for bsz in batches:
            toks[bsz], dt, _ = generate(ctx, llm, ctx.prompts[:bsz], greedy(n))
            tps[bsz] = sum(map(len, toks[bsz])) / dt
        return tps, toks, sizes

    return run_engine(ctx, path, run, **kw)


def check_throughput(ctx: Ctx) -> None:
    path, n, batches = ctx.small(), ctx.max_tokens, ctx.batches
    res = RESULTS["throughput"]
    res.update(model="random Llama ~0.85B, bf16", prompt_len=PROMPT_LEN, max_tokens=n)
    runs = {}
    for graphs in (True, False):
        for async_ in (False, True):
            key = f"{'graphs' if graphs else 'eager'} {'async' if async_ else 'sync'}"
            tps, toks, sizes = _throughput_run(ctx, path, batches, n, enforce_eager=not graphs,
                                               async_scheduling=async_)
            runs[key] = (tps, toks)
            if key == "graphs sync":
                ctx.baseline, ctx.baseline_tok_s = toks, tps
                res["graph_sizes"] = sizes
                row("throughput", "CUDA graphs captured", f"{len(sizes)} sizes {sizes[:4]}..{sizes[-1:]}"
                    if sizes else "none (not CUDA)")
    base = runs["graphs sync"][1]
    for bsz in batches:
        entry = {key: {"tok_s": tps[bsz], **agreement(toks[bsz], base[bsz])} for key, (tps, toks) in runs.items()}
        res[f"batch {bsz}"] = entry
        row("throughput", f"decode batch {bsz:>3} tok/s (graphs|eager x sync|async)",
            "  ".join(f"{k} {v['tok_s']:8.1f}" for k, v in entry.items())
            + "  equal to graphs sync " + "/".join(str(v["seqs_equal"]) for v in entry.values()) + f" of {bsz}")
    res["tok_s_graphs_sync_by_batch"] = {b: runs["graphs sync"][0][b] for b in batches}



def check_fp8_kv(ctx: Ctx) -> None:
    """kv_cache_dtype="fp8" (e4m3, one scale per token and head) end to end vs the bf16 KV run."""
    path, n = ctx.small(), ctx.max_tokens
    batches = ctx.batches if ctx.smoke else (1, 64, 256)
    if not ctx.baseline or not all(b in ctx.baseline for b in batches):
        tps, toks, _ = _throughput_run(ctx, path, batches, n, enforce_eager=False, async_scheduling=False)
        ctx.baseline.update(toks)
        ctx.baseline_tok_s.update(tps)
    tps, toks, _ = _throughput_run(ctx, path, batches, n, enforce_eager=False, async_scheduling=False,
                                   kv_cache_dtype="fp8")
    for bsz in batches:
        agree = agreement(toks[bsz], ctx.baseline[bsz])
        RESULTS["fp8_kv"][f"batch {bsz}"] = {"tok_s": tps[bsz], "bf16_kv_tok_s": ctx.baseline_tok_s[bsz],
                                             "speedup": tps[bsz] / ctx.baseline_tok_s[bsz], **agree}
        row("fp8_kv", f"batch {bsz:>3}, fp8 e4m3 KV vs bf16 KV (graphs, sync)",
            f"{tps[bsz]:9.1f} vs {ctx.baseline_tok_s[bsz]:9.1f} tok/s x{tps[bsz] / ctx.baseline_tok_s[bsz]:.2f}; "
            f"{agree['seqs_equal']}/{bsz} seqs equal, mean prefix {agree['mean_prefix_match']:.2f}")



def check_top_p(ctx: Ctx) -> None:
    from pagedserve import SamplingParams

    bsz, n = ctx.big_batch, ctx.max_tokens
    mml = PROMPT_LEN + n + 16
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1000 + i, max_tokens=n, ignore_eos=True)
              for i in range(bsz)]

    def run(llm):
        generate(ctx, llm, ctx.prompts[:4], greedy(8))
        g_toks, g_dt, _ = generate(ctx, llm, ctx.prompts[:bsz], greedy(n))
        p_toks, p_dt, _ = generate(ctx, llm, ctx.prompts[:bsz], params)
        again, _, _ = generate(ctx, llm, ctx.prompts[:bsz], params)
        return g_toks, g_dt, p_toks, p_dt, again

    g_toks, g_dt, p_toks, p_dt, again = run_engine(
        ctx, ctx.small(), run, dtype="bfloat16", max_num_seqs=bsz, max_model_len=mml,
        num_gpu_blocks_override=ctx.blocks(bsz, mml))
    g_tps, p_tps = sum(map(len, g_toks)) / g_dt, sum(map(len, p_toks)) / p_dt
    same = sum(a == b for a, b in zip(p_toks, again))
    differ = sum(a != b for a, b in zip(p_toks, g_toks))
    ok = same == bsz
    RESULTS["top_p"].update(batch=bsz, tok_s=p_tps, greedy_tok_s=g_tps, ratio=p_tps / g_tps, seeded_repeat_equal=same,
                            differ_from_greedy=differ, ok=ok, temperature=0.8, top_p=0.9)
    row("top_p", f"batch {bsz}, T 0.8, top_p 0.9, seeded vs greedy",
        f"{p_tps:9.1f} vs {g_tps:9.1f} tok/s x{p_tps / g_tps:.2f}; rerun equal {same}/{bsz} "
        f"{'PASS' if ok else 'FAIL'}; {differ}/{bsz} differ from greedy")


def check_ttft(ctx: Ctx) -> None:
    lens = (128, 400) if ctx.smoke else (2048, 8192)
    mml = max(lens) + 16
    gen = torch.Generator().manual_seed(4)
    vocab = ctx.small_cfg["vocab_size"]

    def prompt(k: int) -> list[int]:
        return torch.randint(10, vocab, (k,), generator=gen).tolist()

    def run(llm):
        for k in lens:  # warm-up: every prefill shape compiled, distinct prompts (no prefix-cache hits)
            generate(ctx, llm, [prompt(k)], greedy(1))
        got = {}
        for k in lens:
            times = []
            for _ in range(3):
                _, dt, outs = generate(ctx, llm, [prompt(k)], greedy(1))
                m = outs[0].metrics
                times.append(m.first_token_time - m.arrival_time if m and m.first_token_time else dt)
            got[k] = times
        return got, llm.engine.config.scheduler_config(mml).max_num_batched_tokens

    got, budget = run_engine(ctx, ctx.small(), run, dtype="bfloat16", max_num_seqs=8, max_model_len=mml,
                             num_gpu_blocks_override=ctx.blocks(2, mml))
    for k, times in got.items():
        med = statistics.median(times)
        RESULTS["ttft"][f"prompt {k}"] = {"ttft_ms_median": med * 1e3, "ttft_ms": [t * 1e3 for t in times],
                                          "chunks": math.ceil(k / budget), "max_num_batched_tokens": budget}
        row("ttft", f"prompt {k} tokens (bf16, chunks of {budget})", f"{med * 1e3:8.1f} ms to the first token "
            f"(median of {len(times)})")



def check_hf_generate(ctx: Ctx) -> None:
    from transformers import AutoModelForCausalLM

    path, n, batches = ctx.small(), ctx.max_tokens, ctx.batches
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(ctx.dev).eval()
    try:
        with torch.no_grad():
            hf.generate(torch.tensor(ctx.prompts[:1], device=ctx.dev), max_new_tokens=4, do_sample=False)
            for bsz in batches:
                ids = torch.tensor(ctx.prompts[:bsz], device=ctx.dev)
                ctx.sync()
                t = time.perf_counter()
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)
                ctx.sync()
                tps = bsz * n / (time.perf_counter() - t)
                ours = ctx.baseline_tok_s.get(bsz)
                RESULTS["hf_generate"][f"batch {bsz}"] = {"hf_tok_s": tps, "engine_tok_s": ours,
                                                          "engine_vs_hf": ours / tps if ours else None}
                row("hf_generate", f"batch {bsz:>3}, bf16, {n} tok", f"HF {tps:9.1f} tok/s"
                    + (f"; engine (graphs, sync) x{ours / tps:.2f}" if ours else ""))
    finally:
        del hf
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()


def check_spec(ctx: Ctx) -> None:
    """Prompt lookup (4 drafts) on vs off at batch 1 and 8, graphs on: prompts that repeat a
    block of 8 tokens (drafts match at once; a random model's greedy output loops too)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    n, batches = ctx.max_tokens, (1, 8)
    prompts = [p[:8] * 4 for p in ctx.prompts[:max(batches)]]
    mml = len(prompts[0]) + n + 16

    def tok_s(speculative_config):
        def run(llm):
            generate(ctx, llm, prompts[:4], greedy(8))
            out = {}
            for bsz in batches:
                toks, dt, _ = generate(ctx, llm, prompts[:bsz], greedy(n))
                out[bsz] = (sum(map(len, toks)) / dt, toks)
            return out, llm.engine.get_stats()

        return run_engine(ctx, ctx.small(), run, dtype="bfloat16", max_num_seqs=max(batches), max_model_len=mml,
                          num_gpu_blocks_override=ctx.blocks(max(batches), mml), speculative_config=speculative_config)

    off, _ = tok_s(None)
    on, st = tok_s(spec)
    rate = st.spec_num_accepted_tokens / max(st.spec_num_draft_tokens, 1)
    length = 1 + st.spec_num_accepted_tokens / max(st.spec_num_drafts, 1)
    for bsz in batches:
        same = sum(a == b for a, b in zip(off[bsz][1], on[bsz][1]))
        RESULTS["spec_decode"][f"batch {bsz}"] = {"spec_tok_s": on[bsz][0], "base_tok_s": off[bsz][0],
                                                  "speedup": on[bsz][0] / off[bsz][0], "seqs_equal": same,
                                                  "seqs": bsz, "acceptance_rate": rate,
                                                  "mean_acceptance_length": length}
        row("spec_decode", f"batch {bsz:>3} (ngram k=4)",
            f"on {on[bsz][0]:9.1f}  off {off[bsz][0]:9.1f} tok/s  x{on[bsz][0] / off[bsz][0]:.2f}  "
            f"acceptance {rate:.2f}  mean length {length:.2f}  tokens equal {same}/{bsz}")

