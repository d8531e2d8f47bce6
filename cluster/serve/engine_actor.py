"""The scheduler actor: one per engine replica. It owns an LLMEngine (scheduler, global
block tables, batch membership; TP worker actors behind a RayExecutor when tp > 1) and
runs its step loop, streaming per-request deltas back to callers.

    caller (ingress) ──generate()──▶ admission ─▶ engine.add_request ─▶ per-request queue
                                                                            ▲
    step loop (asyncio task): engine.step() in one thread ─RequestOutputs──┘ ─▶ yielded

Every engine call (add_request, abort_request, step, get_stats) runs in ONE worker thread,
so the engine needs no locks and the event loop never blocks on a step. Calls submitted
while a step runs are applied in order right after it: an abort frees its blocks before
the next plan is made, i.e. within one step.

``generate`` is an async generator (a Serve streaming method). Its first item is an
``Admission``: accepted (with the replica id) or an error with an HTTP status (400 bad
request, 429 queue full). Then ``(RequestOutput, token_text)`` pairs follow, the last
one ``finished``; ``token_text`` maps the token ids of new logprobs to their text.
If the caller goes away (cancellation), the request is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pagedserve.cluster.serve.metrics import stats_snapshot
from pagedserve.cluster.engine.outputs import RequestOutput
from pagedserve.scheduler import QueueFullError
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.config import EngineConfig

logger = logging.getLogger("pagedserve")

# Seconds a client is told to wait after a 429.
RETRY_AFTER_S = 1
# Stats are pushed at most this often while busy, and at least this often when idle.
_STATS_MIN_INTERVAL_S = 0.1
_STATS_HEARTBEAT_S = 1.0


@dataclass(slots=True)
class Admission:
    accepted: bool
    replica_id: str
    status: int = 200
    message: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    retry_after_s: int | None = None


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The model's chat template, or a plain "role: content" transcript when the
    tokenizer has none (tiny test models ship without one)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant:" if add_generation_prompt else "")


class AsyncEngine:
    def __init__(self, engine_config: EngineConfig, stats_sink=None,
                 replica_id: str | None = None) -> None:
        from pagedserve.cluster.engine.llm_engine import LLMEngine

        self.config = engine_config
        executor_class = None
        if engine_config.tensor_parallel_size > 1:
            from pagedserve.cluster.control.ray_executor import RayExecutor

            executor_class = RayExecutor
        # The replica enforces max_waiting_requests itself (see _admit); the scheduler's
        # own bound counts a burst that arrived between two steps as waiting.
        self.engine = LLMEngine(dataclasses.replace(engine_config, max_waiting_requests=None),
                                executor_class=executor_class)
        self.replica_id = replica_id or f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.max_waiting = engine_config.max_waiting_requests
        # stats_sink(replica_id, snapshot) -> anything; e.g. a Serve handle's .remote.
        self._stats_sink = stats_sink
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._queues: dict[str, asyncio.Queue] = {}
        # Accepted requests that have produced nothing yet, with their prompt blocks:
        # the waiting queue as admission control sees it (exact, not one step stale).
        self._pending_blocks: dict[str, int] = {}
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._stats: dict = stats_snapshot(self.engine.get_stats())
        self._last_push = 0.0
        self._last_pushed: dict | None = None

    # ---------------------------------------------------------------- info
    def info(self) -> dict:
        e = self.engine
        return dict(served_model_name=e.served_model_name, max_model_len=e.max_model_len,
                    num_gpu_blocks=e.num_gpu_blocks, block_size=self.config.block_size,
                    tensor_parallel_size=self.config.tensor_parallel_size,
                    replica_id=self.replica_id, kv_sizing=getattr(e, "kv_sizing", None),
                    model=e.config.model)

    def stats(self) -> dict:
        return dict(self._stats)

    def _tokenize(self, prompt, messages, add_special_tokens, add_generation_prompt) -> list[int]:
        tok = self.engine.tokenizer
        if messages is not None:
            prompt = render_chat(tok, messages, add_generation_prompt)
            add_special_tokens = False  # the template already holds BOS etc.
        return tok.encode(prompt or "", add_special_tokens=add_special_tokens)

    def _detokenize(self, tokens: list[int]) -> str:
        vocab = self.engine.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in tokens):
            raise ValueError(f"token ids must be integers in [0, {vocab}).")
        return self.engine.tokenizer.decode(tokens)

    # The tokenizer is also used by the step (detokenization): all use goes through the
    # engine thread, so a Rust tokenizer is never entered from two threads at once.
    async def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None,
                       add_special_tokens: bool = True, add_generation_prompt: bool = True) -> list[int]:
        return await self._call(self._tokenize, prompt, messages, add_special_tokens,
                                add_generation_prompt)

    async def detokenize(self, tokens: list[int]) -> str:
        return await self._call(self._detokenize, tokens)

    # ---------------------------------------------------------------- loop
    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _step_once(self):
        """Runs in the engine thread: one step when there is work, then fresh stats.
        Each output is paired with the text of the token ids in its new logprobs (the
        tokenizer lives here; the ingress has none)."""
        outputs = None
        if self.engine.has_unfinished_requests():
            outputs = [(out, self._token_text(out)) for out in self.engine.step()]
        return outputs, stats_snapshot(self.engine.get_stats())

    def _token_text(self, out: RequestOutput) -> dict[int, str] | None:
        ids = {t for c in out.outputs for lp in (c.delta_logprobs or ()) for t in lp.token_ids}
        if not ids:
            return None
        decode = self.engine.tokenizer.decode
        return {t: decode([t]) for t in ids}

    async def _run(self) -> None:
        while True:
            # Cleared before the step, not after: a request added while the step runs
            # sets it again, and the idle wait below then returns at once.
            self._wakeup.clear()
            try:
                outputs, self._stats = await self._call(self._step_once)
            except Exception:
                # A system error must not leave callers hanging: fail every open request.
                logger.exception("engine step failed on replica %s", self.replica_id)
                for q in self._queues.values():
                    q.put_nowait(RuntimeError("engine step failed; see the server log"))
                await asyncio.sleep(0.1)
                continue
            for out, token_text in outputs or ():
                self._pending_blocks.pop(out.request_id, None)
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait((out, token_text))
            idle = outputs is None
            self._push_stats(force=idle)
            if idle:
                try:
                    await asyncio.wait_for(self._wakeup.wait(), _STATS_HEARTBEAT_S)
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)  # let add/abort calls and consumers run

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
        try:
            self._stats_sink(self.replica_id, self._last_pushed)
        except Exception:  # metrics must never take requests down
            logger.debug("stats push failed", exc_info=True)

    # ---------------------------------------------------------------- requests
    def _admit(self, num_prompt_tokens: int) -> Admission | None:
        """Engine thread, right before add_request. 429 when the waiting queue is full:

        - by count: the requests that would wait behind a full running batch, this one
          included, exceed ``max_waiting_requests`` (a burst that still fits the batch is
          not "waiting", even though it sits in the scheduler's queue until next step);
        - by projected KV demand: the prompts of the not-yet-started requests plus this
          one need more blocks than this replica's whole pool.
        """
        stats = self.engine.get_stats()
        if self.max_waiting is not None:
            would_wait = stats.running + stats.waiting + 1 - self.config.max_num_seqs
            if would_wait > self.max_waiting:
                return Admission(False, self.replica_id, 429,
                                 f"The server is overloaded: {stats.waiting} requests are waiting "
                                 f"(max_waiting_requests={self.max_waiting}). Retry later.",
                                 retry_after_s=RETRY_AFTER_S)
        demand = sum(list(self._pending_blocks.values())) + -(-num_prompt_tokens // self.config.block_size)
        if self._pending_blocks and demand > self.engine.num_gpu_blocks:
            return Admission(False, self.replica_id, 429,
                             f"The server is overloaded: waiting requests need {demand} KV blocks, "
                             f"more than the {self.engine.num_gpu_blocks} this replica holds. "
                             "Retry later.", retry_after_s=RETRY_AFTER_S)
        return None

    def _admit_and_add(self, request_id, prompt_ids, params, priority, cache_salt) -> Admission | None:
        rejected = self._admit(len(prompt_ids))
        if rejected is None:
            self.engine.add_request(request_id, prompt_ids, params, None, priority, cache_salt)
            self._pending_blocks[request_id] = -(-len(prompt_ids) // self.config.block_size)
        return rejected

    def _prepare(self, prompt, messages, add_generation_prompt) -> list[int]:
        """Engine thread: the tokenizer is shared with detokenization in the step."""
        if messages is not None:
            prompt = render_chat(self.engine.tokenizer, messages, add_generation_prompt)
        return self.engine.tokenize(prompt)

    async def generate(self, request_id: str, prompt: str | list[int] | None,
                       params: SamplingParams, priority: int = 0, cache_salt: str | None = None,
                       messages: list[dict] | None = None, add_generation_prompt: bool = True):
        self._ensure_loop()
        try:
            prompt_ids = await self._call(self._prepare, prompt, messages, add_generation_prompt)
        except ValueError as e:
            yield Admission(False, self.replica_id, 400, str(e))
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            try:
                rejected = await self._call(self._admit_and_add, request_id, prompt_ids, params,
                                            priority, cache_salt)
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
                                retry_after_s=RETRY_AFTER_S)
                return
            self._wakeup.set()
            yield Admission(True, self.replica_id, prompt_token_ids=prompt_ids)
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item[0].finished
                yield item  # (RequestOutput, {token id: text} | None)
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
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
        self._thread.submit(self.engine.shutdown).result(timeout=60)
        self._thread.shutdown(wait=False)
