"""Scheduler micro-benchmark and KV-utilisation simulation (no model, no torch).

(a) Cost of one ``schedule()`` + ``update_from_output()`` with 256 running decoding
    requests, in microseconds per step (goal: <= 1 ms, well under a GPU decode step).
    ``us_per_step`` is this process's CPU time per step (mean): the wall clock on a
    shared machine also counts other processes; its p50 and mean are printed too.
(b) A synthetic chat workload (workloads.scheduler_chat_pairs: prompts ~ lognormal, mean
    200; outputs ~ exponential, mean 180, capped; ``max_tokens`` 1024) on a fixed KV
    budget, run to completion twice: ``kv_allocation="paged"`` and ``"contiguous"``.
    Reported per mode: utilisation = token slots holding a real token / slots allocated
    (averaged over steps), and the peak number of concurrent sequences.

The real Scheduler is driven with fake sampled tokens (EOS ignored; each request's
output length comes from the workload). The last line is one JSON object.

    python -m pagedserve.loadtest.offline.bench_scheduler [--requests 600] [--num-blocks 2048] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


from pagedserve.loadtest.workloads import fixed_length_prompts, scheduler_chat_pairs
from pagedserve.scheduler import (CacheConfig, ModelRunnerOutput, Request, RequestStatus, SamplingParams,  # noqa: E402
                       Scheduler, SchedulerConfig)

VOCAB = 32000


def fake_result(plan, next_token: int = 11) -> ModelRunnerOutput:
    """One sampled token for every request whose prompt (and outputs) are now computed."""
    reqs = []
    sampled = []
    for rid, n in plan.num_scheduled_tokens.items():
        reqs.append(rid)
        sampled.append([next_token])
    return ModelRunnerOutput(req_ids=reqs, sampled_token_ids=sampled, step_id=plan.step_id)


def fake_result_partial(sched: Scheduler, plan) -> ModelRunnerOutput:
    """Like ``fake_result`` but partial prefill chunks sample nothing (as the worker does)."""
    reqs, sampled = [], []
    requests = sched.requests
    for rid in plan.num_scheduled_tokens:
        req = requests[rid]
        reqs.append(rid)
        sampled.append([random.randrange(VOCAB)] if req.num_computed_tokens == req.num_tokens else [])
    return ModelRunnerOutput(req_ids=reqs, sampled_token_ids=sampled, step_id=plan.step_id)


def bench_step_cost(num_reqs: int = 256, prompt_len: int = 128, num_steps: int = 1500) -> dict:
    prompts = fixed_length_prompts(num_reqs, prompt_len, VOCAB, seed=0, first_id=0)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=num_reqs, max_num_batched_tokens=8192, max_model_len=4096),
        CacheConfig(num_blocks=num_reqs * ((prompt_len + num_steps + 64) // 16 + 1), block_size=16))
    params = SamplingParams(max_tokens=num_steps + 100, ignore_eos=True)
    for i in range(num_reqs):
        sched.add_request(Request(f"r{i}", prompts[i], params, eos_token_id=2, arrival_time=float(i)))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        plan = sched.schedule()
        sched.update_from_output(plan, fake_result_partial(sched, plan))
    assert len(sched.running) == num_reqs
    wall, cpu = [], []
    for step in range(num_steps):
        t0, c0 = time.perf_counter(), time.process_time()
        plan = sched.schedule()
        result = fake_result(plan, step % VOCAB)
        outs = sched.update_from_output(plan, result)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
        assert len(outs) == num_reqs and plan.total_num_scheduled_tokens == num_reqs
    wall.sort()
    cpu.sort()
    # CPU time of this process is the headline: on a shared box the wall clock also
    # counts the time other processes hold the core.
    return {"us_per_step": statistics.mean(cpu) * 1e6,
            "us_per_step_p50": cpu[len(cpu) // 2] * 1e6,
            "us_per_step_p99": cpu[int(len(cpu) * 0.99)] * 1e6,
            "us_per_step_wall_p50": wall[len(wall) // 2] * 1e6,
            "us_per_step_wall_mean": statistics.mean(wall) * 1e6}


def simulate(workload, kv_allocation: str, num_blocks: int, max_tokens: int) -> dict:
    block_size = 16
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=4096, max_model_len=4096),
        CacheConfig(num_blocks=num_blocks, block_size=block_size, kv_allocation=kv_allocation))
    target = {}
    for i, (prompt, olen) in enumerate(workload):
        # EOS ignored: each request stops at its sampled workload length via max_tokens,
        # but the *reservation* of the contiguous baseline sees the user's max_tokens.
        rid = f"r{i}"
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                  eos_token_id=None, arrival_time=float(i)))
        target[rid] = olen
    kv = sched.kv_cache_manager
    utils, peak, steps = [], 0, 0
    full = []  # running sequences on steps that found the pool >= 95% used (memory-bound)
    t0 = time.perf_counter()
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        steps += 1
        used_blocks = kv.num_blocks - kv.num_free_blocks
        if used_blocks:
            real = sum(r.num_computed_tokens for r in sched.running)
            utils.append(real / (used_blocks * block_size))
        if used_blocks >= 0.95 * kv.num_blocks:
            full.append(len(sched.running))
        peak = max(peak, len(sched.running))
        result = fake_result_partial(sched, plan)
        sched.update_from_output(plan, result)
        # The workload's output length plays the part of EOS: end with a stop string.
        done = [r.req_id for r in sched.running if r.num_output_tokens >= target[r.req_id]]
        if done:
            sched.finish_requests(done, RequestStatus.FINISHED_STOPPED)
    stats = sched.get_stats()
    return {"utilization": statistics.mean(utils), "peak_seqs": peak, "steps": steps,
            "mean_seqs_when_full": statistics.mean(full) if full else None,
            "preemptions": stats.num_preemptions, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--num-blocks", type=int, default=2048, help="KV budget in blocks of 16 tokens")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=1500, help="timed steps for (a)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    cost = bench_step_cost(num_steps=args.steps)
    print(f"(a) schedule()+update_from_output(), 256 running decodes: "
          f"{cost['us_per_step']:.0f} us/step mean CPU time, p50 {cost['us_per_step_p50']:.0f}, "
          f"p99 {cost['us_per_step_p99']:.0f}; wall p50 {cost['us_per_step_wall_p50']:.0f}, "
          f"mean {cost['us_per_step_wall_mean']:.0f}")
    workload = scheduler_chat_pairs(args.requests, args.seed, args.max_tokens, VOCAB)
    mean_p = statistics.mean(len(p) for p, _ in workload)
    mean_o = statistics.mean(o for _, o in workload)
    print(f"(b) workload: {args.requests} requests, prompt mean {mean_p:.0f}, output mean {mean_o:.0f}, "
          f"max_tokens {args.max_tokens}, KV budget {args.num_blocks} x 16 = {args.num_blocks * 16} tokens")
    res = {}
    for mode in ("paged", "contiguous"):
        res[mode] = simulate(workload, mode, args.num_blocks, args.max_tokens)
        r = res[mode]
        print(f"    {mode:10s} utilization {r['utilization']:.3f}  peak seqs {r['peak_seqs']:4d}  "
              f"steps {r['steps']:5d}  preemptions {r['preemptions']:4d}  ({r['seconds']:.1f} s)")
    ratio = res["paged"]["peak_seqs"] / res["contiguous"]["peak_seqs"]
    print(f"    concurrency ratio paged/contiguous: {ratio:.2f}x")
    print(json.dumps({
        "us_per_step": round(cost["us_per_step"], 1),
        "us_per_step_p50": round(cost["us_per_step_p50"], 1),
        "us_per_step_p99": round(cost["us_per_step_p99"], 1),
        "us_per_step_wall_p50": round(cost["us_per_step_wall_p50"], 1),
        "us_per_step_wall_mean": round(cost["us_per_step_wall_mean"], 1),
        "paged_utilization": round(res["paged"]["utilization"], 4),
        "contiguous_utilization": round(res["contiguous"]["utilization"], 4),
        "paged_peak_seqs": res["paged"]["peak_seqs"],
        "contiguous_peak_seqs": res["contiguous"]["peak_seqs"],
        "concurrency_ratio": round(ratio, 2),
        "paged_steps": res["paged"]["steps"], "contiguous_steps": res["contiguous"]["steps"],
        "paged_preemptions": res["paged"]["preemptions"],
        "num_requests": args.requests, "num_blocks": args.num_blocks,
    }))


if __name__ == "__main__":
    main()
