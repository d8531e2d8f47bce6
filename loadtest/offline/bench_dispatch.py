"""Per-step dispatch overhead of the Ray executor at TP=1 and TP=2.

    python -m pagedserve.loadtest.offline.bench_dispatch [--model DIR] [--batch 8] [--steps 200]

One engine step = the scheduler actor sends a plan, every rank runs it, rank 0 returns
the result. The benchmark drives real worker actors with real decode plans (a batch of
requests, one new token each per step) and splits each step's wall time:

    step_us      round trip as the scheduler sees it (executor.execute_model)
    exec_us      time inside Worker.execute_model on the slowest rank
    dispatch_us  step_us - exec_us: plan serialization, channel write/read, result return

The executor's one channel is measured: ZMQ PUSH/PULL (a Ray compiled graph, measured
here before, cost about twice as much per step and went; git history keeps it). The
in-worker time comes from TimedWorker, a subclass of the executor's actor class that lives
here, not in the serving path. At TP=1 it also times the in-process UniProcExecutor (no
dispatch at all) for reference. Medians over the decode steps. The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from pagedserve.cluster.executors.ray_executor import RayExecutor, RayWorkerWrapper
from pagedserve.loadtest.workloads import patterned_ids
from pagedserve.scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams


class TimedWorker(RayWorkerWrapper):
    """The executor's worker actor, keeping the seconds each step spends inside
    Worker.execute_model (the bench subtracts them from the round trip)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.exec_times: list[float] = []

    def execute_model(self, plan):
        t0 = time.perf_counter()
        out = super().execute_model(plan)
        self.exec_times.append(time.perf_counter() - t0)
        return out

    def pop_exec_times(self) -> list[float]:
        times, self.exec_times = self.exec_times, []
        return times


class TimedRayExecutor(RayExecutor):
    worker_cls = TimedWorker

    def pop_exec_times(self) -> list[list[float]]:
        return self._all([w.pop_exec_times.remote() for w in self.workers], "reading the step times")


def plans(batch: int, prompt_len: int, steps: int, block_size: int):
    """A prefill plan for ``batch`` requests, then ``steps`` decode plans (diffs only)."""
    blocks_per_req = (prompt_len + steps + block_size) // block_size + 1
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    new = [NewRequestData(req_id=f"r{i}", prompt_token_ids=patterned_ids(i, prompt_len, 303, 3),
                          sampling_params=params,
                          block_ids=list(range(i * blocks_per_req, (i + 1) * blocks_per_req)),
                          num_computed_tokens=0) for i in range(batch)]
    yield SchedulerOutput(scheduled_new_reqs=new,
                          num_scheduled_tokens={f"r{i}": prompt_len for i in range(batch)},
                          total_num_scheduled_tokens=batch * prompt_len, step_id=0)
    ids = [f"r{i}" for i in range(batch)]
    for k in range(1, steps + 1):
        cached = CachedRequestData(req_ids=ids, resumed_from_preemption=[False] * batch,
                                   new_block_ids=[[] for _ in ids],
                                   num_computed_tokens=[prompt_len + k - 1] * batch)
        yield SchedulerOutput(scheduled_cached_reqs=cached,
                              num_scheduled_tokens={r: 1 for r in ids},
                              total_num_scheduled_tokens=batch, step_id=k)
    yield SchedulerOutput(finished_req_ids=ids, step_id=steps + 1)


def run(executor, args, warmup: int = 10) -> tuple[list[float], list[int]]:
    step_s, tokens = [], []
    for i, plan in enumerate(plans(args.batch, args.prompt_len, args.steps, args.block_size)):
        t0 = time.perf_counter()
        out = executor.execute_model(plan)
        dt = time.perf_counter() - t0
        if 0 < i <= args.steps:  # decode steps only
            step_s.append(dt)
        if out is not None and out.sampled_token_ids and i == args.steps:
            tokens = [t[0] for t in out.sampled_token_ids]
    return step_s[warmup:], tokens


def bench_ray(tp: int, model: str, args) -> dict:
    from pagedserve.config import EngineConfig

    cfg = EngineConfig(model=model, tensor_parallel_size=tp, block_size=args.block_size,
                       num_gpu_blocks_override=args.num_blocks, dtype="float32", device=args.device)
    ex = TimedRayExecutor(cfg)
    try:
        ex.initialize_cache(args.num_blocks)
        ex.pop_exec_times()
        step_s, tokens = run(ex, args)
        per_rank = ex.pop_exec_times()
    finally:
        ex.shutdown()
    # Align the in-worker times with the measured decode steps (same slicing as run()).
    exec_s = [max(ts) for ts in zip(*(r[1:args.steps + 1][10:] for r in per_rank))]
    dispatch = [s - e for s, e in zip(step_s, exec_s)]
    return dict(step_us=statistics.median(step_s) * 1e6, exec_us=statistics.median(exec_s) * 1e6,
                dispatch_us=statistics.median(dispatch) * 1e6,
                dispatch_p90_us=sorted(dispatch)[int(0.9 * len(dispatch))] * 1e6, tokens=tokens)


def bench_uniproc(model: str, args) -> dict:
    from pagedserve.cluster.executors.uniproc import UniProcExecutor
    from pagedserve.config import EngineConfig

    cfg = EngineConfig(model=model, block_size=args.block_size, num_gpu_blocks_override=args.num_blocks,
                       dtype="float32", device=args.device, num_threads=1)
    ex = UniProcExecutor(cfg)
    ex.initialize_cache(args.num_blocks)
    step_s, tokens = run(ex, args)
    ex.shutdown()
    return dict(step_us=statistics.median(step_s) * 1e6, tokens=tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: a tiny random test model)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    model = args.model
    if model is None:
        from pagedserve.worker.loading.random_models import make_test_model

        model = make_test_model("llama-gqa2-hd64", os.path.join(tempfile.gettempdir(), "pagedserve-test-models"))

    from pagedserve.cluster.ray_utils import init_ray, shutdown_ray

    init_ray()
    try:
        uni = bench_uniproc(model, args)
        runs = {tp: bench_ray(tp, model, args) for tp in (1, 2)}
    finally:
        shutdown_ray()
    rows = [("uniproc tp=1", uni)] + [(f"zmq tp={tp}", r) for tp, r in runs.items()]
    for name, r in rows:
        extra = "" if "dispatch_us" not in r else (
            f"  exec {r['exec_us']:8.0f} us  dispatch {r['dispatch_us']:6.0f} us"
            f" (p90 {r['dispatch_p90_us']:.0f}, {100 * r['dispatch_us'] / r['step_us']:.1f}% of step)")
        print(f"{name:13s} step {r['step_us']:8.0f} us{extra}")
    same = all(r["tokens"] == uni["tokens"] for r in runs.values())
    print(f"last-step greedy tokens equal across all runs: {same}")
    tp1, tp2 = runs[1], runs[2]
    print(json.dumps(dict(
        batch=args.batch, steps=args.steps, dispatch="zmq",
        step_us_uniproc=round(uni["step_us"], 1),
        step_us_tp1=round(tp1["step_us"], 1), step_us_tp2=round(tp2["step_us"], 1),
        dispatch_us_tp1=round(tp1["dispatch_us"], 1), dispatch_us_tp2=round(tp2["dispatch_us"], 1),
        dispatch_share_tp1=round(tp1["dispatch_us"] / tp1["step_us"], 4),
        dispatch_share_tp2=round(tp2["dispatch_us"] / tp2["step_us"], 4),
        tokens_equal=same)))


if __name__ == "__main__":
    main()
