"""Paged-KV simulation at one fixed memory budget, per KV-cache dtype (no model, no torch).

The same budget in bytes becomes a different number of 16-token blocks for each cache
format (scheduler/kv/kv_cache_dtype.py, scales included), and the real Scheduler runs
bench_scheduler's synthetic chat workload (workloads.scheduler_chat_pairs) to completion on
each pool. Reported per format: bytes per token, blocks, peak concurrent sequences and their
mean over the memory-bound steps (pool >= 95% used), preemptions, and the ratios to the
model-dtype cache. The peak comes at the first fill, and a bigger pool fills later, when its
sequences have grown longer, so the peak grows a little less than the pool; the
memory-bound mean is the steady state.
The last line is one JSON object.

    python -m pagedserve.loadtest.offline.bench_kv_dtype [--kv-cache-memory 720MiB] [--model DIR] [--requests 600]
        [--workload chat|long] [--seed 0 | --seeds 0-4]

``--seeds`` runs one workload per seed and prints, per format, the peak ratio to bf16 for each
seed with its minimum and mean (the peak is one draw of a random process: a seed moves it
either way).

``--workload long`` is the case the article behind issue 14 measures (how many 8K-token
sequences fit in FP16 and in Q8_0): every request a long context (a 1,500-2,500-token prompt, 256 new
tokens; workloads.long_context_pairs), all arriving at once, so the pool holds few, long sequences.

The default shape is SmolLM2-135M's (30 layers, 3 KV heads, head_dim 64), the default model.
"""

from __future__ import annotations

import argparse
import json

from pagedserve.loadtest.offline.bench_scheduler import VOCAB, simulate
from pagedserve.loadtest.workloads import long_context_pairs, scheduler_chat_pairs
from pagedserve.scheduler.kv.kv_cache_dtype import kv_cache_bytes_per_token

SMOLLM2_135M = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
# (label, kv_cache_dtype, model dtype bytes)
FORMATS = (("fp32 (auto)", "auto", 4), ("bf16 (auto)", "auto", 2), ("fp8_e4m3", "fp8", 2),
           ("fp8_e5m2", "fp8_e5m2", 2), ("int8", "int8", 2))


def _memory(text: str) -> int:
    from pagedserve.cluster.cli.args import _memory as parse

    return parse(text)


def run(cfg: dict, budget: int, requests: int, seed: int, max_tokens: int, workload: str = "chat") -> dict:
    layers, kv_heads = int(cfg["num_hidden_layers"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    workload = (scheduler_chat_pairs(requests, seed, max_tokens, VOCAB) if workload == "chat"
                else long_context_pairs(requests, seed, VOCAB))
    rows = {}
    for label, kv, elt in FORMATS:
        per_token = kv_cache_bytes_per_token(layers, kv_heads, head_dim, kv, elt)
        blocks = budget // (16 * per_token)
        r = simulate(workload, "paged", blocks, max_tokens)
        rows[label] = {"bytes_per_token": per_token, "num_blocks": blocks, **r}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-cache-memory", type=_memory, default=720 << 20, help="the one budget, e.g. 720MiB")
    ap.add_argument("--model", default=None, help="a config.json (or its directory); default SmolLM2-135M's shape")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", default=None, help="several seeds, e.g. 0-4 or 0,3,7: per-seed peak ratios")
    ap.add_argument("--workload", choices=("chat", "long"), default="chat",
                    help="chat: bench_scheduler's workload; long: long contexts (see above)")
    args = ap.parse_args()
    cfg = SMOLLM2_135M
    if args.model:
        from pagedserve.cluster.cli.kv_size import load_hf_config

        cfg = load_hf_config(args.model)
    if args.seeds:
        return over_seeds(cfg, args, _seeds(args.seeds))
    rows = run(cfg, args.kv_cache_memory, args.requests, args.seed, args.max_tokens, args.workload)
    what = "bench_scheduler's workload" if args.workload == "chat" else "long contexts, 1,500-2,500 + 256 tokens"
    print(f"KV budget {args.kv_cache_memory / 2**20:.0f} MiB, {args.requests} requests ({what}, seed {args.seed})")
    bf16, fp32 = rows["bf16 (auto)"], rows["fp32 (auto)"]
    for label, r in rows.items():
        full, f16, f32 = r["mean_seqs_when_full"], bf16["mean_seqs_when_full"], fp32["mean_seqs_when_full"]
        # None: the pool never filled (the budget holds the whole workload).
        bound = (f"{full:6.1f} ({full / f16:.2f}x bf16, {full / f32:.2f}x fp32)" if full and f16 and f32
                 else "   - (the pool never filled)")
        print(f"  {label:12s} {r['bytes_per_token']:6d} B/token  {r['num_blocks']:6d} blocks "
              f"({r['num_blocks'] / bf16['num_blocks']:.2f}x bf16)  peak seqs {r['peak_seqs']:4d} "
              f"({r['peak_seqs'] / bf16['peak_seqs']:.2f}x bf16, {r['peak_seqs'] / fp32['peak_seqs']:.2f}x fp32)  "
              f"memory-bound mean {bound}  preemptions {r['preemptions']:4d}  steps {r['steps']}")
    print(json.dumps({"kv_cache_memory": args.kv_cache_memory, "requests": args.requests, "workload": args.workload,
                      **{label: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                         for label, r in rows.items()}}))


def _seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-", 1)
        return list(range(int(lo), int(hi) + 1))
    return [int(x) for x in text.split(",")]


def over_seeds(cfg: dict, args, seeds: list[int]) -> None:
    ratios: dict[str, list[float]] = {}
    peaks: dict[str, list[int]] = {}
    for seed in seeds:
        rows = run(cfg, args.kv_cache_memory, args.requests, seed, args.max_tokens, args.workload)
        for label, r in rows.items():
            peaks.setdefault(label, []).append(r["peak_seqs"])
            ratios.setdefault(label, []).append(r["peak_seqs"] / rows["bf16 (auto)"]["peak_seqs"])
    print(f"KV budget {args.kv_cache_memory / 2**20:.0f} MiB, {args.requests} requests ({args.workload}), "
          f"seeds {seeds}: peak running sequences, and their ratio to bf16's")
    for label, rs in ratios.items():
        each = "  ".join(f"{p} ({x:.2f}x)" for p, x in zip(peaks[label], rs))
        print(f"  {label:12s} {each}   min {min(rs):.2f}x  mean {sum(rs) / len(rs):.2f}x")
    print(json.dumps({"kv_cache_memory": args.kv_cache_memory, "requests": args.requests, "workload": args.workload,
                      "seeds": seeds, "peak_seqs": peaks,
                      "peak_ratio_vs_bf16": {k: [round(x, 4) for x in v] for k, v in ratios.items()}}))


if __name__ == "__main__":
    main()
