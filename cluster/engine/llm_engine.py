"""LLMEngine: the step loop around the scheduler and the executor: requests in (validated
once: ``make_request``), steps, aborts and per-request failures; the text side of each
request is its OutputProcessor's (output_processor.py). No ray in here: the offline ``LLM``
runs it in-process and the Serve scheduler actor runs it inside an actor.

One ``step()`` (its variant chosen when the engine is built: ``_step_sync``, or with
async_scheduling ``_step_async``):

    scheduler.schedule() ─plan─▶ executor.execute_model() ─result─▶ scheduler.update_from_output()
                                                                         │ EngineCoreOutput per request
                                                                         ▼
                                  OutputProcessor: detokenize, stop strings, group samples ─▶ RequestOutput
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from pagedserve import plugins
from pagedserve.cluster.engine.kv_sizing import log_kv_sizing
from pagedserve.cluster.engine.lora_adapters import LoRAAdapters
from pagedserve.cluster.engine.output_processor import Group, OutputProcessor
from pagedserve.cluster.engine.request_options import truncate_prompt
from pagedserve.cluster.engine.step_containment import StepFailedError, contain, subplan
from pagedserve.cluster.engine.step_timer import StepTimer
from pagedserve.cluster.engine.structured_output import StructuredOutputManager
from pagedserve.cluster.text.reasoning import ReasoningParser
from pagedserve.cluster.text.tokenizer_pool import load_tokenizer
from pagedserve.cluster.wire.failures import ExecutorDeadError
from pagedserve.cluster.wire.outputs import RequestOutput
from pagedserve.cluster.wire.request import EngineRequest
from pagedserve.config import EngineConfig
from pagedserve.platforms import decide_here
from pagedserve.scheduler import Scheduler
from pagedserve.scheduler.lora import LoRARequest
from pagedserve.scheduler.outputs import ModelRunnerOutput, ProbePlan
from pagedserve.scheduler.pooling_params import PoolingParams, check_dimensions, runner_mismatch
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.vocab_limits import check_vocab_limits
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.loading.model_fetch import local_model_path
from pagedserve.worker.loading.model_source import resolve_model

logger = logging.getLogger("pagedserve")


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
            path, dtype=self.config.dtype, max_model_len=self.config.max_model_len, device=self.config.device,
            quantization=self.config.quantization, runner=self.config.runner,
            pooler_config=self.config.pooler_config)
        self.model_config.verify_tensor_parallel(self.config.tensor_parallel_size)
        # "generate" or "pooling" (embeddings), resolved for this checkpoint; the workers get
        # it resolved, so every process reads the checkpoint the same way.
        self.runner = self.config.runner = self.model_config.runner
        if self.runner == "pooling":
            self.config.check_pooling()
            logger.info("Pooling runner (embeddings): %s", self.model_config.pooler.describe())
        self.max_model_len = self.model_config.max_model_len
        self.config.max_model_len = self.max_model_len
        # vLLM's naming: the id is --served-model-name, else --model as given; root is
        # --model as given (never the directory it resolved to, e.g. a cache entry).
        given = engine_config.model_root or engine_config.model
        self.model_root = os.fspath(given) if given is not None else resolved.served_model_name
        self.served_model_name = self.config.served_model_name or self.model_root
        # LoRA: the --lora-modules, checked now (before any worker starts), and each adapter
        # a request names, checked on its first use (lora_adapters.py).
        self.loras = LoRAAdapters(self.config, self.model_config, (self.served_model_name, self.model_root))
        # From this node's files (a repo id or URI tokenizer fetched here first, as the model's).
        self.tokenizer = load_tokenizer(local_model_path(self.config.tokenizer, download_dir=self.config.download_dir,
                                                         config_only=True) or path)
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        # --reasoning-parser on this tokenizer (ValueError: its tags are not tokens of it).
        self.reasoning = (ReasoningParser.for_tokenizer(self.config.reasoning_parser, self.tokenizer)
                          if self.config.reasoning_parser else None)
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                  self.eos_token_ids)

        self.executor = executor_class(self.config)
        self.num_gpu_blocks = self.executor.determine_num_available_blocks()
        self.executor.initialize_cache(self.num_gpu_blocks)
        cache_config = self.config.cache_config(self.num_gpu_blocks)
        # Sliding-window and full layers: a block table per group (scheduler/kv/hybrid.py),
        # the same groups the workers lay their KV tensors out by.
        cache_config.kv_groups = self.model_config.kv_cache_groups(cache_config.kv_allocation)
        self.scheduler = Scheduler(self.config.scheduler_config(self.max_model_len), cache_config)
        if self.scheduler.proposer is not None:  # a request that finds no draft lets steps pipeline
            self.scheduler.proposer.pause_when_idle = bool(self.config.async_scheduling)
        self.kv_sizing = log_kv_sizing(self.config, self.model_config, self.num_gpu_blocks, self.max_model_len)
        # Requests scheduled for the first time (or again after preemption), cumulative:
        # the serving layer's measure of how fast the waiting queue drains.
        self.num_admitted = 0
        # Each request's samples, detokenizers and outputs (output_processor.py).
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.scheduler, self.structured,
                                       self._fail_group)
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
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:  # "out of vocabulary": vLLM's words for it, which its clients match on
            raise ValueError(f"Token id {bad[0]!r} is out of vocabulary: prompt token ids must be integers in "
                             f"[0, {vocab}).")
        return ids

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, pooling: bool = False) -> None:
        """ValueError unless the prompt and max_tokens fit max_model_len (``pooling``: the
        prompt alone, which may fill it). Reads config only, so any thread may call it (the
        serving layer's tokenizer pool does)."""
        n = num_prompt_tokens
        if pooling:
            if n > self.max_model_len:
                raise ValueError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your input "
                    f"contains {n} tokens, which exceeds this limit (an embedding takes no output tokens). Please "
                    "reduce the length of the input, or ask for truncation with truncate_prompt_tokens.")
            return
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

    def matryoshka(self) -> tuple[bool, list[int] | None]:
        """(whether ``dimensions`` may be asked, the sizes allowed or None for any)."""
        from pagedserve.worker.pooler import matryoshka_dimensions

        return matryoshka_dimensions(self.model_config.hf_config)

    def check_pooling(self, pooling: PoolingParams) -> PoolingParams:
        """``pooling`` with the model's pooling type and normalize filled in; ValueError for
        ``dimensions`` the model does not support (vLLM's words)."""
        check_dimensions(pooling.dimensions, self.served_model_name, self.model_config.hidden_size,
                         *self.matryoshka())
        pooler = self.model_config.pooler
        return PoolingParams(dimensions=pooling.dimensions, pooling_type=pooling.pooling_type or pooler.pooling_type,
                             normalize=pooler.normalize if pooling.normalize is None else pooling.normalize)

    def make_request(self, req: EngineRequest) -> EngineRequest:
        """Every check a request can fail, once (cluster/wire/request.py): ValueError naming
        the problem. Fills in ``req``'s token ids (tokenizing a text prompt that is still
        text, offline), its vocabulary-limited params, the text the model sees and the
        compiled grammar; returns it. Reads configuration and the tokenizer only: any thread
        may call it (a replica's tokenizer pool encodes with its own tokenizer copy first)."""
        if (req.pooling is not None) != (self.runner == "pooling"):
            raise ValueError(runner_mismatch(self.served_model_name, req.pooling is not None,
                                             "Chat Completions" if req.messages is not None else "Completions"))
        params = req.params
        if req.pooling is not None:  # nothing is sampled or decoded: only the truncation counts
            params = SamplingParams(max_tokens=None, detokenize=False, truncation_side=params.truncation_side,
                                    truncate_prompt_tokens=params.truncate_prompt_tokens)
        params = check_vocab_limits(params, self.model_config.vocab_size, self.config.max_logprobs)
        prompt = req.prompt
        if req.messages is not None and req.prompt_token_ids is None:
            raise ValueError("a chat request must be rendered and tokenized before make_request.")
        prompt_ids = self.tokenize(prompt if req.prompt_token_ids is None else req.prompt_token_ids)
        if not prompt_ids:
            raise ValueError("the prompt is empty.")
        full_len = len(prompt_ids)
        prompt_ids = truncate_prompt(prompt_ids, params, self.max_model_len)
        self.check_length(len(prompt_ids), params.max_tokens, pooling=req.pooling is not None)
        if req.pooling is not None:
            req.pooling = self.check_pooling(req.pooling)
        else:
            req.grammar = self.check_params(params)
            if req.grammar is not None and req.reasoning and self.reasoning is not None \
                    and self.reasoning.starts_in_reasoning(prompt_ids, req.chat_template_kwargs):
                req.grammar_after_token = self.reasoning.end_token_id  # the thinking is free
        if req.lora_request is not None:
            self.loras.check(req.lora_request)
        if len(prompt_ids) < full_len:  # RequestOutput.prompt is what the model saw
            req.prompt_text = self.tokenizer.decode(prompt_ids)
        else:  # the text itself, where this call tokenized it
            req.prompt_text = prompt if isinstance(prompt, str) and req.prompt_token_ids is None else None
        req.params, req.prompt_token_ids = params, prompt_ids
        return req

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, tenant: str | None = None,
                    lora_request: LoRARequest | None = None, pooling: PoolingParams | None = None) -> None:
        """vLLM's offline entry: one EngineRequest, ``make_request`` then ``add_engine_request``.
        ``pooling``: an embedding request (the pooling runner); ``params`` then only truncate."""
        req = EngineRequest(request_id, prompt, params, priority, cache_salt, tenant=tenant,
                            arrival_time=arrival_time, lora_request=lora_request, pooling=pooling)
        self.add_engine_request(self.make_request(req))

    def add_engine_request(self, req: EngineRequest) -> None:
        """Trusts ``req`` (made by ``make_request``); only the engine's state can refuse it
        here: an id in use (ValueError) or no room in the scheduler (ValueError,
        QueueFullError), with nothing recorded."""
        request_id, params = req.request_id, req.params
        if request_id in self.outputs.groups:
            raise ValueError(f"request id {request_id!r} is already in use.")
        group, requests = self.outputs.make_group(req)
        if params.structured_outputs is not None:  # one matcher per sample, one grammar
            for sample in group.samples:
                self.structured.add_request(sample.req_id, params.structured_outputs, req.grammar,
                                            after_token=req.grammar_after_token)
        try:
            self.scheduler.add_request(requests[0])  # raises ValueError before anything is recorded
        except BaseException:
            for sample in group.samples:
                self.structured.remove(sample.req_id)
            raise
        self.outputs.add(group, requests[1:])

    def request_status(self, request_id: str) -> dict | None:
        """Where a live request stands (its first sample's scheduler request, which every
        sibling waits behind): running or waiting, and why (Scheduler.waiting_info)."""
        group = self.outputs.groups.get(request_id)
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
        group = self.outputs.groups.get(request_id)
        return None if group is None else self._fail_group(group, message)

    def _fail_group(self, group: Group, message: str) -> RequestOutput:
        """Its blocks are freed now, it leaves the batch before the next plan, and its
        final output carries ``error`` (finish_reason "error" on unfinished samples)."""
        logger.error("request %s failed on its own: %s", group.request_id, message)
        self.abort_request(group.request_id)
        return self.outputs.failed_output(group, message)

    def abort_all(self) -> None:
        self.abort_request(list(self.outputs.groups))

    def abort_request(self, request_ids: list[str] | str) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            group = self.outputs.drop(rid)
            if group is not None:
                self.scheduler.abort_requests([s.req_id for s in group.samples])

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.groups) or self.scheduler.has_unfinished_requests() or self._inflight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs.groups)

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
        return self.outputs.emit(*settled) + early

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
        if plan.scheduled_new_reqs:
            self.outputs.first_scheduled(plan)
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
        return self.outputs.emit(*self._settle(plan, result))

    def _settle(self, plan, result: ModelRunnerOutput) -> tuple[float, dict, list]:
        """The step's result into the scheduler (what the next plan needs); returns what
        ``OutputProcessor.emit`` turns into outputs."""
        now = time.time()
        self.num_admitted += len(plan.scheduled_new_reqs) + sum(
            plan.scheduled_cached_reqs.resumed_from_preemption)
        # Requests that failed on their own in the worker leave before the scheduler
        # sees the result, so their (empty) rows are skipped like aborted ones.
        self.outputs.add_prompt_logprobs(result)
        self.loras.observe(result.lora_resident, result.lora_load_s)
        failed: dict[str, RequestOutput] = {}
        for rid, message in (result.failed or {}).items():
            entry = self.outputs.samples.get(rid)
            if entry is not None:
                failed[entry[0].request_id] = self._fail_group(entry[0], message)
        return now, failed, list(self.scheduler.update_from_output(plan, result))

    def shutdown(self) -> None:
        self.executor.shutdown()
