"""The memory_profile section: an engine that sizes its own KV cache (no
num_gpu_blocks_override), what it reports, and a batch at max_num_seqs with top-p and
logprobs (the sampler's worst case) that must finish without OOM."""

from __future__ import annotations

import dataclasses
import logging

import torch

from pagedserve.loadtest.gpu.harness import Ctx, engine_worker, generate, run_engine
from pagedserve.loadtest.kernel_checks.gpu_kernels import RESULTS, row


class _LogTap(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if any(w in msg for w in ("KV cache", "GPU memory", "memory", "CUDA graphs")):
            self.lines.append(msg)


def check_memory_profile(ctx: Ctx) -> None:
    """No num_gpu_blocks_override: the engine sizes its KV cache (worker/worker.py's memory
    plan); what it reports, and a batch at max_num_seqs with top-p + logprobs runs."""
    from pagedserve import SamplingParams

    bsz, n = ctx.big_batch, ctx.max_tokens
    mml = 4096 if not ctx.smoke else 256
    tap, log = _LogTap(), logging.getLogger("pagedserve")
    old_level = log.level
    log.addHandler(tap)
    log.setLevel(logging.INFO)
    kw = dict(dtype="bfloat16", max_num_seqs=bsz, max_model_len=mml)
    if ctx.smoke:  # the CPU's KV budget is RAM (2 GiB by default): keep the smoke small
        kw["kv_cache_memory_bytes"] = 64 << 20

    def run(llm):
        info = dict(getattr(llm.engine, "kv_sizing", {}) or {})
        mp = engine_worker(llm).memory_plan  # worker/memory_plan.py: the CUDA profile's, None on the CPU
        plan = None if mp is None else {**dataclasses.asdict(mp), "kv_cache": mp.kv_cache, "text": mp.describe()}
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
        params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=n, ignore_eos=True, logprobs=5)
                  for i in range(bsz)]
        toks, dt, _ = generate(ctx, llm, ctx.prompts[:bsz], params)
        mem = {}
        if ctx.cuda:
            free, total = torch.cuda.mem_get_info()
            # After the run the allocator still holds its peak: used / total is what the
            # process took of the device, to set against gpu_memory_utilization (0.9).
            mem = dict(peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                       reserved_gib=torch.cuda.memory_reserved() / 2**30, free_gib=free / 2**30,
                       total_gib=total / 2**30, used_fraction=(total - free) / total)
        return info, plan, toks, dt, mem

    try:
        info, plan, toks, dt, mem = run_engine(ctx, ctx.small(), run, **kw)
    finally:
        log.removeHandler(tap)
        log.setLevel(old_level)
    ok = len(toks) == bsz and all(len(t) == n for t in toks)
    RESULTS["memory_profile"].update(kv_sizing=info, memory_plan=plan, log=tap.lines, batch=bsz, ok=ok,
                                     tok_s=sum(map(len, toks)) / dt, max_model_len=mml, **mem)
    row("memory_profile", "KV cache sized by the engine (no override)",
        f"{info.get('num_blocks', '?')} blocks = {info.get('kv_gib_per_rank', float('nan')):.2f} GiB, "
        f"{info.get('max_concurrency_at_max_model_len', float('nan')):.1f} seqs of {mml}")
    for line in tap.lines[-3:]:
        print(f"    log: {line}", flush=True)
    row("memory_profile", f"batch {bsz} (max_num_seqs), top-p + logprobs 5, {n} tok",
        f"{'no OOM, all finished PASS' if ok else 'FAIL'}"
        + (f"; peak {mem['peak_allocated_gib']:.1f} GiB allocated, {mem['free_gib']:.1f} GiB free of "
           f"{mem['total_gib']:.1f} (used {100 * mem['used_fraction']:.1f}% vs 90% asked)" if mem else ""))

