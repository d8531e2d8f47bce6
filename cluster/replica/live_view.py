"""What /dashboard draws for one engine replica: its KV block map and a timeline of
recent step plans. Built on the engine thread (it reads the block pool and the plan the
step just ran), sent with the replica's stats push, at most every ``VIEW_INTERVAL_S``.

Block map: one character per block, in block id order (20,000 blocks = 20 kB):

    .  free, empty          c  free, cached (a prefix a later request can take back)
    u  in use by one        s  shared: ref_cnt >= 2 (a prefix several requests hold)

Timeline: a ring of the last ``TIMELINE_STEPS`` plans, each
``{"step": id, "t": seconds, "reqs": [[req_id, "prefill"|"decode", num_tokens], ...]}``.
A request decodes when it is scheduled one token with its prompt already computed;
everything else (a prompt chunk, the recompute after a preemption) is a prefill.
"""

from __future__ import annotations

import time
from collections import deque

TIMELINE_STEPS = 64
VIEW_INTERVAL_S = 0.5


def block_map(block_pool) -> str:
    chars = []
    for b in block_pool.blocks:
        if b.ref_cnt >= 2:
            chars.append("s")
        elif b.ref_cnt == 1:
            chars.append("u")
        else:
            chars.append("c" if b.block_key is not None else ".")
    return "".join(chars)


class StepTimeline:
    def __init__(self, maxlen: int = TIMELINE_STEPS) -> None:
        self.steps: deque[dict] = deque(maxlen=maxlen)

    def record(self, plan, scheduler) -> None:
        """``plan``: the SchedulerOutput the step ran. Prompt lengths come from the
        scheduler's live requests (one that just finished counts as a decode of 1)."""
        if plan is None or not plan.num_scheduled_tokens:
            return
        computed = {n.req_id: (n.num_computed_tokens, len(n.prompt_token_ids))
                    for n in plan.scheduled_new_reqs}
        cached = plan.scheduled_cached_reqs
        for rid, c in zip(cached.req_ids, cached.num_computed_tokens):
            req = scheduler.get_request(rid)
            computed[rid] = (c, req.num_prompt_tokens if req is not None else c)
        reqs = []
        for rid, n in plan.num_scheduled_tokens.items():
            before, prompt = computed.get(rid, (0, 0))
            kind = "decode" if n == 1 and before >= prompt else "prefill"
            reqs.append([rid, kind, n])
        self.steps.append({"step": plan.step_id, "t": round(time.time(), 3), "reqs": reqs})


def replica_view(engine, timeline: StepTimeline, step_time_s: float | None) -> dict:
    pool = engine.scheduler.kv_cache_manager.block_pool
    return {"blocks": block_map(pool), "block_size": engine.config.block_size,
            "timeline": list(timeline.steps), "step_time_s": step_time_s,
            "t": round(time.time(), 3)}
