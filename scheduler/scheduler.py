"""The continuous-batching scheduler: who runs this step, with how many tokens, where.

One progress model (vLLM V1): every request's ``num_computed_tokens`` catches up with
its ``num_tokens`` under a per-step token budget. Prefill, chunked prefill, decode,
prefix hits and recompute after preemption are all that one rule:

    step k:  running first (admission order)        then waiting (FCFS / priority)
             r1 decode 1 | r2 decode 1 | r3 chunk 510 | r4 prefill 12 (prefix hit 32)
             └──────────── <= max_num_batched_tokens, <= max_num_seqs ───────────┘

``schedule()`` advances each scheduled request's ``num_computed_tokens`` right away,
so ``update_from_output()`` (step_results.py) only appends sampled tokens, checks stop
conditions, retires finished requests and caches newly full blocks. A step that will
sample a request's next token counts it as a placeholder until the token comes back, so
the next plan can be made before this step's result (async scheduling): the decode of the
token in flight is planned already, and the worker, which sampled it, feeds it in.

Speculative decoding (``speculative_config``): a decoding request with no token in flight
may get 1 + k tokens, its last token and k drafts (ngram_proposer.py), checked in one pass:

    plan:    c = N-1 ──▶ schedule [t_N, d1 .. dk]       c := N + k   (slots for all of them)
    result:  a drafts accepted + 1 token of its own      c := N + a   (the k - a rejected roll back)

The blocks taken for the drafts stay with the request (its next tokens go there); a block
is offered to the prefix cache only once verified tokens fill it, and the K/V a rejected
draft wrote is overwritten by the token that takes its slot.

The Scheduler holds its parts and hands each what it reads: the KV cache manager
(kv/kv_cache_manager.py), the waiting queue (request_queue.py, fair_queue.py), the tenant
policy (tenant_policy.py: reservations, victims, slot shares, why-waiting answers) and the
draft proposer (ngram_proposer.py). update_from_output hands the Scheduler itself to
step_results.py: a step's result touches most of its state.
"""

from __future__ import annotations

from pagedserve.scheduler.config import CacheConfig, SchedulerConfig
from pagedserve.scheduler.fair_queue import DEFAULT_TENANT, FairRequestQueue
from pagedserve.scheduler.kv.kv_cache_manager import make_kv_cache_manager
from pagedserve.scheduler.ngram_proposer import NgramProposer
from pagedserve.scheduler.outputs import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput, NewRequestData,
                                          SchedulerOutput)
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.request_queue import FCFSRequestQueue, PriorityRequestQueue
from pagedserve.scheduler.stats import WAITING_REASONS, SchedulerStats
from pagedserve.scheduler.step_results import update_from_output
from pagedserve.scheduler.tenancy import Ledger, classes_of
from pagedserve.scheduler.tenant_policy import TenantPolicy

