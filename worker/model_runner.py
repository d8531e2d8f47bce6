"""ModelRunner: turns one step plan into tensors, runs the model, samples.

It never decides anything: batch membership and block allocation come in the plan.
Per-request state lives in ``self.requests`` and changes only through plan diffs and
the tokens this runner samples itself (every TP rank samples the same token: logits
are all-gathered and generators are seeded identically on every rank).

Batch layout of one step (decode rows first so attention can batch them):

    rows:     [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]
               query len 1   prefill chunk  chunk
    logits:   one row per request that samples (last row of a request whose
              computed tokens reach its token count); partial chunks sample nothing.

A pooling request (the pooling runner, embeddings) samples nothing: its rows of the hidden
states are pooled instead (worker/pooler.py: LAST, MEAN summed over its chunks, CLS), and
the step that computes its last prompt position returns its vector in
``ModelRunnerOutput.pooled``. A generation step never looks at pooling (``pooled`` None).

Speculative decoding: a request with drafts in the plan runs [last token, d1 .. dk] as
k + 1 decode rows (row j: one token at position start + j, the request's block table), so
the batched decode attention verifies them, and every one of them samples: row j sees the
outputs extended by d1 .. dj (penalties, min_tokens) and verifies d(j+1)
(worker/sampler.py). Its tokens are those of rows 0 .. a, where a is the first row whose
token differs from the next draft (or k): greedy, exactly the tokens k + 1 one-token steps
pick; at a temperature, tokens drawn from the same distributions (rejection sampling).

The step's tensors live in persistent buffers (step_buffers.py). A decode-only step on
CUDA replays a captured graph of its padded size (cuda_graphs.py); the padded rows are
never sampled, and the sampled ids cross to the host once per step.

A step is all or nothing for the per-request state: every change a plan makes (requests
added, dropped, preempted, block tables grown, tokens sampled, generators advanced) is
journaled, and a step that raises is rolled back before the exception leaves, so the
engine can re-run the same plan split in parts (cluster/engine/step_containment.py). Plans
queued behind a failed one (async scheduling) are skipped untouched until the engine's
plans of a later epoch (``plan.epoch``: the engine's count of failed steps) arrive. K/V rows the failed step wrote are
rewritten by the re-run (same slots, same tokens).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagedserve.kernels import AttentionMetadata
from pagedserve.scheduler.kv.kv_groups import KVCacheGroups
from pagedserve.scheduler.outputs import Logprobs, ModelRunnerOutput, SchedulerOutput
from pagedserve import plugins
from pagedserve.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from pagedserve.worker.cuda_graphs import MAX_CAPTURE_SIZE, CudaGraphRunner, capture_sizes, graphs_disabled_reason
from pagedserve.worker.input_batch import CachedRequestState
from pagedserve.worker.lora.manager import LoRAManager
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.pooler import PoolRows, pool_step
from pagedserve.worker.prompt_logprobs import PromptLogprobsRows, compute_prompt_logprobs, rows_for
from pagedserve.worker.sampler import Sampler
from pagedserve.worker.sampling_metadata import SamplingMetadata, make_generator
from pagedserve.worker.step_buffers import StepBuffers

logger = logging.getLogger(__name__)


_PUT, _TABLE, _GROW, _TOKEN, _GENS, _POOL = range(6)  # the journal's entry kinds


def _describe(e: BaseException) -> str:
    """A failed request's error, as the engine logs it and the client may see it."""
    logger.warning("request failed in the worker: %s: %s", type(e).__name__, e)
    return f"{type(e).__name__}: {e}"


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, *, block_size: int,
                 device: torch.device, seed: int = 0, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, enforce_eager: bool = False,
                 pad_eager: bool = False, max_capture_size: int | None = None,
                 num_speculative_tokens: int = 0, lora: LoRAManager | None = None,
                 kv_groups: KVCacheGroups | None = None) -> None:
        """``max_num_batched_tokens``: the scheduler's token budget (None: the default
        budget, or max_model_len if larger), which sizes the step buffers.
        ``pad_eager``: pad decode batches to the graph sizes even where no graph runs
        (tests of the padding on a CPU). ``max_capture_size``: the largest graph size.
        ``num_speculative_tokens``: drafts per request (0: off); a verifying request takes
        that many more rows. ``lora``: the adapters (worker/lora), None: LoRA off; with it
        decode runs eagerly (a captured graph would replay no adapter's delta). ``kv_groups``:
        a hybrid KV cache's groups of layers (scheduler/kv/kv_groups.py): the pool holds
        group_size tensors that the groups' layers share, each group with its own tables."""
        self.model = model
        self.lora = lora
        if lora is not None:
            lora.attach(model)
            enforce_eager = True
        # The pooling runner: prompts only, no LM head; decode graphs would never replay.
        self.pooling = model_config.runner == "pooling"
        if self.pooling:
            enforce_eager = True
        # req_id -> the running MEAN sum / the CLS row of a pooling prompt still in chunks.
        self._pool_partial: dict[str, torch.Tensor] = {}
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = list(model_config.eos_token_ids)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.requests: dict[str, CachedRequestState] = {}
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self.sampler = Sampler(generator=gen)
        # req_id -> its allowed-token words this step (structured outputs; from the plan).
        self._bitmask_rows: dict[str, np.ndarray] = {}
        max_len = model_config.max_model_len
        budget = max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_len)
        max_rows = max_num_seqs * (1 + num_speculative_tokens)
        self.kv_groups = kv_groups
        self.buffers = StepBuffers(max_num_tokens=max(budget, max_rows), max_num_seqs=max_rows,
                                   max_model_len=max_len, block_size=block_size, device=device,
                                   num_groups=kv_groups.num_groups if kv_groups is not None else 1)
        reason = graphs_disabled_reason(device, getattr(model, "attention_backend", "torch"), enforce_eager)
        if reason is not None:
            logger.info("CUDA graphs off (decode runs eagerly): %s", reason)
        # Up to every verify row: a speculating decode step has 1 + k rows per request.
        sizes = capture_sizes(max_rows, max_capture_size or MAX_CAPTURE_SIZE)
        self.graph_runner = CudaGraphRunner(model, self.buffers, sizes, use_graphs=reason is None,
                                            pad_eager=pad_eager)
        # The epoch of the last plan that raised: plans of that epoch or older are skipped.
        self._failed_epoch = -1
        plugins.on_runner(self)  # PAGEDSERVE_PLUGINS' install_runner hooks (plugins.py)

    # ------------------------------------------------------------------ the journal
    # Entries (kind, ...), undone last first: the state before the failed plan comes back.
    #   _PUT    req_id, state|None   self.requests[req_id] was state (None: absent)
    #   _TABLE  state, block_ids, num_computed   (block_ids: the list object it had)
    #   _GROW   state, num_blocks, num_computed  (its table was extended in place)
    #   _TOKEN  state                            (a sampled token was appended)
    #   _GENS   generators, states               (their states before this step's draws)
    #   _POOL   partial                          (the pooling sums before this step's rows)
    def _rollback(self, journal: list) -> None:
        for entry in reversed(journal):
            kind = entry[0]
            if kind == _PUT:
                if entry[2] is None:
                    self.requests.pop(entry[1], None)
                else:
                    self.requests[entry[1]] = entry[2]
            elif kind == _TABLE:
                entry[1].block_ids, entry[1].num_computed_tokens = entry[2], entry[3]
            elif kind == _GROW:
                del entry[1].block_ids[entry[2]:]
                entry[1].num_computed_tokens = entry[3]
            elif kind == _TOKEN:
                entry[1].output_token_ids.pop()
                entry[1].token_ids.pop()
            elif kind == _POOL:
                self._pool_partial = entry[1]
            else:
                for g, state in zip(entry[1], entry[2]):
                    g.set_state(state)

    # ------------------------------------------------------------------ state
    def _update_states(self, plan: SchedulerOutput, failed: dict[str, str], journal: list) -> None:
        requests = self.requests
        for req_id in plan.finished_req_ids:
            state = requests.pop(req_id, None)
            if state is not None:
                journal.append((_PUT, req_id, state))
                if state.pooling is not None:
                    self._pool_partial.pop(req_id, None)  # aborted mid-prompt
        for req_id in plan.preempted_req_ids:
            state = requests.get(req_id)
            if state is not None:
                journal.append((_TABLE, state, state.block_ids, state.num_computed_tokens))
                state.block_ids = []
                state.num_computed_tokens = 0
        for new in plan.scheduled_new_reqs:
            try:
                state = self._new_state(new)
            except Exception as e:  # this request's own setup: it fails, the batch goes on
                failed[new.req_id] = _describe(e)
                continue
            journal.append((_PUT, new.req_id, requests.get(new.req_id)))
            requests[new.req_id] = state
        cached = plan.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = requests.get(req_id)
            if state is None:  # its setup failed a step ago (async scheduling planned on)
                continue
            if cached.resumed_from_preemption[i]:
                journal.append((_TABLE, state, state.block_ids, state.num_computed_tokens))
                state.block_ids = list(cached.new_block_ids[i])
            else:
                journal.append((_GROW, state, len(state.block_ids), state.num_computed_tokens))
                state.block_ids.extend(cached.new_block_ids[i])
            state.num_computed_tokens = cached.num_computed_tokens[i]

    def _new_state(self, new) -> CachedRequestState:
        params = new.sampling_params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        gen = make_generator(params.seed, self.device) if params.seed is not None else None
        if new.lora_request is not None:
            if self.lora is None:
                raise ValueError(f"LoRA adapter {new.lora_request.lora_name!r}: LoRA is not enabled "
                                 "(--enable-lora).")
            self.lora.add(new.lora_request)  # read now: a bad adapter fails this request alone
        if (new.pooling_params is not None) != self.pooling:
            raise ValueError("a pooling request needs the pooling runner, and the pooling runner runs only "
                             "pooling requests (--runner).")
        return CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            sampling_params=params,
            generator=gen,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            output_token_ids=list(new.output_token_ids),
            token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            stop_token_ids=stop_ids,
            lora_request=new.lora_request,
            pooling=new.pooling_params,
        )

    # ------------------------------------------------------------------ inputs
    def _prepare_inputs(self, num_scheduled: dict[str, int], spec_tokens: dict[str, list[int]]):
        # Decode rows (query length 1) first, then chunks; stable within each group. A
        # request verifying drafts is decode rows too, one per token (see the module doc).
        def is_chunk(r: str) -> bool:
            return num_scheduled[r] != 1 and not (spec_tokens and r in spec_tokens)

        if self.lora is None:
            order = sorted(num_scheduled, key=is_chunk)
        else:  # and by adapter inside each part: an adapter's rows make one run (worker/lora)
            def adapter_of(r: str) -> int:
                lora = self.requests[r].lora_request
                return 0 if lora is None else lora.lora_int_id

            order = sorted(num_scheduled, key=lambda r: (is_chunk(r), adapter_of(r)))
        lora_rows: list = []  # (adapter, rows' tokens) per request, in order
        input_ids: list[int] = []
        query_lens: list[int] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []  # row in hidden_states of each sampling request
        sample_reqs: list[CachedRequestState] = []
        prompt_lp = []  # PromptLogprobsRows of requests that asked (worker/prompt_logprobs.py)
        pool_rows: list[PoolRows] = []  # pooling requests' rows (worker/pooler.py)
        pooling = self.pooling
        row = 0
        num_decode = 0
        groups = [0]  # boundaries of the decode rows, one group per request
        for req_id in order:
            st = self.requests[req_id]
            n = num_scheduled[req_id]
            start = st.num_computed_tokens
            end = start + n
            draft = spec_tokens.get(req_id) if spec_tokens else None
            if draft:
                if start != st.num_tokens - 1 or n != len(draft) + 1:
                    raise RuntimeError(f"request {req_id!r}: drafts scheduled with {n} tokens from "
                                       f"position {start} of {st.num_tokens}")
                # Row j is a one-token "sequence" ending at position start + j over the same
                # block table: each layer writes all rows' K/V before attention reads any,
                # so row j sees the drafts before it, and the batched decode kernels run it.
                input_ids.append(st.token_ids[start])
                input_ids.extend(draft)
                query_lens.extend([1] * n)
                starts.extend(range(start, end))
                tables.extend([st.block_ids] * n)
                sample_rows.extend(range(row, row + n))
                sample_reqs.append(st)
                row += n
                num_decode += n
                groups.append(num_decode)
                lora_rows.append((st.lora_request, n))
                continue
            if n == 1:
                num_decode += 1
                groups.append(num_decode)
            input_ids.extend(st.token_ids[start:end])
            lora_rows.append((st.lora_request, n))
            query_lens.append(n)
            starts.append(start)
            tables.append(st.block_ids)
            if pooling:  # the pooling runner: every request pools, none samples
                pool_rows.append(PoolRows(req_id, st.pooling, row, n, start, st.num_tokens))
                row += n
                continue
            share = rows_for(req_id, st.prompt_token_ids, st.sampling_params.prompt_logprobs, row, start, end)
            if share is not None:
                prompt_lp.append(share)
            row += n
            if end >= st.num_tokens:
                sample_rows.append(row - 1)
                sample_reqs.append(st)
        num_rows = len(query_lens)
        pad_to = self.graph_runner.padded_size(num_rows) if num_decode == num_rows else None
        # A group of several rows only with drafts; on CPU their decode rows read the context once.
        row_groups = groups if spec_tokens and pad_to is None and len(groups) <= num_decode else None
        inputs = self.buffers.fill(input_ids, query_lens, starts, tables, num_decode, pad_to, row_groups)
        if self.lora is not None:
            self.lora.begin_step(lora_rows)
        return inputs, sample_rows, sample_reqs, prompt_lp, pool_rows

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        if plan.epoch <= self._failed_epoch:
            # Planned before the failure was known: the engine re-sends what still holds.
            return ModelRunnerOutput(step_id=plan.step_id, skipped=True)
        journal: list = []
        try:
            return self._execute(plan, journal)
        except BaseException:
            self._rollback(journal)
            self._failed_epoch = plan.epoch
            raise

    @torch.inference_mode()
    def probe(self) -> None:
        """One token through the model without the KV cache, and its logits checked:
        raises if this worker can no longer compute. The engine asks after a failed step
        that no split of its batch explained (a broken worker, not a bad request)."""
        ids = torch.zeros(1, dtype=torch.int64, device=self.device)
        out = self.model(ids, torch.zeros_like(ids), None, None)
        if not self.pooling:
            out = self.model.compute_logits(out)
        if not bool(torch.isfinite(out).all()):
            raise RuntimeError(f"the probe step produced non-finite {'hidden states' if self.pooling else 'logits'}")

    def _execute(self, plan: SchedulerOutput, journal: list) -> ModelRunnerOutput:
        failed: dict[str, str] = {}
        self._update_states(plan, failed, journal)
        self._bitmask_rows = {}
        if plan.grammar_bitmask is not None and plan.structured_output_req_ids:
            words = np.frombuffer(plan.grammar_bitmask, dtype="<i4").reshape(
                len(plan.structured_output_req_ids), -1)
            self._bitmask_rows = dict(zip(plan.structured_output_req_ids, words))
        # Without those that failed now or in an earlier step (the rest of the batch runs).
        num_scheduled = {r: n for r, n in plan.num_scheduled_tokens.items() if r in self.requests}
        req_ids = list(plan.num_scheduled_tokens)
        if not num_scheduled:
            return self._with_lora_report(ModelRunnerOutput(
                req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids], step_id=plan.step_id,
                failed=failed or None))
        spec = plan.scheduled_spec_decode_tokens
        try:
            inputs, sample_rows, sample_reqs, prompt_lp, pool_rows = self._prepare_inputs(num_scheduled, spec)
            hidden = self.graph_runner.forward(inputs, self.kv_caches)
        finally:
            if self.lora is not None:
                self.lora.end_step()  # the probe and profile runs see no adapter
        if pool_rows:
            journal.append((_POOL, dict(self._pool_partial)))
            pooled = pool_step(hidden, pool_rows, self._pool_partial)
            return self._with_lora_report(ModelRunnerOutput(
                req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids], step_id=plan.step_id,
                failed=failed or None, pooled=pooled or None))
        prompt_logprobs = (compute_prompt_logprobs(hidden, self.model.compute_logits, prompt_lp)
                           if prompt_lp else None)
        sampled_by_req: dict[str, list[int]] = {}
        logprobs_by_req: dict[str, list[Logprobs]] = {}
        if sample_rows:
            if sample_rows[-1] == len(sample_rows) - 1:  # rows 0..k-1 (every decode step): a view
                picked = hidden[: len(sample_rows)]
            else:
                picked = hidden.index_select(0, torch.tensor(sample_rows, dtype=torch.int64, device=self.device))
            logits = self.model.compute_logits(picked)
            drafts = [spec.get(st.req_id) for st in sample_reqs] if spec else None
            for st, toks, lps in self._sample(logits, sample_reqs, drafts, failed, journal):
                for tok in toks:
                    journal.append((_TOKEN, st))
                    st.append_output(tok)
                sampled_by_req[st.req_id] = toks
                if lps is not None:
                    logprobs_by_req[st.req_id] = lps
        sampled = [sampled_by_req.get(r, []) for r in req_ids]
        logprobs = None
        if logprobs_by_req:
            logprobs = [logprobs_by_req.get(r, []) for r in req_ids]
        return self._with_lora_report(ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs, step_id=plan.step_id,
            failed=failed or None, prompt_logprobs=prompt_logprobs))

    def _with_lora_report(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """``out`` with what changed in the adapters' host cache since the last result."""
        if self.lora is not None:
            out.lora_resident, out.lora_load_s = self.lora.host.report()
        return out

    def _sample_rows(self, logits: torch.Tensor, reqs: list[CachedRequestState],
                     drafts: list[list[int] | None] | None):
        """[(tokens, logprobs or None)] per request. A request with drafts has
        len(drafts) + 1 rows of ``logits``, each sampled as if the drafts before it had
        been output, and keeps the tokens up to the first that differs from its draft."""
        if not drafts or not any(drafts):
            return [([tok], [lp] if lp is not None else None)
                    for tok, lp in self._sample_batch(logits, reqs, None)]
        rows: list[CachedRequestState] = []
        outputs: list[list[int]] = []
        row_drafts: list[int] = []
        for st, draft in zip(reqs, drafts):
            rows.append(st)
            outputs.append(st.output_token_ids)
            for j, d in enumerate(draft or ()):
                row_drafts.append(d)
                rows.append(st)
                outputs.append(st.output_token_ids + draft[:j + 1])
            row_drafts.append(-1)
        draft_ids = torch.tensor(row_drafts, dtype=torch.int64, device=self.device)
        per_row = self._sample_batch(logits, rows, draft_ids, outputs)
        done, r = [], 0
        for st, draft in zip(reqs, drafts):
            n = len(draft) + 1 if draft else 1
            toks, lps = [], []
            for j in range(n):
                tok, lp = per_row[r + j]
                toks.append(tok)
                lps.append(lp)
                if j == n - 1 or tok != draft[j]:
                    break
            done.append((toks, lps if lps[0] is not None else None))
            r += n
        return done

    def _sample_batch(self, logits: torch.Tensor, rows: list[CachedRequestState],
                      draft_ids: torch.Tensor | None, outputs: list[list[int]] | None = None):
        smd = SamplingMetadata.build(
            [st.sampling_params for st in rows], [st.generator for st in rows],
            [st.prompt_token_ids for st in rows],
            outputs if outputs is not None else [st.output_token_ids for st in rows],
            [st.stop_token_ids for st in rows], self.vocab_size, self.device,
            [self._bitmask_rows.get(st.req_id) for st in rows] if self._bitmask_rows else None)
        out = self.sampler(logits, smd, draft_ids)
        lps = out.logprobs if out.logprobs is not None else [None] * len(rows)
        return list(zip(out.sampled_token_ids.tolist(), lps))

    def _sample(self, logits: torch.Tensor, reqs: list[CachedRequestState],
                drafts: list[list[int] | None] | None, failed: dict[str, str],
                journal: list) -> list[tuple[CachedRequestState, list[int], list | None]]:
        """The batch in one go; if that raises, request by request, so the one at fault
        fails alone. Generator states are restored before the retry: a seeded row draws
        the same noise as in a batch without the faulty row (sampling is row-wise), so
        every other row gets exactly the token it would have got."""
        gens = [g for g in [self.sampler.generator, *(st.generator for st in reqs)] if g is not None]
        states = [g.get_state() for g in gens]
        journal.append((_GENS, gens, states))
        try:
            return [(st, *res) for st, res in zip(reqs, self._sample_rows(logits, reqs, drafts))]
        except Exception as e:
            if len(reqs) == 1:
                failed[reqs[0].req_id] = _describe(e)
                return []
        for g, state in zip(gens, states):
            g.set_state(state)
        done, r = [], 0
        for i, st in enumerate(reqs):
            draft = drafts[i] if drafts else None
            n = len(draft) + 1 if draft else 1
            try:
                done.append((st, *self._sample_rows(logits[r:r + n], [st], [draft] if draft else None)[0]))
            except Exception as e:
                failed[st.req_id] = _describe(e)
            r += n
        return done

    # ------------------------------------------------------------------ memory profile
    # The largest work a step may bring, run once before the KV cache exists so the worker
    # can measure its peaks (worker/memory_plan.py names each share).
    @torch.inference_mode()
    def profile_forward(self, num_tokens: int, num_sample_rows: int, logprobs: bool) -> None:
        """One sequence of ``num_tokens`` rows without a cache (attention stays inside the
        chunk), the logits of the rows a step samples, and a prompt-logprobs chunk."""
        dev = self.device
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        pos = torch.arange(num_tokens, dtype=torch.int64, device=dev)
        md = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            block_table=torch.zeros((1, 1), dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            max_seqlen_q=num_tokens, max_seq_len=num_tokens,
            seq_lens_cpu=[num_tokens], query_lens_cpu=[num_tokens])
        hidden = self.model(ids, pos, None, md)
        if self.pooling:  # no logits; the pooled vectors are a few rows of the hidden states
            del hidden
            return
        logits = self.model.compute_logits(hidden[-min(num_tokens, num_sample_rows):])
        if logprobs and num_tokens > 1:
            n = num_tokens - 1
            share = PromptLogprobsRows("profile", 0, 1, n, 0, [0] * n)
            compute_prompt_logprobs(hidden, self.model.compute_logits, [share])
        del hidden, logits

    @torch.inference_mode()
    def profile_sampler(self, num_rows: int, logprobs: bool) -> None:
        """The sampler at ``num_rows`` rows with every filter it has on: penalties,
        top-k, top-p, min-p, and the top logprobs (the log-softmax over the vocabulary
        is what costs; the top-k of it is small)."""
        from pagedserve.scheduler.sampling_params import SamplingParams

        if self.pooling:  # the pooling runner never samples
            return
        hidden = torch.zeros(num_rows, self.model_config.hidden_size, dtype=self.model_config.dtype,
                             device=self.device)
        logits = self.model.compute_logits(hidden)
        params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, presence_penalty=0.5,
                                frequency_penalty=0.5, repetition_penalty=1.1, logprobs=5 if logprobs else None)
        smd = SamplingMetadata.build([params] * num_rows, [None] * num_rows, [[0]] * num_rows,
                                     [[0]] * num_rows, [set()] * num_rows, self.vocab_size, self.device)
        self.sampler(logits, smd)

    def allocate_cache(self, num_blocks: int, num_kv_heads: int, dtype: torch.dtype) -> None:
        """The KV cache of ``num_blocks`` blocks, no graphs captured (the memory profile
        captures on a small one to measure their pool)."""
        from pagedserve.kernels.kv_quant import QUANT_DTYPES, SCALE_DTYPE
        from pagedserve.worker import cpu_memory

        shape = (num_blocks, self.block_size, num_kv_heads, self.model_config.head_dim)
        # zeros, not empty: padded rows of a batched decode multiply probability 0 by
        # whatever the unused slots hold, and 0 * NaN would poison the row.
        # On CPU the pool asks for huge pages first (worker/cpu_memory.py).
        def layer() -> tuple[torch.Tensor, ...]:
            kv = (cpu_memory.zeros(shape, dtype, self.device), cpu_memory.zeros(shape, dtype, self.device))
            if dtype not in QUANT_DTYPES:
                return kv
            return kv + tuple(torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=self.device) for _ in range(2))

        num_layers = self.model_config.num_hidden_layers
        if self.kv_groups is None:
            self.kv_caches = [layer() for _ in range(num_layers)]
        else:  # group_size tensors; layer i reads the one of its place in its group
            slots = [layer() for _ in range(self.kv_groups.group_size)]
            self.kv_caches = [slots[self.kv_groups.layer_slot(i)] for i in range(num_layers)]

    def release_cache(self) -> None:
        self.graph_runner.release()
        self.kv_caches = []

    # ------------------------------------------------------------------ cache
    def initialize_cache(self, num_blocks: int, num_kv_heads: int, dtype: torch.dtype) -> None:
        """One (k, v) pair per layer; a quantised ``dtype`` (kernels/kv_quant.py) adds the
        per-(token, head) scale bytes (UE5M3 absmax codes): (k, v, k_scale, v_scale)."""
        self.allocate_cache(num_blocks, num_kv_heads, dtype)
        self.graph_runner.capture(self.kv_caches)  # graphs address the cache: capture after it exists
