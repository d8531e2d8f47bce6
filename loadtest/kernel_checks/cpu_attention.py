"""Micro-benchmark of the CPU attention paths on the 63M-Llama layer shape.

    python -m pagedserve.loadtest.kernel_checks.cpu_attention [--threads 2] [--quick]

Per layer call (µs, best of n): the decode path at batch 1/32/128/256 with contexts drawn from
100-1000 tokens, and one 512-token prefill, for the fast torch path, the slow oracle
(paged_attention_ref), and per-sequence F.scaled_dot_product_attention over gathered
K/V (the obvious alternative). 12 heads, 4 KV heads, head_dim 64, block 16, fp32.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

from pagedserve.kernels import paged_attention, paged_attention_ref
from pagedserve.loadtest.kernel_checks.paged_batch import make_paged_batch


def sdpa_per_seq(b) -> torch.Tensor:
    md = b.attn_metadata
    bs, kvh, d = b.k_cache.shape[1:]
    out = torch.empty_like(b.q)
    cu = md.cu_seqlens_q.tolist()
    for i, sl in enumerate(md.seq_lens_cpu):
        nb = -(-sl // bs)
        blocks = md.block_table[i, :nb].long()
        k = b.k_cache.index_select(0, blocks).view(-1, kvh, d)[:sl].transpose(0, 1)
        v = b.v_cache.index_select(0, blocks).view(-1, kvh, d)[:sl].transpose(0, 1)
        qi = b.q[cu[i]:cu[i + 1]].transpose(0, 1)
        mask = torch.arange(sl)[None, :] <= torch.arange(sl - qi.shape[1], sl)[:, None]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=b.scale, enable_gqa=True)
        out[cu[i]:cu[i + 1]] = o.transpose(0, 1)
    return out


def timeit(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, skip the oracle at big batches")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    cases = [(f"decode x{n}", [1] * n, torch.randint(100, 1001, (n,), generator=gen).tolist())
             for n in (1, 32, 128, 256)]
    cases.append(("prefill 512", [512], [512]))
    cases.append(("chunk 256 @ 768", [256], [768]))
    print(f"{'case':<18}{'ctx tokens':>11}{'torch µs':>11}{'1st layer':>11}{'sdpa/seq µs':>13}{'ref µs':>11}"
          f"{'ref/torch':>10}")
    for name, qls, sls in cases:
        b = make_paged_batch(qls, sls, 12, 4, 64, 16, seed=1)
        md = b.attn_metadata
        reps = 3 if args.quick else 7
        # Steady state: layers 2..n of a step reuse the plan built by layer 1.
        t_torch = timeit(lambda: paged_attention(b.q, b.k_cache, b.v_cache, md, b.scale, backend="torch"), reps)
        # Layer 1: a fresh metadata object, so the gather plan is rebuilt.
        t_first = timeit(lambda: paged_attention(b.q, b.k_cache, b.v_cache, copy.copy(md), b.scale, backend="torch"),
                         reps)
        t_sdpa = timeit(lambda: sdpa_per_seq(b), reps)
        t_ref = float("nan")
        if not (args.quick and len(qls) > 32):
            t_ref = timeit(lambda: paged_attention_ref(b.q, b.k_cache, b.v_cache, md.block_table, md.seq_lens,
                                                       md.cu_seqlens_q, b.scale), max(1, reps // 2))
        print(f"{name:<18}{sum(sls):>11}{t_torch:>11.0f}{t_first:>11.0f}{t_sdpa:>13.0f}{t_ref:>11.0f}{t_ref / t_torch:>10.1f}",
              flush=True)


if __name__ == "__main__":
    main()