_RUNNING = RequestStatus.RUNNING


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting_requests`` (the HTTP layer answers 429)."""


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.policy = scheduler_config.scheduling_policy
        self.max_loras = scheduler_config.max_loras  # None: LoRA off (scheduler/lora.py)
        self.block_size = cache_config.block_size
        self.kv_cache_manager = make_kv_cache_manager(cache_config, self.max_model_len)
        # No sequence may outgrow the whole pool: alone it could never get its next
        # block and would preempt itself forever. Such a request ends with "length".
        self.max_seq_len = min(self.max_model_len,
                               self.kv_cache_manager.max_tokens_per_request(self.max_num_batched_tokens))
        self.requests: dict[str, Request] = {}  # every unfinished request
        sub_queue = PriorityRequestQueue if self.policy == "priority" else FCFSRequestQueue
        # Tenants share by the Virtual Token Counter (fair_queue.py); "static" stays the
        # plain FCFS baseline. With one tenant the fair queue is exactly its sub-queue.
        self.waiting = sub_queue() if self.policy == "static" else FairRequestQueue(
            sub_queue, scheduler_config.tenant_weights)
        # Who goes next and who gives way across tenants, classes and reservations.
        self.tenant_policy = TenantPolicy(scheduler_config, cache_config, self.waiting, self.kv_cache_manager)
        self.running: list[Request] = []  # in admission order
        self.finished_req_ids: list[str] = []  # ended since the previous plan
        self.static_batch: set[str] = set()  # policy "static": members of the batch in flight
        self.step_id = 0
        self._waiting_reason: str | None = None
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        spec = scheduler_config.speculative_config
        self.proposer = NgramProposer(spec) if spec is not None else None

    # ---- requests in and out -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid, n = request.req_id, request.num_prompt_tokens
        if rid in self.requests:
            raise ValueError(f"request {rid!r} already exists.")
        # A pooling request ends with its prompt: it may fill max_model_len, and its one
        # "output" (the pooled vector) takes no slot.
        pooling = request.pooling_params is not None
        if n >= self.max_model_len + pooling:
            raise ValueError(
                f"request {rid!r}: the prompt has {n} tokens, but max_model_len is {self.max_model_len} "
                f"and at least one token must be left for the output (prompt <= {self.max_model_len - 1}).")
        if n >= self.max_seq_len + pooling:
            num_blocks = self.cache_config.num_blocks
            raise ValueError(
                f"request {rid!r}: the prompt has {n} tokens and with {'no' if pooling else 'one'} output token "
                f"needs {-(-(n + 1 - pooling) // self.block_size)} KV cache blocks, but the whole pool holds "
                f"{num_blocks} blocks of {self.block_size} tokens ({num_blocks * self.block_size} tokens).")
        limit = self.scheduler_config.max_waiting_requests
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later.")
        room = self.max_seq_len - n
        user_max = request.sampling_params.max_tokens
        # A pooling request's one step that "samples" is the one that pools: max_tokens 1
        # keeps a plan made while it is in flight from scheduling anything after it.
        request.max_tokens = 1 if pooling else room if user_max is None else min(user_max, room)
        self.tenant_policy.check_fits_outside_reservations(request)
        request.status = RequestStatus.WAITING
        if self.scheduler_config.isolate_tenant_prefix_cache and request.tenant != DEFAULT_TENANT:
            request.cache_tenant = request.tenant
        self.requests[rid] = request
        self.waiting.add_request(request)

    def abort_requests(self, req_ids: str | list[str]) -> None:
        """Abort in any state; unknown or finished ids are a no-op."""
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: str | list[str], finished_status: RequestStatus,
                        stop_reason: int | str | None = None) -> None:
        """End requests from outside (abort, or a stop string the engine found)."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status!r} is not a finished status.")
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == _RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove_request(req)
            req.status = finished_status
            if stop_reason is not None:
                req.stop_reason = stop_reason
            self._free_request(req)

    def _free_request(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        if self.proposer is not None:
            self.proposer.free(req.req_id)
        del self.requests[req.req_id]
        self.finished_req_ids.append(req.req_id)
        self.static_batch.discard(req.req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    # ---- the step plan ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        blocks_of = kv.req_to_logical_blocks
        bs = self.block_size
        budget = self.max_num_batched_tokens
        running = self.running
        tenant_policy = self.tenant_policy
        drafts = self._propose_drafts() if self.drafting() else None
        # Scheduled running requests as parallel lists (cheaper than dicts per step).
        sched_reqs: list[Request] = []
        sched_nums: list[int] = []
        sched_new_block_ids: list[list[int]] = []  # blocks added this step
        spec_tokens: dict[str, list[int]] = {}  # req_id -> its draft tokens this step
        preempted: list[Request] = []
        ledger = tenant_policy.ledger(running)
        # 0. Room for reserved classes' waiting heads, then for a tenant under its slot share.
        preempted_for_reserved = tenant_policy.make_room(running, self.step_id, ledger, self._preempt)
        # While a reserved class has a request waiting, others' running requests do not
        # grow into its unused reservation (when it has none waiting they may).
        hold_keys = [k for k in ledger.reserved_keys_waiting()
                     if tenant_policy.reserved_head(ledger, k)] if ledger else []

        # 1. Running requests, in admission order, each as far as the budget allows.
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_computed = req.num_computed_tokens
            pending = req.num_output_placeholders
            num_new = len(req.all_token_ids) + pending - num_computed
            if num_new <= 0 or (pending and req.num_output_tokens + pending >= req.max_tokens):
                i += 1  # nothing to compute, or its in-flight token is its last (max_tokens)
                continue
            if num_new > budget:
                num_new = budget
            draft = drafts.get(req.req_id) if drafts and num_new == 1 else None
            if draft:
                del draft[budget - 1:]  # the drafts come out of the same budget
                num_new += len(draft)
            # Hot path, same rule as allocate_slots: the new tokens fit the last block.
            if (num_computed + num_new + bs - 1) // bs <= len(blocks_of[req.req_id]):
                new_block_ids = []
            else:
                hold = sum(ledger.unused(k).blocks for k in hold_keys if k not in classes_of(req)) \
                    if hold_keys else 0
                new_blocks = kv.allocate_slots(req, num_new, reserve_blocks=hold)
                if new_blocks is None and draft:  # no room for the drafts: never preempt for them
                    draft, num_new = None, 1
                    new_blocks = kv.allocate_slots(req, num_new, reserve_blocks=hold)
                while new_blocks is None:
                    victim_index = tenant_policy.pick_victim(running, self.step_id, ledger)
                    victim = running[victim_index]
                    if victim in sched_reqs:  # already scheduled this step: take it back
                        j = sched_reqs.index(victim)
                        budget += sched_nums[j]
                        del sched_reqs[j], sched_nums[j], sched_new_block_ids[j]
                        spec_tokens.pop(victim.req_id, None)
                    if victim_index < i:
                        i -= 1
                    self._preempt(victim_index, ledger)
                    preempted.append(victim)
                    if victim is req:
                        break
                    new_blocks = kv.allocate_slots(req, num_new, reserve_blocks=hold)
                if new_blocks is None:  # ``req`` preempted itself: nothing more fits
                    break
                new_block_ids = [b.block_id for b in new_blocks]
                if ledger is not None:
                    ledger.add(req, len(new_blocks), seqs=0)
            sched_reqs.append(req)
            sched_nums.append(num_new)
            sched_new_block_ids.append(new_block_ids)
            if draft:
                spec_tokens[req.req_id] = draft
            budget -= num_new
            i += 1

        # 2. Waiting requests (head of line), unless this step had to preempt.
        new_reqs: list[NewRequestData] = []
        resumed: list[Request] = []
        if preempted:
            reason = "no_blocks"
        else:
            reason = self._admit(sched_reqs, sched_nums, new_reqs, resumed, budget, ledger)
        self._waiting_reason = reason if len(self.waiting) else None
        preempted = preempted_for_reserved + preempted
        tenant_policy.note_admitted(len(new_reqs) + len(resumed))

        # 3. The plan (num_computed_tokens as before this step), then advance the counts.
        num_running = len(sched_new_block_ids)
        running_reqs = sched_reqs[:num_running]
        cached = CachedRequestData(
            req_ids=[r.req_id for r in running_reqs],
            resumed_from_preemption=[False] * num_running,
            new_block_ids=sched_new_block_ids,
            num_computed_tokens=[r.num_computed_tokens for r in running_reqs])
        block_ids_of = kv.req_to_block_ids
        for req in resumed:  # its whole new table: the worker dropped the old one
            cached.req_ids.append(req.req_id)
            cached.resumed_from_preemption.append(True)
            cached.new_block_ids.append(list(block_ids_of[req.req_id]))
            cached.num_computed_tokens.append(req.num_computed_tokens)
        tenant_policy.charge(sched_reqs, sched_nums)
        for req, n in zip(sched_reqs, sched_nums):
            req.num_computed_tokens += n
            if req.num_computed_tokens >= len(req.all_token_ids) + req.num_output_placeholders:
                req.num_output_placeholders += 1  # this step samples its next token
        self.step_id += 1
        plan = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(zip([r.req_id for r in sched_reqs], sched_nums)),
            total_num_scheduled_tokens=sum(sched_nums),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=[r.req_id for r in preempted],
            step_id=self.step_id,
            scheduled_spec_decode_tokens=spec_tokens,
        )
        self.finished_req_ids = []
        return plan

    def _propose_drafts(self) -> dict[str, list[int]]:
        """This step's drafts, req_id -> tokens, for the decoding requests that draft:
        each no longer than its max_tokens (the step yields drafts + 1 tokens) or its
        longest sequence allow, ending before a token that would stop the request, and cut
        to what pays over the step (ngram_proposer.py).
        None for a request with a token in flight (its drafts would follow a token not
        known yet), a constrained one (its grammar masks each token before it is drawn),
        or one that paused drafting."""
        proposer, step_id = self.proposer, self.step_id
        drafts: dict[str, list[int]] = {}
        num_decoding = 0
        for req in self.running:
            tokens = req.all_token_ids
            if req.num_output_placeholders or req.num_computed_tokens != len(tokens) - 1:
                continue
            num_decoding += 1
            max_k = min(proposer.k, req.max_tokens - req.num_output_tokens - 1, self.max_seq_len - len(tokens))
            if (max_k <= 0 or req.sampling_params.structured_outputs is not None
                    or not proposer.active(req.req_id, step_id)):
                continue
            draft = proposer.propose(req.req_id, tokens, max_k, step_id)
            # A token that would end the request ends its draft before it: no row past it
            # is ever used, and the last row samples that token anyway if the model agrees.
            # (Before min_tokens such a token does not end it; the cut only shortens the draft.)
            for j, t in enumerate(draft):
                if req.stops_on(t):
                    del draft[j:]
                    break
            if draft:
                drafts[req.req_id] = draft
        if drafts:
            proposer.select(drafts, num_decoding, step_id)
        drafts = {r: d for r, d in drafts.items() if d}
        if proposer.pause_when_idle:
            proposer.gate.note_step(step_id, num_decoding, sum(map(len, drafts.values())))
        return drafts

    def record_step_time(self, num_tokens: int, seconds: float) -> None:
        """How long a step of ``num_tokens`` took (the engine times the steps it waits
        for): the cost model that decides how many drafts pay (ngram_proposer.py)."""
        if self.proposer is not None and num_tokens:
            self.proposer.cost.record(num_tokens, seconds)

    def record_host_time(self, seconds: float) -> None:
        """How long the worker sat idle between two steps taken in turn (the engine
        measures it): what stepping in turn to draft costs where it could plan ahead."""
        if self.proposer is not None:
            self.proposer.gate.record_host_time(seconds)

    def drafting(self) -> bool:
        """Whether the next plan may hold drafts: speculation is on, fewer requests run
        than its ``disable_by_batch_size``, some of them has not paused drafting and, where
        the engine could plan ahead, drafting has been paying for the steps it takes in turn
        (ngram_proposer.DraftingGate). Such a plan needs the previous step's tokens, so the
        engine does not plan a step ahead of the one running while this holds."""
        proposer = self.proposer
        if proposer is None:
            return False
        limit = proposer.config.disable_by_batch_size
        if limit is not None and len(self.running) >= limit:
            return False
        step_id = self.step_id
        if proposer.pause_when_idle and not proposer.gate.open(step_id):
            return False
        return any(proposer.active(r.req_id, step_id) for r in self.running)

    def _admit(self, sched_reqs: list[Request], sched_nums: list[int], new_reqs: list[NewRequestData],
               resumed: list[Request], budget: int, ledger: Ledger | None = None) -> str | None:
        """Admit waiting requests while they fit (appending them to ``sched_reqs`` /
        ``sched_nums``); return why admission stopped, None if the queue emptied."""
        kv = self.kv_cache_manager
        running = self.running
        waiting = self.waiting
        tenant_policy = self.tenant_policy
        static = self.policy == "static"
        batch_open = not self.static_batch  # static: a batch forms only when idle
        adapters: set[int] | None = None  # LoRA adapters running, made on first need
        while len(waiting):
            if budget <= 0:
                return "no_budget"
            if len(running) >= self.max_num_seqs:
                return "max_seqs"
            req, key = tenant_policy.next_candidate(ledger)
            held = ledger.held_for_others(req) if ledger is not None else None
            if held is not None and len(running) + held.seqs >= self.max_num_seqs:
                return "reserved"
            is_resumed = req.status == RequestStatus.PREEMPTED
            if is_resumed and req.preempted_step == self.step_id:
                # Preempted by this very plan (to make room for a reservation or a tenant's
                # slot share): re-admitting it would take back the room just made, and one
                # plan cannot both preempt and schedule a request.
                return "tenant_share" if req is tenant_policy.share_victim else "reserved"
            if static and not batch_open and req.req_id not in self.static_batch:
                return "static_batch"
            lora = req.lora_request
            if lora is not None and self.max_loras is not None:
                # At most max_loras distinct adapters run, so every step's fit the worker's
                # slots. One that has none waits at the head of the line (FIFO): letting
                # others pass could keep the running adapters' slots busy forever.
                if adapters is None:
                    adapters = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
                if lora.lora_int_id not in adapters and len(adapters) >= self.max_loras:
                    return "lora_slots"
            hit_blocks, num_hit = kv.get_computed_blocks(req)
            num_new = len(req.all_token_ids) - num_hit
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    return "no_budget"
                num_new = budget
            # The watermark protects running requests; with none running there is no
            # one to protect, and skipping it keeps a pool-sized request admissible.
            if kv.allocate_slots(req, num_new, hit_blocks, num_hit, check_watermark=bool(running)) is None:
                return "no_blocks"
            # It must leave others' reserved blocks free, unless nothing else runs: then no
            # block would come free by waiting (a request resumed after a preemption may now
            # be longer than the room outside them), and a reserved class that arrives takes
            # its blocks back by preemption.
            if held is not None and held.blocks and kv.num_free_blocks < held.blocks and running:
                kv.free(req)  # it fit only into others' reserved blocks: undo, exactly
                return "reserved"
            if ledger is not None:
                ledger.add(req, len(kv.req_to_blocks[req.req_id]))
            if key is None:
                waiting.pop_request()
            elif key.startswith("priority:"):
                waiting.remove_request(req)
            else:
                waiting.pop_tenant(key)
            if req.num_preemptions == 0:  # recompute after preemption is not a hit
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_hit
                req.num_cached_tokens = num_hit
            req.status = _RUNNING
            req.num_computed_tokens = num_hit
            running.append(req)
            if adapters is not None and lora is not None:
                adapters.add(lora.lora_int_id)
            if static:
                self.static_batch.add(req.req_id)
            sched_reqs.append(req)
            sched_nums.append(num_new)
            budget -= num_new
            if is_resumed:
                req.resumed_step = self.step_id
                resumed.append(req)
            else:
                new_reqs.append(NewRequestData(
                    req_id=req.req_id, prompt_token_ids=list(req.prompt_token_ids),
                    sampling_params=req.sampling_params,
                    block_ids=list(kv.req_to_block_ids[req.req_id]), num_computed_tokens=num_hit,
                    lora_request=req.lora_request, pooling_params=req.pooling_params))
        return None

    def _preempt(self, index: int, ledger: Ledger | None = None) -> None:
        """Preempt by recompute: free the blocks, restart from token 0 (maybe a prefix
        hit), back to the front of the waiting queue."""
        req = self.running.pop(index)
        if ledger is not None:
            ledger.add(req, -len(self.kv_cache_manager.req_to_blocks.get(req.req_id, ())), seqs=-1)
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # a token still in flight is taken as it comes back
        req.num_preemptions += 1
        req.preempted_step = self.step_id
        self.num_preemptions += 1
        self.waiting.prepend_request(req)

    # ---- the step result --------------------------------------------------------------
    def update_from_output(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, stop finished requests (their blocks go back at once),
        cache newly full blocks (step_results.py). Rows of requests that ended meanwhile
        are ignored."""
        return update_from_output(self, plan, result)

    # ---- stats ------------------------------------------------------------------------
    def waiting_info(self, req_id: str) -> dict | None:
        """Why ``req_id`` waits, as of the last schedule(), and when it should start:
        ``{"reason", "position", "est_start_steps"}`` (tenancy.WHY_REASONS), or None if it
        is not waiting. The head of the line carries the reason admission stopped; a
        request behind another of its tenant waits for "queue_order"; the head of a tenant
        that already got more than its share waits for "tenant_share"."""
        req = self.requests.get(req_id)
        if req is None or req.status is _RUNNING or RequestStatus.is_finished(req.status):
            return None
        return self.tenant_policy.waiting_info(req, self._waiting_reason)

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        by_reason = dict.fromkeys(WAITING_REASONS, 0)
        if self._waiting_reason is not None:
            by_reason[self._waiting_reason] = len(self.waiting)
        tenants, demand = self.tenant_policy.stats(self.running)
        spec = {}
        if (p := self.proposer) is not None:
            spec = dict(spec_num_drafts=p.num_drafts, spec_num_draft_tokens=p.num_draft_tokens,
                        spec_num_accepted_tokens=p.num_accepted_tokens,
                        spec_num_accepted_tokens_per_pos=list(p.num_accepted_tokens_per_pos),
                        spec_num_proposals=p.num_proposals, spec_propose_time_s=p.propose_time_s)
        if self.max_loras is not None:
            spec.update(max_lora=self.max_loras, running_lora_adapters=_adapter_names(self.running),
                        waiting_lora_adapters=_adapter_names(self.waiting))
        return SchedulerStats(**spec,
            tenants=tenants, queue_kv_demand_blocks=demand,
            running=len(self.running), waiting=len(self.waiting), waiting_by_reason=by_reason,
            kv_cache_usage=kv.usage, num_free_blocks=kv.num_free_blocks, num_blocks=kv.num_blocks,
            prefix_cache_queries=self.prefix_cache_queries, prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions, num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens, step_id=self.step_id)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (e.g. between benchmark runs); False while busy."""
        return self.kv_cache_manager.block_pool.reset_prefix_cache()


def _adapter_names(requests) -> list[str]:
    """The distinct LoRA adapters of ``requests``, by name, sorted."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
