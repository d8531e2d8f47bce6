"""Small drivers for scheduler tests: build a Scheduler, add requests, run one step
with fake sampled tokens the way a worker would (partial prefill chunks sample nothing)."""

from __future__ import annotations

from pagedserve.scheduler import (CacheConfig, EngineCoreOutput, ModelRunnerOutput, Request, SamplingParams,
                       Scheduler, SchedulerConfig, SchedulerOutput)


def make_scheduler(num_blocks=16, block_size=4, budget=64, max_seqs=8, max_model_len=64,
                   policy="fcfs", chunked=True, watermark=0.0, **cache_kw) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                        enable_chunked_prefill=chunked, scheduling_policy=policy),
        CacheConfig(num_blocks=num_blocks, block_size=block_size, watermark=watermark, **cache_kw))


def add(sched: Scheduler, rid: str, prompt, *, arrival: float = 0.0, eos: int | None = None,
        priority: int = 0, salt: str | None = None, **sampling) -> Request:
    sampling.setdefault("max_tokens", 16)
    req = Request(rid, list(prompt), SamplingParams(**sampling), eos_token_id=eos,
                  arrival_time=arrival, priority=priority, cache_salt=salt)
    sched.add_request(req)
    return req


def fake_result(sched: Scheduler, plan: SchedulerOutput, token: int = 7,
                tokens: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
    req_ids, sampled = [], []
    for rid in plan.num_scheduled_tokens:
        req = sched.requests[rid]
        req_ids.append(rid)
        if req.num_computed_tokens < req.num_tokens:
            sampled.append([])  # partial prefill chunk
        elif tokens is not None and rid in tokens:
            sampled.append(list(tokens[rid]))
        else:
            sampled.append([token])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, step_id=plan.step_id)


def step(sched: Scheduler, token: int = 7, tokens: dict[str, list[int]] | None = None
         ) -> tuple[SchedulerOutput, dict[str, EngineCoreOutput]]:
    plan = sched.schedule()
    outs = sched.update_from_output(plan, fake_result(sched, plan, token, tokens))
    return plan, {o.req_id: o for o in outs}


def block_ids(sched: Scheduler, rid: str) -> list[int]:
    return sched.kv_cache_manager.get_block_ids(rid)


def free_ids(sched: Scheduler) -> list[int]:
    queue = sched.kv_cache_manager.block_pool.free_block_queue
    return [b.block_id for b in queue.get_all_free_blocks()]
