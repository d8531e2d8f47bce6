"""The step result: what one ModelRunnerOutput does to the Scheduler's requests. Sampled
tokens in, stop conditions checked, finished requests out, full blocks offered to the
prefix cache; a pooling request's vector ends it (finish_reason "stop").

Scheduler.update_from_output calls ``update_from_output(self, plan, result)``. The
scheduler is passed whole because a result touches much of it: its requests, running
list and waiting queue, the KV cache manager, the proposer and step id (drafts accepted),
the token counters of its stats, and ``_free_request`` for a request that ended.

With async scheduling (the engine plans step N+1 while step N runs) two things can
arrive that synchronous stepping never sees:
- a row of a request that ended meanwhile (finished, aborted): ignored, as always;
- a row of a request that the plan of step N+1 preempted: its token is right (step N
  ran with its blocks), and the worker already appended it to its own copy of the
  request, so the scheduler keeps it too; the recompute then covers it. Dropping it
  instead would leave the worker one token ahead of the scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.scheduler.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedserve.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:  # the Scheduler imports this module
    from pagedserve.scheduler.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED


def update_from_output(sched: Scheduler, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
    """Append sampled tokens, stop finished requests (their blocks go back at once),
    cache newly full blocks. Rows of requests that ended meanwhile are ignored."""
    kv = sched.kv_cache_manager
    caching = kv.enable_caching
    node_ids_of = kv.req_to_node_ids
    bs = sched.block_size
    get_request = sched.requests.get
    all_sampled = result.sampled_token_ids
    all_logprobs = result.logprobs
    all_pooled = result.pooled
    spec_tokens = plan.scheduled_spec_decode_tokens
    outputs: list[EngineCoreOutput] = []
    num_finished = 0
    for idx, rid in enumerate(result.req_ids):
        req = get_request(rid)
        if req is None:
            continue
        if all_pooled is not None and rid in all_pooled:
            outputs.append(_pooled(sched, req, all_pooled[rid]))
            num_finished += 1
            continue
        sampled = all_sampled[idx]
        if req.status is not _RUNNING:
            if sampled and req.status is _PREEMPTED:
                outputs.append(_late_tokens(sched, req, sampled, all_logprobs, idx))
            continue
        if spec_tokens and sampled and rid in spec_tokens:
            # Drafts past the first rejected one leave the computed count: their
            # slots hold K/V of tokens that are not the request's.
            num_draft = len(spec_tokens[rid])
            req.num_computed_tokens -= num_draft + 1 - len(sampled)
            sched.proposer.record(rid, num_draft, len(sampled) - 1, sched.step_id)
        if caching and req.num_computed_tokens // bs > len(node_ids_of[rid]):
            kv.cache_full_blocks(req)
        if not sampled:  # a partial prefill chunk
            continue
        if req.num_output_placeholders:
            req.num_output_placeholders -= 1
        kept = _append_tokens(sched, req, sampled)
        if req.status is not _RUNNING:
            sched._free_request(req)
            num_finished += 1
        outputs.append(_core_output(req, kept, all_logprobs, idx))
    if num_finished:
        sched.running = [r for r in sched.running if r.status is _RUNNING]
    return outputs


def _append_tokens(sched: Scheduler, req: Request, sampled: list[int]) -> list[int]:
    """Append ``sampled`` up to the first that ends the request (whose status is then
    set); return the tokens kept."""
    output_ids = req.output_token_ids
    if not output_ids:
        sched.num_prompt_tokens += req.num_prompt_tokens
    all_ids = req.all_token_ids
    kept = sampled
    for j, token in enumerate(sampled):
        output_ids.append(token)
        all_ids.append(token)
        num_output = len(output_ids)
        # Order: min_tokens gates EOS / stop tokens; then the length caps.
        if num_output >= req.min_tokens and req.stops_on(token):
            req.status = _STOPPED
            if token != req.eos_token_id or req.ignore_eos:
                req.stop_reason = token
        elif num_output >= req.max_tokens or len(all_ids) >= sched.max_model_len:
            req.status = _LENGTH
        else:
            continue
        kept = sampled[:j + 1]  # drop tokens past the stop
        break
    sched.num_generation_tokens += len(kept)
    return kept


def _late_tokens(sched: Scheduler, req: Request, sampled: list[int], all_logprobs, idx: int) -> EngineCoreOutput:
    """The token of a request preempted after its step was planned (see the module
    docstring); a request it ends leaves the waiting queue."""
    kept = _append_tokens(sched, req, sampled)
    if req.status is not _PREEMPTED:  # it ended the request
        sched.waiting.remove_request(req)
        sched._free_request(req)
    return _core_output(req, kept, all_logprobs, idx)


def _pooled(sched: Scheduler, req: Request, vector: bytes) -> EngineCoreOutput:
    """A pooling request whose prompt the step finished: it ends with its vector. Its full
    blocks go to the prefix cache first (their K/V serve any later request). Preempted
    after its step was planned (async scheduling), it ends all the same: the step ran with
    its blocks, so the vector is right."""
    if req.status is _RUNNING:
        kv = sched.kv_cache_manager
        if kv.enable_caching and req.num_computed_tokens // sched.block_size > len(kv.req_to_node_ids[req.req_id]):
            kv.cache_full_blocks(req)
    else:
        sched.waiting.remove_request(req)
    req.status = _STOPPED
    req.num_output_placeholders = 0
    sched.num_prompt_tokens += req.num_prompt_tokens
    sched._free_request(req)
    return EngineCoreOutput(req.req_id, [], req.finish_reason, None, None, req.num_cached_tokens, pooled=vector)


def _core_output(req: Request, kept: list[int], all_logprobs, idx: int) -> EngineCoreOutput:
    """What the engine streams for one row: the tokens kept, their logprobs, and the finish
    reason (None while the request goes on)."""
    logprobs = (all_logprobs[idx][:len(kept)] or None) if all_logprobs is not None else None
    return EngineCoreOutput(req.req_id, kept, req.finish_reason, req.stop_reason, logprobs, req.num_cached_tokens)
