"""Offline throughput, one process, one model, one workload, side by side:

    pagedserve (continuous batching, paged KV)
    pagedserve with scheduling_policy="static" (same engine, batches of B, nobody joins)
    transformers generate() on static padded batches of B (vLLM's run_hf recipe)
    transformers generate_batch (its own continuous batching, paged cache)

plus pagedserve's batch-1 decode speed against this machine's memory-bandwidth bound
(weight bytes read per step / measured copy bandwidth). Last line: one JSON object.

    python -m pagedserve.loadtest.offline.bench_offline            # 128 requests, long on 2 cores (HF dominates)
    python -m pagedserve.loadtest.offline.bench_offline --quick    # a small version, quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


import torch  # noqa: E402

from pagedserve.loadtest.workloads import offline_chat_pairs

BENCH_SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                   num_key_value_heads=4, vocab_size=8192, max_position_embeddings=2048)


def bench_model_path(root: str | None = None) -> str:
    from pagedserve.worker.loading.random_models import make_random_llama

    root = root or os.environ.get("PAGEDSERVE_CACHE", os.path.expanduser("~/.cache/pagedserve"))
    path = os.path.join(root, "bench-llama-63m-v1")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        tmp = f"{path}.tmp{os.getpid()}"
        make_random_llama(tmp, arch="llama", seed=0, initializer_range=0.02, **BENCH_SHAPE)
        os.replace(tmp, path) if not os.path.exists(path) else None
    return path


def run_pagedserve(path, work, *, policy="fcfs", max_num_seqs=256, label="pagedserve"):
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", max_model_len=1024, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=2048, kv_cache_memory_bytes=3 << 30, scheduling_policy=policy,
              enable_prefix_caching=False)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True, detokenize=False) for _, o in work]
    llm.generate([p for p, _ in work[:4]], params[:4], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.stats()
    llm.shutdown()
    print(f"{label:24s} {n_out / dt:9.1f} out tok/s  ({n_out} tokens, {dt:.1f} s, "
          f"preemptions {stats['num_preemptions']})", flush=True)
    return n_out / dt


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    return model


def run_hf_static(path, work, batch_size):
    """vLLM's run_hf: batches of up to B in arrival order, left-padded, all generating
    ``max_new_tokens`` = the longest output in the batch; counted tokens = requested ones."""
    from transformers import GenerationConfig

    model = _hf_model(path)
    n_out = sum(o for _, o in work)
    t = time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        cfg = GenerationConfig(max_new_tokens=max(o for _, o in batch), do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, generation_config=cfg)
    dt = time.perf_counter() - t
    print(f"{'hf generate (static B=' + str(batch_size) + ')':24s} {n_out / dt:9.1f} out tok/s  ({n_out} tokens, {dt:.1f} s)", flush=True)
    return n_out / dt


def run_hf_cb(path, work):
    """transformers' continuous batching manager, per-request max_new_tokens, no EOS."""
    import copy

    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    model = _hf_model(path)
    model.set_attn_implementation("sdpa")
    gen = GenerationConfig(max_new_tokens=max(o for _, o in work), do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=32, num_blocks=2048, max_batch_tokens=512, use_cuda_graph=False)
    n_out = 0
    t = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=copy.deepcopy(gen),
                                                   continuous_batching_config=cb, block=True,
                                                   timeout=5) as manager:
        for i, (p, o) in enumerate(work):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1)
        done = 0
        while done < len(work):
            res = manager.get_result(timeout=60)
            if res is not None and res.is_finished():
                done += 1
                n_out += len(res.generated_tokens)
    dt = time.perf_counter() - t
    print(f"{'hf generate_batch':24s} {n_out / dt:9.1f} out tok/s  ({n_out} tokens, {dt:.1f} s)", flush=True)
    return n_out / dt


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Bytes copied per second (a 1 GiB tensor copy, best of 5). STREAM would count the
    read and the write, i.e. twice this; a decode step only reads its weights, so
    bytes-copied-per-second is the fair yardstick for "read all weights once"."""
    x = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    y = torch.empty_like(x).fill_(0.0)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def read_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Bytes read per second: a sum over a 1 GiB tensor (best of 5), torch's threads. A
    decode step reads its weights and writes almost nothing, so this, not a copy (which
    moves every byte twice), is what a step could reach at best."""
    x = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def run_b1_decode(path, n_tokens):
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", max_model_len=1024, max_num_seqs=1, enable_prefix_caching=False,
              kv_cache_memory_bytes=1 << 28)
    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True, detokenize=False)
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    out = llm.generate([[5, 6, 7, 8, 9, 10, 11, 12]], params, use_tqdm=False)[0]
    m = out.metrics
    tok_s = (n_tokens - 1) / (m.last_token_time - m.first_token_time)
    weight_bytes = decode_weight_bytes(llm.engine.executor.worker.runner.model,
                                       llm.engine.model_config.tie_word_embeddings)
    llm.shutdown()
    return tok_s, weight_bytes


