"""The scheduler actor: one per engine replica. It owns an LLMEngine (scheduler, global
block tables, batch membership; TP worker actors behind a RayExecutor when tp > 1) and
runs its step loop, streaming per-request deltas back to callers.

    caller (ingress) ──generate()──▶ size check ─▶ tokenizer pool ─▶ admission ─▶ add_request
                                                                            ▼
    step loop (asyncio task): engine.step() in one thread ─RequestOutputs─┬▶ per-request queue
                                  with an output_route: one message per ingress per step ┘
                                  (cluster/wire/output_channel.py); the queue then gets the end only

Every engine call (add_request, abort_request, step, get_stats) runs in ONE worker thread,
so the engine needs no locks and the event loop never blocks on a step. Calls submitted
while a step runs are applied in order right after it: an abort frees its blocks before
the next plan is made, i.e. within one step. Tokenization runs in a pool of its own
(cluster/text/tokenizer_pool.py), so no prompt ever waits behind a step or delays one.

``generate`` is an async generator (a Serve streaming method). Its first item is an
``Admission``: accepted (with the replica id) or an error with an HTTP status (400 bad
request, 429 overloaded, 503 replica dead). Then ``(RequestOutput, token_text)`` pairs
follow, the last one ``finished``; ``token_text`` maps the token ids of new logprobs to
their text. If the caller goes away (cancellation), the request is aborted in the engine.

Failures, by whom they can be blamed on:

    one request (its sampling setup, sampler row,    RequestFailed to that caller only;
    detokenizer, stop strings: RequestOutput.error)  the batch goes on
    the step raised, workers alive                   re-run in parts (step_containment.py):
                                                     the requests at fault fail alone
    a worker is gone, a TP group out of step, or     every caller of this replica fails at
    no part and no probe escapes the failure         once; the replica is dead: check_health
                                                     raises (Serve replaces it), new
                                                     requests get 503, the loop stops

Health (Serve's check and ``GET /health`` both ask ``check_health``): the loop is
running, no step has hung, and every TP worker answers a ping. Status: where a request
stands (its queue status after its first step, ``request_info``) and the live view of
the pool that rides along with the stats push (/dashboard, live_view.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from pagedserve.cluster.engine.detokenizer import token_texts
from pagedserve.cluster.replica.admission import DrainMeter, admit, drain_seconds, retry_after
from pagedserve.cluster.text.chat_template import renders_tools
from pagedserve.cluster.replica.live_view import VIEW_INTERVAL_S, StepTimeline, replica_view
from pagedserve.cluster.text.tokenizer_info import tokenizer_info
from pagedserve.cluster.text.tokenizer_pool import TokenizerPool
from pagedserve.cluster.wire.failures import EngineDeadError, ExecutorDeadError, RequestFailed
from pagedserve.cluster.wire.kv_events import replica_stats
from pagedserve.cluster.wire.output_channel import DONE, OutputRouter
from pagedserve.cluster.wire.outputs import RequestOutput
from pagedserve.cluster.wire.request import EngineRequest
from pagedserve.cluster.wire.stats import stats_snapshot
from pagedserve.cluster.wire.stream import Admission, QueueStatus
from pagedserve.config import EngineConfig
from pagedserve.scheduler import QueueFullError
from pagedserve.scheduler.fair_queue import DEFAULT_TENANT

logger = logging.getLogger("pagedserve")

# Stats are pushed at most this often while busy (and at once when the engine goes idle
# with new figures), and at least this often when idle. Each push is a Serve call that the
# aggregator and the engine replica pay on the serving core (loadtest/serving/bench_frontend.py
# measures it). The live view is sent every live_view.VIEW_INTERVAL_S anyway; Prometheus
# scrapes in seconds.
_STATS_MIN_INTERVAL_S = 0.5
_STATS_HEARTBEAT_S = 1.0

# Weight of the newest step in the step-time average: ~5 steps of memory, so an estimate
# follows a load change within a second and one slow step does not swing it.
_STEP_EMA = 0.2

# A step running longer than this is hung (the longest legitimate step, a full
# max_num_batched_tokens prefill of a big model on CPU, takes seconds).
STEP_STALL_S = 120.0

WORKER_PING_TIMEOUT_S = 5.0


class AsyncEngine:
    def __init__(self, engine_config: EngineConfig, stats_sink=None,
                 replica_id: str | None = None, kv_events_host: str | None = None) -> None:
        from pagedserve.cluster.engine.llm_engine import LLMEngine
        from pagedserve.cluster.executors import executor_class_for

        self.config = engine_config
        # The executor follows engine_config.executor_backend() (cluster/executors/__init__.py).
        # The replica enforces max_waiting_requests itself (see admission.py); the
        # scheduler's own bound counts a burst that arrived between two steps as waiting.
        config = dataclasses.replace(engine_config, max_waiting_requests=None)
        self.engine = LLMEngine(config, executor_class_for(config))
        self.replica_id = replica_id or f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.max_waiting = engine_config.max_waiting_requests
        delay = engine_config.max_queue_delay_s
        self.max_queue_delay_s = delay if delay is not None and delay > 0 else None
        # stats_sink(replica_id, snapshot) -> anything; e.g. a Serve handle's .remote.
        self._stats_sink = stats_sink
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._tok = TokenizerPool(self.engine.tokenizer, self.engine.max_model_len)
        self._queues: dict[str, asyncio.Queue] = {}
        self._router = OutputRouter()  # requests whose outputs go on an ingress's channel
        # Accepted requests that have produced nothing yet, with their prompt blocks:
        # the waiting queue as admission control sees it (exact, not one step stale).
        self._pending_blocks: dict[str, int] = {}
        self._drain = DrainMeter()
        self._last_step_end = time.monotonic()
        self._step_started: float | None = None
        self._dead: str | None = None  # why this replica can no longer serve
        # Where the fronts watch this replica's process (cluster/wire/lifeline.py); set by
        # the Serve replica that owns the Lifeline, None in process.
        self.lifeline_address: str | None = None
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._stats: dict = stats_snapshot(self.engine.get_stats())
        self._last_push = 0.0
        self._last_pushed: dict | None = None
        # The prefix cache's changes for the fronts' routers (cluster/wire/kv_events.py),
        # where more than one replica can run: published from the engine thread each step.
        self._kv_pub = None
        pool = self.engine.scheduler.kv_cache_manager.block_pool
        if kv_events_host is not None and pool.enable_caching:
            from pagedserve.cluster.replica.step_rates import StepRates
            from pagedserve.cluster.wire.kv_events import KVEventPublisher
            from pagedserve.scheduler.kv.kv_events import KVEventLog

            pool.kv_events = KVEventLog()
            self._kv_pub = KVEventPublisher(kv_events_host)
            self._kv_rates = StepRates()  # the prefill rate and decode step time it publishes
        self.kv_events_address = self._kv_pub.address if self._kv_pub is not None else None
        self._init_status()

    # ---------------------------------------------------------------- info
    def info(self) -> dict:
        e = self.engine
        return dict(served_model_name=e.served_model_name, max_model_len=e.max_model_len,
                    num_gpu_blocks=e.num_gpu_blocks, block_size=self.config.block_size,
                    tensor_parallel_size=self.config.tensor_parallel_size,
                    replica_id=self.replica_id, kv_sizing=getattr(e, "kv_sizing", None), device=e.config.device,
                    dtype=str(e.model_config.dtype).removeprefix("torch."), quantization=e.model_config.quantization,
                    model=e.config.model, model_root=e.model_root, tokenizer=e.config.tokenizer or e.config.model,
                    revision=e.config.revision, download_dir=e.config.download_dir,
                    vocab_size=e.model_config.vocab_size, max_logprobs=e.config.max_logprobs,
                    chat_template_tools=renders_tools(e.tokenizer), eos_token_ids=list(e.eos_token_ids),
                    kv_events=self.kv_events_address, enable_lora=e.config.enable_lora,
                    lora_modules=e.loras.describe(),
                    dynamic_lora_loading_path=e.config.dynamic_lora_loading_path,
                    runner=e.runner, embedding_size=e.model_config.hidden_size, matryoshka=e.matryoshka(),
                    pooler=None if e.model_config.pooler is None else e.model_config.pooler.describe(),
                    reasoning_parser=e.reasoning.describe() if e.reasoning is not None else None)

    def stats(self) -> dict:
        return dict(self._stats, drain_rate=self._drain.rate, dead=self._dead)

    async def check_lora(self, lora_request) -> None:
        """ValueError naming why this engine cannot serve the adapter (POST
        /v1/load_lora_adapter asks before requests may name it); reads its files off the loop."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.loras.check, lora_request)
        except ValueError as e:  # a plain ValueError: the front need not import the worker's LoRAError
            raise ValueError(str(e)) from None

    async def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None,
                       add_special_tokens: bool | None = None, add_generation_prompt: bool | str = True,
                       tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
        if prompt is not None:
            self._tok.check_chars(prompt)
        return await self._tok.run(self._tok.tokenize, prompt, messages, add_special_tokens,
                                   add_generation_prompt, tools, chat_template_kwargs)

    async def token_strs(self, tokens: list[int]) -> list[str]:
        return await self._tok.run(self._tok.token_strs, tokens)

    def tokenizer_info(self) -> dict:
        return tokenizer_info(self.engine.tokenizer)

    async def detokenize(self, tokens: list[int], skip_special_tokens: bool = False) -> str:
        return await self._tok.run(self._tok.detokenize, tokens, self.engine.model_config.vocab_size,
                                   skip_special_tokens)

    # ---------------------------------------------------------------- loop
    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _ensure_loop(self) -> None:
        if self._dead is None and (self._loop_task is None or self._loop_task.done()):
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _step_once(self):
        """Runs in the engine thread: one step when there is work, then fresh stats.
        Each output is paired with the text of the token ids in its new logprobs (the
        engine thread holds the engine's tokenizer)."""
        engine = self.engine
        outputs = None
        statuses = None
        if engine.has_unfinished_requests():
            waiting_before = len(engine.scheduler.waiting)
            admitted_before = engine.num_admitted
            t0 = time.monotonic()
            outputs = [self._with_token_text(out) for out in engine.step()]
            now = time.monotonic()
            self._observe_step(now - t0)
            statuses = self._first_statuses()
            if waiting_before and len(engine.scheduler.waiting):
                # A queue before and after the step: its admissions were bound by capacity,
                # not by arrivals (a request that waited one step for a free slot would
                # count a full batch's step as the drain time of one: a rate too high, and
                # waits past the delay bound).
                self._drain.observe(now - self._last_step_end, engine.num_admitted - admitted_before)
            self._last_step_end = now
        else:
            self._last_step_end = time.monotonic()
        if self._kv_pub is not None:
            sched = engine.scheduler
            if outputs is not None:
                self._kv_rates.observe(engine.last_plan, sched, now - t0)
            self._kv_pub.pump(sched.kv_cache_manager.block_pool,
                              lambda: replica_stats(sched, self._kv_rates, engine.loras))
        return outputs, self._with_view(stats_snapshot(engine.get_stats())), statuses

    def _with_token_text(self, out: RequestOutput):
        if out.error is not None:
            return out, None
        try:
            return out, token_texts(out, self.engine.tokenizer)
        except Exception as e:  # this request's logprob texts: it fails alone
            failed = self.engine.fail_request(out.request_id, f"{type(e).__name__}: {e}")
            return (failed or dataclasses.replace(out, finished=True, error=str(e))), None

    async def _run(self) -> None:
        while self._dead is None:
            # Cleared before the step, not after: a request added while the step runs
            # sets it again, and the idle wait below then returns at once.
            self._wakeup.clear()
            self._step_started = time.monotonic()
            try:
                outputs, self._stats, statuses = await self._call(self._step_once)
            except Exception as e:
                # Not attributable to one request: no later step can be trusted either.
                logger.exception("engine step failed on replica %s", self.replica_id)
                self._die(f"engine step failed: {type(e).__name__}: {e}")
                return
            finally:
                self._step_started = None
            for rid, st in (statuses or {}).items():
                q = self._queues.get(rid)
                if q is not None:
                    q.put_nowait(QueueStatus(st))
            if outputs:
                self._dispatch(outputs)
            idle = outputs is None
            self._push_stats(force=idle)
            if idle:
                try:
                    await asyncio.wait_for(self._wakeup.wait(), _STATS_HEARTBEAT_S)
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)  # let add/abort calls and consumers run

    def _dispatch(self, outputs) -> None:
        """A step's outputs: one channel message per ingress for the whole step; a request's
        failure goes into its queue instead (its Ray stream raises it)."""
        rest = []
        for out, token_text in outputs:
            self._pending_blocks.pop(out.request_id, None)
            q = self._queues.get(out.request_id)
            if q is None:
                continue
            if out.error is not None:
                q.put_nowait(RequestFailed(f"request {out.request_id} failed: {out.error}"))
            else:
                rest.append((out, token_text))
        lost = self._router.send(rest, self._queues)
        if lost:  # their ingress stopped reading: they fail here, and free their blocks
            self._thread.submit(self.engine.abort_request, lost)
            for rid in lost:
                self._queues[rid].put_nowait(RequestFailed(
                    f"request {rid} failed: its ingress stopped reading outputs"))

    def _push_stats(self, force: bool) -> None:
        now = time.monotonic()
        if self._stats_sink is None:
            return
        if not force and now - self._last_push < _STATS_MIN_INTERVAL_S:
            return
        if force and now - self._last_push < _STATS_MIN_INTERVAL_S and self._stats == self._last_pushed:
            return  # idle and unchanged: the next heartbeat will do
        self._last_push = now
        self._last_pushed = dict(self._stats)
        if "view" in self._last_pushed:  # the next view is due VIEW_INTERVAL_S after this one went
            self._last_view = now
        try:
            self._stats_sink(self.replica_id, self._last_pushed)
        except Exception:  # metrics must never take requests down
            logger.debug("stats push failed", exc_info=True)

    # ---------------------------------------------------------------- requests
    def _admit_and_add(self, req: EngineRequest) -> Admission | None:
        """Engine thread, so the counts admission sees are exact (admission.py)."""
        num_prompt_tokens = len(req.prompt_token_ids)
        rejected = admit(
            self.engine.get_stats(), replica_id=self.replica_id, max_num_seqs=self.config.max_num_seqs,
            num_blocks=self.engine.num_gpu_blocks, block_size=self.config.block_size,
            pending_blocks=self._pending_blocks.copy(), num_prompt_tokens=num_prompt_tokens,
            rate=self._drain.rate, max_waiting=self.max_waiting,
            max_queue_delay_s=self.max_queue_delay_s, tenant=req.tenant or DEFAULT_TENANT,
            weights=self.config.tenant_weights)
        if rejected is None:
            self.engine.add_engine_request(req)
            self._new_ids.append(req.request_id)
            self._pending_blocks[req.request_id] = -(-num_prompt_tokens // self.config.block_size)
        return rejected

    def _make_request(self, req: EngineRequest) -> EngineRequest:
        """Tokenizer pool thread: text -> ids (a chat's through its template), then the one
        validation of the request (LLMEngine.make_request); the engine thread trusts it."""
        if req.needs_encoding:
            req.prompt_token_ids = self._tok.encode_prompt(req.prompt, req.messages, req.add_generation_prompt,
                                                           req.tools, req.chat_template_kwargs)
        return self.engine.make_request(req)

    async def _prepare(self, req: EngineRequest) -> EngineRequest:
        # O(1) checks first, on the event loop: a 20 MB prompt costs nothing more.
        # (Not with truncate_prompt_tokens: then a prompt of any length is fine; the
        # body limit still bounds what the pool tokenizes.)
        prompt, params = req.prompt, req.params
        if isinstance(prompt, str) and req.messages is None and params.truncate_prompt_tokens is None:
            self._tok.check_chars(prompt)
        elif (isinstance(prompt, list) and len(prompt) >= self.engine.max_model_len
              and params.truncate_prompt_tokens is None):
            self.engine.check_length(len(prompt), params.max_tokens, pooling=req.pooling is not None)
        return await self._tok.run(self._make_request, req)

    async def generate(self, req: EngineRequest, *, output_route: tuple[str, bytes]):
        """The request's lifeline: its Admission, then nothing until it ends after the final
        output (or raises the request's failure). The outputs go out on ``output_route`` (an
        ingress's OutputChannel.route: cluster/wire/output_channel.py), one message per step."""
        entered, request_id = time.monotonic(), req.request_id
        if self._dead is not None:
            yield Admission(False, self.replica_id, 503,
                            f"This engine replica is unavailable ({self._dead}); retry shortly.",
                            retry_after_s=1)
            return
        self._ensure_loop()
        try:
            req = await self._prepare(req)
        except ValueError as e:
            yield Admission(False, self.replica_id, 400, str(e))
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._router.add(request_id, output_route)  # before the add: its first step may come at once
        finished = False
        try:
            try:
                rejected = await self._call(self._admit_and_add, req)
                if rejected is not None:
                    finished = True
                    yield rejected
                    return
            except ValueError as e:
                finished = True
                yield Admission(False, self.replica_id, 400, str(e))
                return
            except QueueFullError as e:
                finished = True
                yield Admission(False, self.replica_id, 429, f"The server is overloaded: {e}",
                                retry_after_s=retry_after(1, self._drain.rate),
                                shed_s=drain_seconds(1, self._drain.rate))
                return
            self._wakeup.set()
            # Accepted: the admission goes out after the first step that saw the request,
            # with its queue status (at most one step later; its first token cannot come
            # sooner anyway), so the ingress can put why-waiting in the response header.
            item = await queue.get()
            status = item.status if isinstance(item, QueueStatus) else None
            yield Admission(True, self.replica_id, prompt_token_ids=req.prompt_token_ids, queue=status,
                            replica_s=time.monotonic() - entered, lifeline=self.lifeline_address)
            if isinstance(item, QueueStatus):
                item = await queue.get()
            while True:  # the outputs go on the channel; wait for the end
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if item is DONE:
                    finished = True
                    return
                item = await queue.get()
        finally:
            self._queues.pop(request_id, None)
            self._router.remove(request_id)
            self._pending_blocks.pop(request_id, None)
            if not finished:
                # Cancelled or closed early: abort without awaiting (we may be inside a
                # cancellation); the engine thread applies it before the next step.
                logger.info("aborting request %s (caller went away)", request_id)
                self._thread.submit(self.engine.abort_request, [request_id])
                if self._wakeup is not None:
                    self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        await self._call(self.engine.abort_request, [request_id])

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self._kv_pub is not None:
            self._thread.submit(self._kv_pub.close)  # the engine thread owns the socket
        self._tok.shutdown()
        self._router.close()
        if self._dead is not None:
            # The engine thread may be stuck in the step that killed us: do not queue
            # behind it, and do not wait for workers that cannot answer.
            self.engine.executor.abandon()
        else:
            self._thread.submit(self.engine.shutdown).result(timeout=60)
        self._thread.shutdown(wait=False)

    def _init_status(self) -> None:
        self._new_ids: list[str] = []  # added since the last step
        self._step_time_s: float | None = None
        self._timeline = StepTimeline()
        self._last_view = 0.0

    def _observe_step(self, dt: float) -> None:
        self._step_time_s = dt if self._step_time_s is None else (
            (1 - _STEP_EMA) * self._step_time_s + _STEP_EMA * dt)
        self._timeline.record(self.engine.last_plan, self.engine.scheduler)

    def _first_statuses(self) -> dict[str, dict | None]:
        """Right after a step: the status of the requests added before it (waiting, and
        why; or already running)."""
        ids, self._new_ids = self._new_ids, []
        return {rid: self._status(rid) for rid in ids}

    def _status(self, request_id: str) -> dict | None:
        st = self.engine.request_status(request_id)
        if st is not None:
            st["replica_id"] = self.replica_id
            steps = st.get("est_start_steps")
            if steps is not None and self._step_time_s is not None:
                st["est_start_s"] = round(steps * self._step_time_s, 3)
        return st

    def _with_view(self, snap: dict) -> dict:
        # Built on every step once due, until a push carries it (pushes are rate-limited,
        # so a view on a step whose stats were not sent would be lost; _push_stats resets).
        if self._stats_sink is not None and time.monotonic() - self._last_view >= VIEW_INTERVAL_S:
            snap["view"] = replica_view(self.engine, self._timeline, self._step_time_s)
        return snap

    async def request_info(self, request_id: str) -> dict | None:
        """None unless this replica holds the request."""
        return await self._call(self._status, request_id)

    async def check_health(self) -> None:
        """Raises unless the loop is alive, no step is hung and every worker answers."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._loop_task is not None and self._loop_task.done():
            self._die("the engine loop exited")
            raise EngineDeadError(self._dead)
        started = self._step_started
        if started is not None and time.monotonic() - started > STEP_STALL_S:
            self._die(f"an engine step has been running for {time.monotonic() - started:.0f} s")
            raise EngineDeadError(self._dead)
        try:
            await asyncio.wait_for(asyncio.to_thread(self.engine.executor.check_health,
                                                     WORKER_PING_TIMEOUT_S), WORKER_PING_TIMEOUT_S + 1)
        except ExecutorDeadError as e:  # a worker is gone for good: nothing can step
            self._die(str(e))
            raise EngineDeadError(self._dead) from None

    def _die(self, reason: str) -> None:
        """Fail every open request of this replica at once and stop stepping."""
        if self._dead is not None:
            return
        self._dead = reason
        logger.error("engine replica %s is dead: %s; failing %d open requests", self.replica_id,
                     reason, len(self._queues))
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(f"the engine replica failed: {reason}"))
        if self._wakeup is not None:
            self._wakeup.set()
        # Free every block, so the gauges tell the truth (nothing stays "running"). This
        # waits behind the step only if the step itself is what hangs.
        done = asyncio.wrap_future(self._thread.submit(self._abort_all))
        asyncio.get_running_loop().create_task(self._push_when_done(done))

    def _abort_all(self) -> None:
        self.engine.abort_all()
        self._pending_blocks.clear()
        self._stats = stats_snapshot(self.engine.get_stats())

    async def _push_when_done(self, done) -> None:
        try:
            await asyncio.wait_for(done, 30)
        except Exception:
            return
        self._last_push = 0.0  # the loop has stopped: this is the last snapshot it sends
        self._push_stats(force=True)
