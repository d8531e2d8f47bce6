"""LLMEngine: the step loop around the scheduler and the executor, plus the text side
(tokenize, detokenize, stop strings, ``n > 1`` fan-out). No ray in here: the offline
``LLM`` runs it in-process and the Serve scheduler actor runs it inside an actor.

One ``step()``:

    scheduler.schedule() ─plan─▶ executor.execute_model() ─result─▶ scheduler.update_from_output()
                                                                         │ EngineCoreOutput per request
                                                                         ▼
                                              detokenize, stop strings, group samples ─▶ RequestOutput
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field

from pagedserve.cluster.text.tokenizer_pool import load_tokenizer
from pagedserve.cluster.engine.detokenizer import IncrementalDetokenizer
from pagedserve.cluster.engine.kv_sizing import log_kv_sizing
from pagedserve.cluster.wire.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.cluster.wire.request import EngineRequest
from pagedserve.cluster.wire.failures import ExecutorDeadError
from pagedserve.cluster.engine.step_containment import StepFailedError, contain, subplan
from pagedserve.cluster.engine.step_timer import StepTimer
from pagedserve.cluster.engine.structured_output import StructuredOutputManager
from pagedserve.cluster.engine.request_options import (num_samples, sample_params, select_best,
                                                       truncate_prompt)
from pagedserve.scheduler import Request, RequestStatus, Scheduler
from pagedserve.scheduler.outputs import EngineCoreOutput, ModelRunnerOutput, ProbePlan
from pagedserve.scheduler.sampling_params import SamplingParams, sample_seed
from pagedserve.scheduler.vocab_limits import check_vocab_limits
from pagedserve import plugins
from pagedserve.config import EngineConfig
from pagedserve.platforms import decide_here
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.loading.model_fetch import local_model_path
from pagedserve.worker.loading.model_source import resolve_model

logger = logging.getLogger("pagedserve")


@dataclass(slots=True)
class _Sample:
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
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    metrics: RequestMetrics
    # Siblings 1..n-1 join once sample 0 has prefilled, so they hit its prompt blocks
    # in the prefix cache instead of computing the same prompt n times.
    pending: list[Request] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_finished: int = 0
    params: SamplingParams | None = None  # the user's (n, best_of, logprobs asked)
    prompt_logprobs: list | None = None  # one slot per prompt position, filled by position
    num_outputs: int = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples)


class LLMEngine:
    def __init__(self, engine_config: EngineConfig,
                 executor_class: type) -> None:
        """``executor_class``: how to reach the workers (cluster/executors: the caller
        picks it with ``executor_class_for``; this loop never imports an executor)."""
        resolved = resolve_model(engine_config.model, revision=engine_config.revision,
                                 download_dir=engine_config.download_dir, config_only=True)
        path = resolved.path
        # An app built for a cluster arrives with its device decided (cluster/placement.py);
        # an engine built in-process (the offline LLM, tests) decides for this node.
        self.config = dataclasses.replace(decide_here(engine_config), model=path)
        if resolved.remote:  # a repo id or URI goes on as itself, at the commit found here: each
            # worker fetches the weights onto its own node (worker/loading/model_fetch.py)
            self.config.model, self.config.revision = engine_config.model, resolved.revision
        self.model_config = ModelConfig.from_pretrained(
            path, dtype=self.config.dtype, max_model_len=self.config.max_model_len, device=self.config.device)
        self.model_config.verify_tensor_parallel(self.config.tensor_parallel_size)
        self.max_model_len = self.model_config.max_model_len
        self.config.max_model_len = self.max_model_len
        # vLLM's naming: the id is --served-model-name, else --model as given; root is
        # --model as given (never the directory it resolved to, e.g. a cache entry).
        given = engine_config.model_root or engine_config.model
        self.model_root = os.fspath(given) if given is not None else resolved.served_model_name
        self.served_model_name = self.config.served_model_name or self.model_root
        # From this node's files (a repo id or URI tokenizer fetched here first, as the model's).
        self.tokenizer = load_tokenizer(local_model_path(self.config.tokenizer, download_dir=self.config.download_dir,
                                                         config_only=True) or path)
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                  self.eos_token_ids)

        self.executor = executor_class(self.config)
        self.num_gpu_blocks = self.executor.determine_num_available_blocks()
        self.executor.initialize_cache(self.num_gpu_blocks)
        self.scheduler = Scheduler(self.config.scheduler_config(self.max_model_len),
                                   self.config.cache_config(self.num_gpu_blocks))
        if self.scheduler.proposer is not None:  # a request that finds no draft lets steps pipeline
            self.scheduler.proposer.pause_when_idle = bool(self.config.async_scheduling)
        self.kv_sizing = log_kv_sizing(self.config, self.model_config, self.num_gpu_blocks, self.max_model_len)
        self._groups: dict[str, _Group] = {}
        # Requests scheduled for the first time (or again after preemption), cumulative:
        # the serving layer's measure of how fast the waiting queue drains.
        self.num_admitted = 0
        self._samples: dict[str, tuple[_Group, _Sample]] = {}
        self.last_plan = None
        # async_scheduling: (plan, wait for its result) of the step running now
        self._inflight: tuple | None = None
        self.timer = StepTimer(self.scheduler)  # the proposer's step and host times
        # The step variant, chosen once (vLLM V1: step / step_with_batch_queue).
        self._step_fn = self._step_async if self.config.async_scheduling else self._step_sync
        self._epoch = 0  # failed steps seen (step_containment.py): stamped on every plan
        plugins.on_engine(self)  # PAGEDSERVE_PLUGINS' install_engine hooks (plugins.py)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}).")
        return ids

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """ValueError unless the prompt and max_tokens fit max_model_len. Reads config
        only, so any thread may call it (the serving layer's tokenizer pool does)."""
        n = num_prompt_tokens
        if n >= self.max_model_len or (max_tokens is not None and n + max_tokens > self.max_model_len):
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n + (max_tokens or 1)} tokens ({n} in the prompt, "
                f"{max_tokens or 1} for the completion). Please reduce the prompt or max_tokens.")

    def check_params(self, params: SamplingParams):
        """ValueError for what only the model can judge: logit_bias ids past its vocabulary,
        a schema / regex / grammar that does not compile. Returns the compiled grammar (None
        without structured outputs; cached by spec)."""
        vocab = self.model_config.vocab_size
        bad = sorted(t for t in params.logit_bias or () if t >= vocab)
        if bad:
            raise ValueError(f"logit_bias names token id {bad[0]}, outside the vocabulary "
                             f"[0, {vocab}).")
        if params.structured_outputs is not None:
            return self.structured.compile(params.structured_outputs)
        return None

    def make_request(self, req: EngineRequest) -> EngineRequest:
        """Every check a request can fail, once (cluster/wire/request.py): ValueError naming
        the problem. Fills in ``req``'s token ids (tokenizing a text prompt that is still
        text, offline), its vocabulary-limited params, the text the model sees and the
        compiled grammar; returns it. Reads configuration and the tokenizer only: any thread
        may call it (a replica's tokenizer pool encodes with its own tokenizer copy first)."""
        params = check_vocab_limits(req.params, self.model_config.vocab_size, self.config.max_logprobs)
        prompt = req.prompt
        if req.messages is not None and req.prompt_token_ids is None:
            raise ValueError("a chat request must be rendered and tokenized before make_request.")
        prompt_ids = self.tokenize(prompt if req.prompt_token_ids is None else req.prompt_token_ids)
        if not prompt_ids:
            raise ValueError("the prompt is empty.")
        full_len = len(prompt_ids)
        prompt_ids = truncate_prompt(prompt_ids, params, self.max_model_len)
        self.check_length(len(prompt_ids), params.max_tokens)
        req.grammar = self.check_params(params)
        if len(prompt_ids) < full_len:  # RequestOutput.prompt is what the model saw
            req.prompt_text = self.tokenizer.decode(prompt_ids)
        else:  # the text itself, where this call tokenized it
            req.prompt_text = prompt if isinstance(prompt, str) and req.prompt_token_ids is None else None
        req.params, req.prompt_token_ids = params, prompt_ids
        return req

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, tenant: str | None = None) -> None:
        """vLLM's offline entry: one EngineRequest, ``make_request`` then ``add_engine_request``."""
        req = EngineRequest(request_id, prompt, params, priority, cache_salt, tenant=tenant,
                            arrival_time=arrival_time)
        self.add_engine_request(self.make_request(req))

    def add_engine_request(self, req: EngineRequest) -> None:
        """Trusts ``req`` (made by ``make_request``); only the engine's state can refuse it
        here: an id in use (ValueError) or no room in the scheduler (ValueError,
        QueueFullError), with nothing recorded."""
        request_id, prompt_ids, params = req.request_id, req.prompt_token_ids, req.params
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use.")
        arrival = time.monotonic() if req.arrival_time is None else req.arrival_time
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        group = _Group(request_id, req.prompt_text, prompt_ids, [], RequestMetrics(arrival_time=time.time()),
                       params=params, prompt_logprobs=None if params.prompt_logprobs is None
                       else [None] * len(prompt_ids))
        requests = []
        n = num_samples(params)
        for i in range(n):
            child = params if n == 1 else sample_params(
                params, i, None if params.seed is None else sample_seed(params.seed, i))
            if len(self.eos_token_ids) > 1 and not child.ignore_eos:
                extra = [t for t in self.eos_token_ids[1:] if t not in child.stop_token_ids]
                child = child.clone(stop_token_ids=child.stop_token_ids + extra)
            req_id = request_id if n == 1 else f"{request_id}#{i}"
            detok = (IncrementalDetokenizer(self.tokenizer, prompt_ids, child)
                     if child.detokenize else None)
            sample = _Sample(i, req_id, detok, child, logprobs=[] if child.logprobs is not None else None)
            group.samples.append(sample)
            requests.append(Request(req_id, prompt_ids, child, eos_token_id=eos, arrival_time=arrival,
                                    priority=req.priority, cache_salt=req.cache_salt, tenant=req.tenant))
        if params.structured_outputs is not None:  # one matcher per sample, one grammar
            for sample in group.samples:
                self.structured.add_request(sample.req_id, params.structured_outputs, req.grammar)
        try:
            self.scheduler.add_request(requests[0])  # raises ValueError before anything is recorded
        except BaseException:
            for sample in group.samples:
                self.structured.remove(sample.req_id)
            raise
        group.pending = requests[1:]
        self._groups[request_id] = group
        for sample in group.samples:
            self._samples[sample.req_id] = (group, sample)

    def request_status(self, request_id: str) -> dict | None:
        """Where a live request stands (its first sample's scheduler request, which every
        sibling waits behind): running or waiting, and why (Scheduler.waiting_info)."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        req = self.scheduler.get_request(group.samples[0].req_id)
        if req is None:
            return None
        info = self.scheduler.waiting_info(req.req_id)
        out = {"status": "waiting" if info is not None else "running", "tenant": req.tenant,
               "priority": req.priority, "num_preemptions": req.num_preemptions,
               "num_computed_tokens": req.num_computed_tokens,
               "num_prompt_tokens": len(group.prompt_token_ids),
               "num_output_tokens": sum(len(s.token_ids) for s in group.samples)}
        if info is not None:
            out.update(info)
        return out

    def fail_request(self, request_id: str, message: str) -> RequestOutput | None:
        """End one request with an error of its own (see ``_fail_group``)."""
        group = self._groups.get(request_id)
        return None if group is None else self._fail_group(group, message)

    def _fail_group(self, group: _Group, message: str) -> RequestOutput:
        """Its blocks are freed now, it leaves the batch before the next plan, and its
        final output carries ``error`` (finish_reason "error" on unfinished samples)."""
        logger.error("request %s failed on its own: %s", group.request_id, message)
        self.abort_request(group.request_id)
        for s in group.samples:
            if s.finish_reason is None:
                s.finish_reason = "error"
        group.num_finished = len(group.samples)
        group.metrics.finished_time = time.time()
        out = self._make_output(group, {})
        out.error = message
        return out

    def abort_all(self) -> None:
        self.abort_request(list(self._groups))

    def abort_request(self, request_ids: list[str] | str) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            group.pending = []
            self.scheduler.abort_requests([s.req_id for s in group.samples])
            for s in group.samples:
                self._samples.pop(s.req_id, None)
                self.structured.remove(s.req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or self.scheduler.has_unfinished_requests() or self._inflight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def get_stats(self):
        return self.scheduler.get_stats()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Plan a step, run it, return what it produced: ``_step_sync``, or with
        ``async_scheduling`` ``_step_async`` (chosen when the engine is built), whose call
        returns the outputs of the step before (the first call none)."""
        return self._step_fn()

    def _step_sync(self) -> list[RequestOutput]:
        """``step()`` without async_scheduling: plan, run, wait, process. Also the async
        engine's step while a grammar is live (its next mask needs each token first)."""
        plan = self._schedule()
        if self.structured.matchers:
            self.structured.fill_bitmask(plan, self.scheduler.get_request)
        if not self._has_work(plan):
            return self._finish_step(plan, ModelRunnerOutput(step_id=plan.step_id))
        t0 = time.perf_counter()
        result = self._wait(plan, lambda: self.executor.execute_model(plan))
        self.timer.in_turn(plan, result, time.perf_counter(), t0)
        return self._finish_step(plan, result)

    def _step_async(self) -> list[RequestOutput]:
        """``step()`` with async_scheduling: one step in flight while the host works. Which
        way this step goes is read from the engine's state, in this order:

            a step sent in turn is in flight       wait for it, send the next in turn, process
                                                   its outputs while that one runs (drafts)
            a grammar is live or requests draft    in turn: finish a pipelined step still in
                                                   flight first; then with a grammar the sync
                                                   step, with drafts the next step sent in turn
            otherwise                              pipelined: plan N+1 and send it, then
                                                   process N's outputs (the first call: none)

        Drafts need the tokens they follow, not their text, so while requests draft the next
        step is sent as soon as the scheduler has the last one's tokens."""
        if self._inflight is not None and self.timer.sent_in_turn is not None:
            return self._step_after_in_turn()
        if self.structured.matchers or self.scheduler.drafting():
            if self._inflight is not None:  # a pipelined step: its outputs before anything new
                inflight, self._inflight = self._inflight, None
                self.timer.reset()
                return self._finish_step(inflight[0], self._wait(*inflight))
            return self._step_sync() if self.structured.matchers else self._submit_in_turn()
        return self._step_pipelined()

    def _step_pipelined(self) -> list[RequestOutput]:
        inflight = self._inflight
        plan = self._schedule()
        self.timer.reset()
        self.timer.sent_in_turn = None
        self._inflight = (plan, self.executor.submit(plan)) if self._has_work(plan) else None
        return self._finish_step(inflight[0], self._wait(*inflight)) if inflight is not None else []

    def _step_after_in_turn(self) -> list[RequestOutput]:
        """The step sent in turn is waited for before anything else is planned; whether the
        next one drafts is asked once its verdicts are in."""
        inflight, self._inflight = self._inflight, None
        plan, result = inflight[0], self._wait(*inflight)
        self.timer.in_turn(plan, result, time.perf_counter(), self.timer.sent_in_turn, overlapped=True)
        settled = self._settle(plan, result)
        if not self.structured.matchers and self.scheduler.drafting():
            early = self._submit_in_turn()
        else:  # no next step in turn: the worker's wait until the next one is not the host's work
            early = []
            self.timer.reset()
        return self._emit(*settled) + early

    def _submit_in_turn(self) -> list[RequestOutput]:
        """Plan the next step from the scheduler's current state and send it, in turn (the
        next call waits for it before planning another). A plan with nothing to run is
        settled at once: its outputs, if any."""
        plan = self._schedule()
        if not self._has_work(plan):
            self.timer.reset()
            return self._finish_step(plan, ModelRunnerOutput(step_id=plan.step_id))
        self.timer.sent_in_turn = time.perf_counter()
        self._inflight = (plan, self.executor.submit(plan))
        return []

    def _schedule(self):
        plan = self.scheduler.schedule()
        plan.epoch = self._epoch
        if plan.scheduled_new_reqs:  # the end of its queue time (vllm:request_queue_time_seconds)
            now = time.time()
            for new in plan.scheduled_new_reqs:
                entry = self._samples.get(new.req_id)
                if entry and entry[0].metrics.first_scheduled_time is None:
                    entry[0].metrics.first_scheduled_time = now
        self.last_plan = plan  # the serving layer's batch timeline reads it (plain data)
        return plan

    @staticmethod
    def _has_work(plan) -> bool:
        return bool(plan.total_num_scheduled_tokens or plan.finished_req_ids or plan.preempted_req_ids)

    def _wait(self, plan, result) -> ModelRunnerOutput:
        """``result()`` (the step's result), or, if the step raised in the workers, the
        result of re-running it in parts with the requests at fault failed alone
        (step_containment.py). A plan already queued behind it is skipped by the workers:
        it is sent again, without the failed requests."""
        try:
            return result()
        except (ExecutorDeadError, StepFailedError):
            raise
        except Exception as e:
            error = e
        queued, self._inflight = self._inflight, None
        if queued is not None and not queued[1]().skipped:
            raise ExecutorDeadError("a plan queued behind a failed step ran on its rolled-back state")
        out = contain(plan, error, self.executor.execute_model, self._probe, self._next_epoch,
                      lambda e: isinstance(e, (ExecutorDeadError, StepFailedError)))
        if queued is not None:
            failed = list(out.failed or ())
            keep = set(queued[0].num_scheduled_tokens).difference(failed)
            again = subplan(queued[0], keep, self._epoch, drop_req_ids=failed)
            self._inflight = (again, self.executor.submit(again))
        return out

    def _next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def _probe(self) -> None:
        self.executor.execute_model(ProbePlan(step_id=self.scheduler.step_id, epoch=self._epoch))

    def _finish_step(self, plan, result: ModelRunnerOutput) -> list[RequestOutput]:
        return self._emit(*self._settle(plan, result))

    def _settle(self, plan, result: ModelRunnerOutput) -> tuple[float, dict, list]:
        """The step's result into the scheduler (what the next plan needs); returns what
        ``_emit`` turns into outputs."""
        now = time.time()
        self.num_admitted += len(plan.scheduled_new_reqs) + sum(
            plan.scheduled_cached_reqs.resumed_from_preemption)
        # Requests that failed on their own in the worker leave before the scheduler
        # sees the result, so their (empty) rows are skipped like aborted ones.
        for rid, piece in (result.prompt_logprobs or {}).items():
            entry = self._samples.get(rid)
            if entry is not None and entry[0].prompt_logprobs is not None:
                entry[0].prompt_logprobs[piece.start:piece.start + len(piece.logprobs)] = piece.logprobs
        failed: dict[str, RequestOutput] = {}
        for rid, message in (result.failed or {}).items():
            entry = self._samples.get(rid)
            if entry is not None:
                failed[entry[0].request_id] = self._fail_group(entry[0], message)
        return now, failed, list(self.scheduler.update_from_output(plan, result))

    def _emit(self, now: float, failed: dict, core_outputs: list) -> list[RequestOutput]:
        """Detokenize, stop strings, the outputs of the requests a settled step touched."""
        touched: dict[str, _Group] = {}
        deltas: dict[str, tuple[str, list[int], list | None]] = {}
        for out in core_outputs:
            entry = self._samples.get(out.req_id)
            if entry is None:
                continue  # aborted while the step ran (or failed above)
            group, sample = entry
            try:
                deltas[out.req_id] = self._process(group, sample, out, now)
            except Exception as e:  # its detokenizer or stop strings: this request only
                failed[group.request_id] = self._fail_group(group, f"{type(e).__name__}: {e}")
                continue
            touched[group.request_id] = group
        outputs = [self._make_output(g, deltas) for g in touched.values()
                   if g.request_id not in failed]
        outputs.extend(failed.values())
        for g in touched.values():
            if g.finished:
                self._groups.pop(g.request_id, None)
                for s in g.samples:
                    self._samples.pop(s.req_id, None)
                    self.structured.remove(s.req_id)
        return outputs

    def _process(self, group: _Group, sample: _Sample, out: EngineCoreOutput, now: float):
        new_ids = out.new_token_ids
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
        if new_ids and self.structured.accept(sample.req_id, new_ids) and finish_reason is None:
            # The grammar is done (it accepted a stop token the scheduler did not stop on:
            # ignore_eos, or min_tokens not reached): the request ends here.
            self.scheduler.finish_requests([sample.req_id], RequestStatus.FINISHED_STOPPED)
            finish_reason = "stop"
        if sample.detok is not None:
            if new_ids:
                # A stop *token* (EOS, stop_token_ids) ends the text before it, as in vLLM.
                delta_text = sample.detok.update(new_ids, stop_terminated=finish_reason == "stop")
            if sample.detok.stop_reason is not None:
                if finish_reason is None:
                    self.scheduler.finish_requests([sample.req_id], RequestStatus.FINISHED_STOPPED,
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
                self.scheduler.add_request(req)
            group.pending = []
        return delta_text, new_ids, out.new_logprobs

    def _make_output(self, group: _Group, deltas: dict) -> RequestOutput:
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
                             metrics=group.metrics, prompt_logprobs=plp)

    def shutdown(self) -> None:
        self.executor.shutdown()