def decode_weight_bytes(model, tied: bool) -> int:
    """Bytes a decode step must read: every weight except the input embedding table, of
    which a step reads one row (unless it is tied to the LM head, which reads it all).
    A layer packed for oneDNN or the panel GEMM (worker/layers/cpu_backend.py) reads its
    packed copy."""
    from pagedserve.kernels.cpu_linear import packed_nbytes

    total, seen = 0, set()
    for m in model.modules():
        packed = getattr(m, "_packed", None)
        if packed is not None:
            total += packed_nbytes(packed)
    lm_packed = getattr(getattr(model, "lm_head", None), "_packed", None) is not None
    for name, p in model.named_parameters():
        if p.numel() == 0 or p.data_ptr() in seen:  # packed layers keep a 0-element plain weight
            continue
        if name.endswith("embed_tokens.weight") and (not tied or lm_packed):
            continue
        if name == "lm_head.weight" and lm_packed:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32, help="B for the static baselines")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--model", default=None, help="model dir (default: the 63M-parameter bench Llama)")
    args = ap.parse_args(argv)
    path = args.model or bench_model_path()
    n = 16 if args.quick else args.num_prompts
    work = offline_chat_pairs(n, 1024, BENCH_SHAPE["vocab_size"], prompt_mean=200 if not args.quick else 64,
                              output_mean=180 if not args.quick else 24)
    print(f"model {path}; {n} requests, {sum(len(p) for p, _ in work)} prompt tokens, "
          f"{sum(o for _, o in work)} output tokens; torch threads {torch.get_num_threads()}", flush=True)
    res: dict = {"num_prompts": n, "quick": args.quick, "batch_size": args.batch_size}
    res["pagedserve_tok_s"] = run_pagedserve(path, work)
    res["static_tok_s"] = run_pagedserve(path, work, policy="static", max_num_seqs=args.batch_size,
                                         label=f"pagedserve static B={args.batch_size}")
    if not args.skip_hf:
        res["hf_static_tok_s"] = run_hf_static(path, work, args.batch_size)
        res["hf_cb_tok_s"] = run_hf_cb(path, work)
        res["ratio_vs_hf_static"] = res["pagedserve_tok_s"] / res["hf_static_tok_s"]
        res["ratio_vs_hf_cb"] = res["pagedserve_tok_s"] / res["hf_cb_tok_s"]
    res["ratio_vs_static_policy"] = res["pagedserve_tok_s"] / res["static_tok_s"]
    b1, weight_bytes = run_b1_decode(path, 32 if args.quick else 128)
    bw = copy_bandwidth_gbs()
    res.update(b1_decode_tok_s=b1, weight_bytes=weight_bytes, copy_gb_s=bw,
               b1_bound_tok_s=bw * 1e9 / weight_bytes)
    res["b1_fraction_of_bound"] = b1 / res["b1_bound_tok_s"]
    print(f"batch-1 decode {b1:.1f} tok/s; bound {res['b1_bound_tok_s']:.1f} tok/s "
          f"({weight_bytes / 1e6:.0f} MB weights at {bw:.1f} GB/s) -> {res['b1_fraction_of_bound']:.2f}")
    for k in ("ratio_vs_hf_static", "ratio_vs_hf_cb", "ratio_vs_static_policy"):
        if k in res:
            print(f"{k}: {res[k]:.2f}x")
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
