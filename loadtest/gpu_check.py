"""The one prepared GPU check: kernels, then the engine end to end, in a single call.

    python -m pagedserve.loadtest.gpu_check [--json out.json] [--skip-e2e] [--cpu-smoke]

1-2. the kernel sections of ``pagedserve.kernels.gpu_check``: paged-attention and
   cache-write correctness vs the torch reference (fp16, bf16, split-KV, a 2^31+ pool),
   decode-attention GB/s against a measured device-to-device copy, with a config sweep, and
   the same for the quantised KV cache (fp8 e4m3 / e5m2, int8; kernels/gpu_check_kv_quant.py);
3. end-to-end decode tokens/s of the engine on a ~1.1B random Llama (bf16) at batch 1,
   8, 32, 128, 256, with CUDA graphs and with ``enforce_eager``, next to transformers
   ``generate()`` with the same batch; batch 1 as a fraction of the weight-bandwidth bound
   (weight bytes x tok/s / the copy bandwidth of section 2); greedy token equality of
   graphs vs eager (guarded: a failure there still prints the kernel table); speculative
   decoding (prompt lookup) on vs off at batch 1 and 8: tok/s, acceptance, equal tokens.

It lives here, not in kernels/, because section 3 drives the whole engine and kernels/
imports tensors only. ``--cpu-smoke`` runs every section with tiny shapes on the CPU
(Triton interpreter, the engine's torch path) to check the script itself.
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # must precede the first @triton.jit (kernel import)
    os.environ["TRITON_INTERPRET"] = "1"

import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from pagedserve.kernels import gpu_check as kernel_check  # noqa: E402
from pagedserve.kernels.gpu_check import RESULTS, T0, row  # noqa: E402


def _hf_tok_s(path, dev, dtype, prompts, batches, max_tokens, sync) -> tuple[dict[int, float], int, int]:
    """transformers generate() tok/s per batch, the parameter count and the weight bytes."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(dev).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    tps = {}
    with torch.no_grad():
        hf.generate(prompts[:1].to(dev), max_new_tokens=4, do_sample=False)  # warm-up
        for bsz in batches:
            ids = prompts[:bsz].to(dev)
            sync()
            t = time.perf_counter()
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                        min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            sync()
            tps[bsz] = bsz * max_tokens / (time.perf_counter() - t)
    del hf
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return tps, n_params, weight_bytes


def _engine_tok_s(path, dev, dtype, prompts, batches, max_tokens, enforce_eager: bool,
                  speculative_config: dict | None = None):
    """Engine decode tok/s per batch, the greedy tokens of every sequence, the captured graph
    sizes and the scheduler's stats; one engine at a time, shut down and freed before
    returning."""
    import gc

    from pagedserve import LLM, SamplingParams

    max_model_len = prompts.shape[1] + max_tokens + 16
    # A fixed pool that fits every batch: no memory profile, so a first engine whose memory
    # is not yet returned cannot starve the second one's KV budget.
    blocks = max(batches) * -(-max_model_len // 16) + 64
    llm = LLM(model=path, dtype=dtype, max_num_seqs=max(batches), max_model_len=max_model_len,
              num_gpu_blocks_override=blocks, device=dev.type, enforce_eager=enforce_eager,
              speculative_config=speculative_config)
    tps, tokens = {}, {}
    try:
        graphs = sorted(llm.engine.executor.worker.runner.graph_runner.graphs) if dev.type == "cuda" else []
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([prompts[i].tolist() for i in range(4)], SamplingParams(temperature=0, max_tokens=8,
                                                                             ignore_eos=True), use_tqdm=False)
        for bsz in batches:
            t = time.perf_counter()
            outs = llm.generate([prompts[i].tolist() for i in range(bsz)], params, use_tqdm=False)
            dt = time.perf_counter() - t
            tokens[bsz] = [list(o.outputs[0].token_ids) for o in outs]
            tps[bsz] = sum(map(len, tokens[bsz])) / dt
        stats = llm.engine.get_stats()
    finally:
        llm.shutdown()
    del llm
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return tps, tokens, graphs, stats


def check_e2e(dev, smoke: bool, max_tokens: int) -> None:
    """Engine tok/s with CUDA graphs and with enforce_eager, next to HF generate(); batch
    1 as a fraction of the weight-bandwidth bound (every decode step reads all weights
    once: weight bytes x tok/s against the measured copy bandwidth of section 2); and
    whether graphs and eager produce the same greedy tokens."""
    from pagedserve.worker.random_models import make_random_llama

    if smoke:
        cfg = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)
        batches, dtype, prompt_len = (1, 4), "float32", 16
    else:
        cfg = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
        batches, dtype, prompt_len = (1, 8, 32, 128, 256), "bfloat16", 32
    tmp = tempfile.mkdtemp(prefix="gpu_check_llama_")
    path = make_random_llama(os.path.join(tmp, "model"), **cfg)
    row("e2e", "random Llama written", f"{sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 1e9:.2f} GB")
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, cfg["vocab_size"], (max(batches), prompt_len), generator=gen)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    hf_tps, n_params, weight_bytes = _hf_tok_s(path, dev, dtype, prompts, batches, max_tokens, sync)
    RESULTS["e2e"].update(params=n_params, weight_bytes=weight_bytes)
    run = dict(path=path, dev=dev, dtype=dtype, prompts=prompts, batches=batches, max_tokens=max_tokens)
    g_tps, g_tok, sizes, _ = _engine_tok_s(**run, enforce_eager=False)
    row("e2e", "CUDA graphs captured", f"{len(sizes)} sizes {sizes[:4]}..{sizes[-1:]}" if sizes else "none (off)")
    e_tps, e_tok, _, _ = _engine_tok_s(**run, enforce_eager=True)
    for bsz in batches:
        same = sum(a == b for a, b in zip(g_tok[bsz], e_tok[bsz]))
        RESULTS["e2e"][f"batch {bsz}"] = {"engine_tok_s": g_tps[bsz], "eager_tok_s": e_tps[bsz],
                                          "hf_generate_tok_s": hf_tps[bsz], "engine_vs_hf": g_tps[bsz] / hf_tps[bsz],
                                          "seqs_equal_graphs_eager": same, "seqs": bsz}
        row("e2e", f"decode batch {bsz:>3} ({n_params / 1e9:.2f}B, {dtype}, {max_tokens} tok)",
            f"{'graphs' if sizes else 'default'} {g_tps[bsz]:9.1f}  eager {e_tps[bsz]:9.1f}  "
            f"HF {hf_tps[bsz]:9.1f} tok/s  "
            f"x{g_tps[bsz] / hf_tps[bsz]:.2f} HF  x{g_tps[bsz] / e_tps[bsz]:.2f} eager  tokens equal {same}/{bsz}")
    check_spec(run, smoke)
    copy_gbs = RESULTS["bandwidth"].get("copy_GBps")
    if copy_gbs:
        frac = weight_bytes * g_tps[batches[0]] / (copy_gbs * 1e9)
        RESULTS["e2e"]["batch1_of_weight_bw_bound"] = frac
        row("e2e", "batch 1: weight bytes x tok/s / copy GB/s",
            f"{100 * frac:5.1f}% of the bound ({weight_bytes / 1e9:.2f} GB at {copy_gbs:.0f} GB/s)")
    else:
        row("e2e", "batch 1: weight-bandwidth bound", "n/a (no copy bandwidth from section 2)")


