"""Preemption thrash with and without the hysteresis (issue 15), no model, no torch.

The real Scheduler runs bench_scheduler's synthetic chat workload (workloads.scheduler_chat_pairs:
lognormal prompts, exponential outputs) to completion on a KV pool too small for it, once with
``preemption_protect_steps=0`` (a just-resumed request may be preempted again at once)
and once with the default; with one tenant and with two (whose fair share and slot
share preempt as well). Reported: preemptions per request and steps to drain.

    python -m pagedserve.loadtest.offline.bench_thrash [--requests 600] [--blocks 1024 2048] [--seed 0]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json

from pagedserve.loadtest.offline.bench_scheduler import VOCAB, fake_result_partial
from pagedserve.loadtest.workloads import scheduler_chat_pairs
from pagedserve.scheduler import (CacheConfig, Request, RequestStatus, SamplingParams, Scheduler,
                                  SchedulerConfig)
from pagedserve.scheduler.config import SchedulerConfig as _Defaults

MAX_TOKENS = 1024


def run(protect: int, num_blocks: int, requests: int, seed: int, tenants: int) -> dict:
    sched = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=4096,
                                      preemption_protect_steps=protect),
                      CacheConfig(num_blocks=num_blocks, block_size=16))
    target = {}
    for i, (prompt, olen) in enumerate(scheduler_chat_pairs(requests, seed, MAX_TOKENS, VOCAB)):
        rid = f"r{i}"
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                  eos_token_id=None, arrival_time=float(i), tenant=f"t{i % tenants}"))
        target[rid] = olen
    steps = 0
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        steps += 1
        sched.update_from_output(plan, fake_result_partial(sched, plan))
        done = [r.req_id for r in sched.running if r.num_output_tokens >= target[r.req_id]]
        if done:
            sched.finish_requests(done, RequestStatus.FINISHED_STOPPED)
    return {"preemptions_per_request": sched.get_stats().num_preemptions / requests, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--blocks", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    default = _Defaults.__dataclass_fields__["preemption_protect_steps"].default
    rows = []
    for blocks in args.blocks:
        for tenants in (1, 2):
            r = {"blocks": blocks, "tenants": tenants}
            for protect in (0, default):
                r[f"protect_{protect}"] = run(protect, blocks, args.requests, args.seed, tenants)
            a, b = r["protect_0"]["preemptions_per_request"], r[f"protect_{default}"]["preemptions_per_request"]
            print(f"{blocks:6d} blocks, {tenants} tenant(s): preemptions/request {a:.3f} without the "
                  f"hysteresis, {b:.3f} with {default} steps ({b / a if a else float('nan'):.2f}x); steps "
                  f"{r['protect_0']['steps']} vs {r[f'protect_{default}']['steps']}", flush=True)
            rows.append(r)
    print(json.dumps({"requests": args.requests, "seed": args.seed, "rows": rows}))


if __name__ == "__main__":
    main()
