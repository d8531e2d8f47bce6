"""The text side of the engine (vLLM V1's OutputProcessor): each request's samples, their
detokenizers and stop strings, ``n`` and ``best_of`` groups, prompt logprobs, and the
``RequestOutput`` a step gives each request it touched.

    EngineRequest ─make_group─▶ Group (one Sample per n / best_of, a scheduler Request each)
    EngineCoreOutput per sample ─emit─▶ detokenize, stop strings, grammar end ─▶ RequestOutput
                                        per group (best_of picked when the group ends)

The engine (llm_engine.py) owns the order of things (add, step, abort, failure); this keeps
the per-request state those steps read and write. A stop string or a grammar that ends a
request finishes it in the scheduler from here, and a group's siblings 1..n-1 join the
scheduler once sample 0 has prefilled (they hit its prompt blocks in the prefix cache).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedserve.cluster.engine.detokenizer import IncrementalDetokenizer
from pagedserve.cluster.engine.request_options import num_samples, sample_params, select_best
from pagedserve.cluster.wire.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.cluster.wire.request import EngineRequest
from pagedserve.scheduler import Request, RequestStatus
from pagedserve.scheduler.outputs import EngineCoreOutput
from pagedserve.scheduler.sampling_params import SamplingParams, sample_seed


@dataclass(slots=True)
class Sample:
    """One of the ``n`` samples of a user request (a scheduler Request of its own)."""

    index: int
    req_id: str
    detok: IncrementalDetokenizer | None
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Sample]
    metrics: RequestMetrics
    # Siblings 1..n-1 join once sample 0 has prefilled, so they hit its prompt blocks
    # in the prefix cache instead of computing the same prompt n times.
    pending: list[Request] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_finished: int = 0
    params: SamplingParams | None = None  # the user's (n, best_of, logprobs asked)
    prompt_logprobs: list | None = None  # one slot per prompt position, filled by position
    num_outputs: int = 0
    pooled: bytes | None = None  # an embedding request's vector, once its prompt has run

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int], scheduler, structured, fail) -> None:
        """``fail(group, message)``: the engine's end of one request with an error of its own
        (it aborts the request everywhere, then ``failed_output`` here)."""
        self._tokenizer = tokenizer
        self._eos = eos_token_ids
        self._scheduler = scheduler
        self._structured = structured
        self._fail = fail
        self.groups: dict[str, Group] = {}  # request id -> its group
        self.samples: dict[str, tuple[Group, Sample]] = {}  # a sample's scheduler req_id -> it

    def make_group(self, req: EngineRequest) -> tuple[Group, list[Request]]:
        """``req``'s group and one scheduler Request per sample (the first is added by the
        engine; the others wait in ``group.pending``). Nothing is recorded yet: ``add``."""
        request_id, prompt_ids, params = req.request_id, req.prompt_token_ids, req.params
        arrival = time.monotonic() if req.arrival_time is None else req.arrival_time
        eos = self._eos[0] if self._eos else None
        group = Group(request_id, req.prompt_text, prompt_ids, [], RequestMetrics(arrival_time=time.time()),
                       params=params, prompt_logprobs=None if params.prompt_logprobs is None
                       else [None] * len(prompt_ids))
        requests = []
        n = num_samples(params)
        for i in range(n):
            child = params if n == 1 else sample_params(
                params, i, None if params.seed is None else sample_seed(params.seed, i))
            if len(self._eos) > 1 and not child.ignore_eos:
                extra = [t for t in self._eos[1:] if t not in child.stop_token_ids]
                child = child.clone(stop_token_ids=child.stop_token_ids + extra)
            req_id = request_id if n == 1 else f"{request_id}#{i}"
            detok = (IncrementalDetokenizer(self._tokenizer, prompt_ids, child)
                     if child.detokenize else None)
            sample = Sample(i, req_id, detok, child, logprobs=[] if child.logprobs is not None else None)
            group.samples.append(sample)
            requests.append(Request(req_id, prompt_ids, child, eos_token_id=eos, arrival_time=arrival,
                                    priority=req.priority, cache_salt=req.cache_salt, tenant=req.tenant,
                                    lora_request=req.lora_request, pooling_params=req.pooling))
        return group, requests

    def add(self, group: Group, pending: list[Request]) -> None:
        group.pending = pending
        self.groups[group.request_id] = group
        for sample in group.samples:
            self.samples[sample.req_id] = (group, sample)

    def drop(self, request_id: str) -> Group | None:
        """Forget a request (aborted or failed); its group, if it was live."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            group.pending = []
            for s in group.samples:
                self.samples.pop(s.req_id, None)
                self._structured.remove(s.req_id)
        return group

    def first_scheduled(self, plan) -> None:
        """The end of each new request's queue time (vllm:request_queue_time_seconds)."""
        now = time.time()
        for new in plan.scheduled_new_reqs:
            entry = self.samples.get(new.req_id)
            if entry and entry[0].metrics.first_scheduled_time is None:
                entry[0].metrics.first_scheduled_time = now

    def add_prompt_logprobs(self, result) -> None:
        """A step's prompt-logprob pieces, each into its slots by position."""
        for rid, piece in (result.prompt_logprobs or {}).items():
            entry = self.samples.get(rid)
            if entry is not None and entry[0].prompt_logprobs is not None:
                entry[0].prompt_logprobs[piece.start:piece.start + len(piece.logprobs)] = piece.logprobs

    def failed_output(self, group: Group, message: str) -> RequestOutput:
        """The final output of a request that failed on its own: ``error`` set, finish_reason
        "error" on its unfinished samples."""
        for s in group.samples:
            if s.finish_reason is None:
                s.finish_reason = "error"
        group.num_finished = len(group.samples)
        group.metrics.finished_time = time.time()
        out = self.make_output(group, {})
        out.error = message
        return out

    def emit(self, now: float, failed: dict, core_outputs: list) -> list[RequestOutput]:
        """Detokenize, stop strings, the outputs of the requests a settled step touched;
        ``failed`` (request id -> its failed output) gains those that fail here."""
        touched: dict[str, Group] = {}
        deltas: dict[str, tuple[str, list[int], list | None]] = {}
        for out in core_outputs:
            entry = self.samples.get(out.req_id)
            if entry is None:
                continue  # aborted while the step ran (or failed above)
            group, sample = entry
            try:
                deltas[out.req_id] = self.process(group, sample, out, now)
            except Exception as e:  # its detokenizer or stop strings: this request only
                failed[group.request_id] = self._fail(group, f"{type(e).__name__}: {e}")
                continue
            touched[group.request_id] = group
        outputs = [self.make_output(g, deltas) for g in touched.values()
                   if g.request_id not in failed]
        outputs.extend(failed.values())
        for g in touched.values():
            if g.finished:
                self.groups.pop(g.request_id, None)
                for s in g.samples:
                    self.samples.pop(s.req_id, None)
                    self._structured.remove(s.req_id)
        return outputs

    def process(self, group: Group, sample: Sample, out: EngineCoreOutput, now: float):
        new_ids = out.new_token_ids
        if out.pooled is not None:  # an embedding request: its one output, at the end of its prompt
            group.pooled = out.pooled
            group.metrics.first_token_time = now
            group.num_cached_tokens = out.num_cached_tokens
        if new_ids:
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
                group.num_cached_tokens = out.num_cached_tokens
            group.metrics.last_token_time = now
            sample.token_ids.extend(new_ids)
            if sample.logprobs is not None and out.new_logprobs:
                sample.logprobs.extend(out.new_logprobs)
        delta_text = ""
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if new_ids and self._structured.accept(sample.req_id, new_ids) and finish_reason is None:
            # The grammar is done (it accepted a stop token the scheduler did not stop on:
            # ignore_eos, or min_tokens not reached): the request ends here.
            self._scheduler.finish_requests([sample.req_id], RequestStatus.FINISHED_STOPPED)
            finish_reason = "stop"
        if sample.detok is not None:
            if new_ids:
                # A stop *token* (EOS, stop_token_ids) ends the text before it, as in vLLM.
                delta_text = sample.detok.update(new_ids, stop_terminated=finish_reason == "stop")
            if sample.detok.stop_reason is not None:
                if finish_reason is None:
                    self._scheduler.finish_requests([sample.req_id], RequestStatus.FINISHED_STOPPED,
                                                   stop_reason=sample.detok.stop_reason)
                finish_reason, stop_reason = "stop", sample.detok.stop_reason
            if finish_reason is not None:
                delta_text += sample.detok.flush()
        if finish_reason is not None and sample.finish_reason is None:
            sample.finish_reason, sample.stop_reason = finish_reason, stop_reason
            group.num_finished += 1
            group.metrics.finished_time = now
        if group.pending and sample.index == 0:
            for req in group.pending:
                self._scheduler.add_request(req)
            group.pending = []
        return delta_text, new_ids, out.new_logprobs

    def make_output(self, group: Group, deltas: dict) -> RequestOutput:
        completions = []
        for s in group.samples:
            d_text, d_ids, d_lp = deltas.get(s.req_id, ("", [], None))
            completions.append(CompletionOutput(
                index=s.index, text=s.detok.output_text if s.detok else "", token_ids=s.token_ids,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason, logprobs=s.logprobs,
                delta_text=d_text, delta_token_ids=d_ids, delta_logprobs=d_lp))
        params = group.params
        if params is not None and num_samples(params) > params.n and group.finished:
            completions = select_best(completions, params)
        # Prompt logprobs are complete by the first output (its token needed the whole
        # prompt): they ride on it and on the final one only, not on every stream delta.
        group.num_outputs += 1
        plp = group.prompt_logprobs if group.num_outputs == 1 or group.finished else None
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             finished=group.finished, num_cached_tokens=group.num_cached_tokens,
                             metrics=group.metrics, prompt_logprobs=plp, pooled=group.pooled)