def check_spec(run: dict, smoke: bool) -> None:
    """Speculative decoding (prompt lookup, 4 drafts) on the GPU path: prompts that repeat
    a block of 8 tokens (drafts match at once; a random model's greedy output loops too),
    batch 1 and 8, CUDA graphs on: tok/s with and without, greedy tokens equal, acceptance."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    prompts = run["prompts"]
    rep = torch.cat([prompts[:, :8]] * 4, dim=1)
    batches = (1, 4) if smoke else (1, 8)
    s_run = dict(run, prompts=rep, batches=batches)
    off_tps, off_tok, _, _ = _engine_tok_s(**s_run, enforce_eager=False)
    on_tps, on_tok, _, st = _engine_tok_s(**s_run, enforce_eager=False, speculative_config=spec)
    rate = st.spec_num_accepted_tokens / max(st.spec_num_draft_tokens, 1)
    length = 1 + st.spec_num_accepted_tokens / max(st.spec_num_drafts, 1)
    for bsz in batches:
        same = sum(a == b for a, b in zip(off_tok[bsz], on_tok[bsz]))
        RESULTS["e2e"][f"spec batch {bsz}"] = {"spec_tok_s": on_tps[bsz], "base_tok_s": off_tps[bsz],
                                               "speedup": on_tps[bsz] / off_tps[bsz], "seqs_equal": same,
                                               "seqs": bsz, "acceptance_rate": rate, "mean_acceptance_length": length}
        row("e2e", f"spec decode batch {bsz:>3} (ngram k=4)",
            f"on {on_tps[bsz]:9.1f}  off {off_tps[bsz]:9.1f} tok/s  x{on_tps[bsz] / off_tps[bsz]:.2f}  "
            f"acceptance {rate:.2f}  mean length {length:.2f}  tokens equal {same}/{bsz}")


def e2e_section(dev, args) -> None:
    if args.skip_e2e or time.time() - T0 > args.budget_s:
        row("e2e", "skipped", "--skip-e2e" if args.skip_e2e else f"past the {args.budget_s:.0f} s budget")
        return
    check_e2e(dev, args.cpu_smoke, args.max_tokens or (8 if args.cpu_smoke else 128))


def add_e2e_args(ap) -> None:
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=None, help="generated tokens per sequence in the e2e section")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip the e2e section if started later than this")


def main() -> int:
    return kernel_check.main(extra_sections=[("e2e", e2e_section)], add_args=add_e2e_args,
                             description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
