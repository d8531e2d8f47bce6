"""Containing a failed step to the requests that caused it.

A step that raises in the workers is not the engine's death. Every rank rolled the step
back (worker/model_runner.py: the per-request state is as before the plan), so the
engine re-runs the same plan in parts: halves, then halves of the halves that fail, down
to single requests.

    plan {a b c d e f} raises
      ├─ {a b c}   ok       its rows stand
      └─ {d e f}   raises
           ├─ {d}    ok
           └─ {e f}  raises
                ├─ {e} raises   e fails, named (implicated twice: with the batch and alone)
                └─ {f} ok

A request in a part that succeeds gets the tokens the whole plan would have given it: the
same tokens in, its own generator state (rows are sampled independently). The parts'
results merge into one result for the plan, the failed requests in ``failed``: the engine
ends them alone and frees their blocks.

Bounded: at most ``max_reruns`` re-runs (then the step's failure stands: the engine is
dead). When no part succeeded, the workers are asked to run a probe (one token, no
cache): a failure of that too is a broken worker, not a bad request.

Each failure the engine sees starts a new plan epoch (``SchedulerOutput.epoch``): a
worker skips the plans of an epoch whose step failed, so a plan queued behind the failed
one (async scheduling) waits to be sent again instead of running on rolled-back state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pagedserve.scheduler.outputs import CachedRequestData, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("pagedserve")


class StepFailedError(RuntimeError):
    """A step raised and the failure could not be laid at some requests' door (a broken
    worker, or more re-runs than allowed): the engine cannot step any more."""


def max_reruns(num_reqs: int) -> int:
    """Enough for a few bad requests in a full batch (each costs ~2 log2(B) re-runs)."""
    return 8 + 4 * max(1, num_reqs).bit_length()


def subplan(plan: SchedulerOutput, keep: set[str], epoch: int,
            drop_req_ids: list[str] = ()) -> SchedulerOutput:
    """The part of ``plan`` that schedules only ``keep``. Finished and preempted ids go in
    every part (dropping state twice is a no-op); ``drop_req_ids`` are added to the
    finished ones (the worker forgets requests the engine failed)."""
    c = plan.scheduled_cached_reqs
    idx = [i for i, r in enumerate(c.req_ids) if r in keep]
    nst = {r: n for r, n in plan.num_scheduled_tokens.items() if r in keep}
    return SchedulerOutput(
        scheduled_new_reqs=[r for r in plan.scheduled_new_reqs if r.req_id in keep],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[c.req_ids[i] for i in idx],
            resumed_from_preemption=[c.resumed_from_preemption[i] for i in idx],
            new_block_ids=[c.new_block_ids[i] for i in idx],
            num_computed_tokens=[c.num_computed_tokens[i] for i in idx]),
        num_scheduled_tokens=nst, total_num_scheduled_tokens=sum(nst.values()),
        finished_req_ids=list(plan.finished_req_ids) + list(drop_req_ids),
        preempted_req_ids=list(plan.preempted_req_ids), step_id=plan.step_id,
        structured_output_req_ids=plan.structured_output_req_ids,
        grammar_bitmask=plan.grammar_bitmask, epoch=epoch,
        scheduled_spec_decode_tokens={r: d for r, d in plan.scheduled_spec_decode_tokens.items() if r in keep})


def contain(plan: SchedulerOutput, error: BaseException,
            run: Callable[[SchedulerOutput], ModelRunnerOutput], probe: Callable[[], None],
            new_epoch: Callable[[], int], is_fatal: Callable[[BaseException], bool]) -> ModelRunnerOutput:
    """Re-run ``plan`` (which raised ``error``) in parts; returns its merged result with
    the requests at fault in ``failed``. ``new_epoch()`` is called after every failure
    seen (the first one included) and gives the epoch of the plans sent next. Raises
    StepFailedError when the failure is the workers', and re-raises what ``is_fatal``."""
    req_ids = list(plan.num_scheduled_tokens)
    logger.error("step %d failed (%s: %s) with %d requests scheduled (%s); re-running it in parts",
                 plan.step_id, type(error).__name__, error, len(req_ids), ", ".join(req_ids[:16]),
                 exc_info=error)
    epoch = new_epoch()
    budget = max_reruns(len(req_ids))
    parts = _halves(req_ids) if len(req_ids) > 1 else [req_ids]
    results: list[ModelRunnerOutput] = []
    at_fault: dict[str, str] = {}
    while parts:
        part = parts.pop()
        if budget == 0:
            raise StepFailedError(f"step {plan.step_id} kept failing after {max_reruns(len(req_ids))} "
                                  f"re-runs of parts of its batch: {type(error).__name__}") from error
        budget -= 1
        try:
            results.append(run(subplan(plan, set(part), epoch)))
        except BaseException as e:
            if is_fatal(e):
                raise
            epoch = new_epoch()
            if len(part) > 1:
                parts.extend(_halves(part))
                continue
            logger.error("request %s fails: step %d raised with it in the batch and with it alone "
                         "(%s: %s)", part[0], plan.step_id, type(e).__name__, e, exc_info=e)
            at_fault[part[0]] = f"the engine step failed with this request in it ({type(e).__name__})"
    if not results:
        try:
            probe()
        except BaseException as e:
            if is_fatal(e):
                raise
            raise StepFailedError(f"step {plan.step_id} failed with every part of its batch and the "
                                  f"worker probe failed too: {type(e).__name__}") from e
    return _merge(plan, results, at_fault)


def _halves(ids: list[str]) -> list[list[str]]:
    mid = len(ids) // 2
    return [ids[mid:], ids[:mid]]  # popped last first: the first half runs first


def _merge(plan: SchedulerOutput, results: list[ModelRunnerOutput],
           at_fault: dict[str, str]) -> ModelRunnerOutput:
    sampled: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    prompt_logprobs: dict = {}
    failed = dict(at_fault)
    resident, load_s = None, []  # the adapters' host cache: its last report, every read
    for res in results:
        if res.lora_resident is not None:
            resident = res.lora_resident
        load_s.extend(res.lora_load_s)
        for i, rid in enumerate(res.req_ids):
            sampled[rid] = res.sampled_token_ids[i]
            if res.logprobs is not None:
                logprobs[rid] = res.logprobs[i]
        failed.update(res.failed or {})
        prompt_logprobs.update(res.prompt_logprobs or {})
    req_ids = list(plan.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=[sampled.get(r, []) for r in req_ids],
        logprobs=[logprobs.get(r, []) for r in req_ids] if logprobs else None,
        step_id=plan.step_id, failed=failed or None, prompt_logprobs=prompt_logprobs or None,
        lora_resident=resident, lora_load_s=tuple(load_s))
