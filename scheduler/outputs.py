"""Wire types between the scheduler and the workers: the step plan and the step result.

Plain ``@dataclass(slots=True)`` with stdlib types only, cheap to pickle. No tensors,
no live objects. The plan carries a request in full the first time it is scheduled
(``NewRequestData``) and only diffs afterwards (``CachedRequestData``); the worker keeps
per-request state (token ids, block table) and updates it from those diffs.

    step k     scheduler ──SchedulerOutput──▶ workers (all ranks)
               scheduler ◀─ModelRunnerOutput── rank 0 only

Token accounting for one request in one step (``num_computed_tokens`` = c, scheduled = s):

    tokens:   [0 ........ c) [c ...... c+s) [c+s ...... num_tokens)
               cached K/V     computed now    not yet (next steps)

A row samples a token only when ``c + s`` reaches the request's current token count
(prompt + outputs so far); a partial prefill chunk samples nothing. A pooling request
(``pooling_params``) samples nothing at all: the step that computes its last prompt token
returns its pooled hidden state instead (``ModelRunnerOutput.pooled``), and it ends there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler.lora import LoRARequest
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request's first appearance in a plan (or re-appearance after preemption,
    when the worker already dropped it). Carries everything the worker needs."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Tokens generated before a preemption; recomputed together with the prompt.
    output_token_ids: list[int] = field(default_factory=list)
    # Its LoRA adapter (None: the base model): the worker loads it from the path on first
    # use and gives it a slot (worker/lora).
    lora_request: LoRARequest | None = None
    # A pooling request (its type and normalize resolved by the engine); None: it samples.
    pooling_params: PoolingParams | None = None


@dataclass(slots=True)
class CachedRequestData:
    """Diffs for requests the worker already knows, as parallel lists (one entry per request)."""

    req_ids: list[str] = field(default_factory=list)
    # True: the request was preempted and is back; ``new_block_ids`` is then its whole
    # block table (replace, don't append) and ``num_computed_tokens`` restarts (usually 0
    # or a prefix-cache hit).
    resumed_from_preemption: list[bool] = field(default_factory=list)
    # Blocks appended to the table this step (may be empty).
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """The step plan."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # req_id -> number of tokens to compute this step (>= 1 for every scheduled request).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests that ended (finished or aborted) since the previous plan: workers drop them.
    finished_req_ids: list[str] = field(default_factory=list)
    # Requests preempted by this plan: workers keep their token ids but drop their blocks.
    preempted_req_ids: list[str] = field(default_factory=list)
    step_id: int = 0
    # Structured outputs: the constrained requests that sample this step, and their
    # allowed-token bitmask as raw bytes: int32 little-endian [len(ids), ceil(V / 32)],
    # row i for structured_output_req_ids[i], bit t % 32 of word t // 32 set = token t
    # allowed (xgrammar's layout). Filled by the engine after schedule(); None: no row.
    structured_output_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: bytes | None = None
    # Speculative decoding: req_id -> its draft tokens. Such a request is scheduled
    # 1 + len(drafts) tokens (its last token, then the drafts); its row verifies them all
    # and returns the accepted ones plus one token of its own (1 .. len(drafts) + 1).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # How many failed steps the engine had seen when it sent this plan (it stamps each
    # plan; cluster/engine/step_containment.py). A worker skips plans of an epoch whose
    # step failed: they were made before the failure was known (async scheduling).
    epoch: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ProbePlan:
    """Sent to every rank instead of a plan: run ``ModelRunner.probe`` (one token, no KV
    cache). Rank 0 answers an empty ModelRunnerOutput; a rank that cannot compute raises."""

    step_id: int = 0
    epoch: int = 0


@dataclass(slots=True)
class Logprobs:
    """Logprobs of one sampled token: the sampled token first, then the top-N."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int = 1  # 1-based rank of the sampled token in the full distribution


@dataclass(slots=True)
class PromptLogprobs:
    """Prompt logprobs one step computed for one request: ``logprobs[i]`` is for the
    prompt token at position ``start + i`` (its own id first, then the top-N; its rank
    in ``sampled_rank``). Position 0 has none (nothing precedes it), so ``start >= 1``.
    A prefill chunk [c, c+s) covers positions c+1 .. min(c+s, num_prompt_tokens) - 1."""

    start: int
    logprobs: list[Logprobs]


@dataclass(slots=True)
class ModelRunnerOutput:
    """The step result, returned by rank 0 only. Parallel lists, one entry per request
    that was scheduled; ``sampled_token_ids[i]`` is empty for a partial prefill chunk."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # None unless some request asked for logprobs; then one list per request (empty
    # when that request did not ask, or sampled nothing).
    logprobs: list[list[Logprobs]] | None = None
    step_id: int = 0
    # req_id -> why it failed, for requests whose own setup or sampling raised in this
    # step (every rank fails them alike: same plan, same params). They sampled nothing;
    # the engine fails them alone and the rest of the batch goes on. None: no failures.
    failed: dict[str, str] | None = None
    # req_id -> the prompt logprobs this step computed, for requests with
    # ``prompt_logprobs`` set (partial chunks included). None: nobody asked.
    prompt_logprobs: dict[str, PromptLogprobs] | None = None
    # True: the worker did not run this plan, because a step before it failed (the
    # engine re-sends it as a re-run once it has dealt with that failure).
    skipped: bool = False
    # Seconds rank 0's worker spent running the step (0: not measured): with the round
    # trip the engine sees, how long the worker sat idle between steps.
    execute_s: float = 0.0
    # LoRA (worker/lora/host_cache.py): the lora_int_ids on the worker's host now, when they
    # changed since the last result (None: unchanged), and the seconds each adapter read
    # from disk since then took. The fronts' routers charge a replica without a request's
    # adapter that read.
    lora_resident: tuple[int, ...] | None = None
    lora_load_s: tuple[float, ...] = ()
    # Pooling requests whose last prompt token this step computed: req_id -> the pooled
    # vector, float32 little-endian bytes (dimensions and normalize applied). None: no such
    # request in the step (every generation step).
    pooled: dict[str, bytes] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """What the scheduler hands the engine for one request after one step: the tokens
    appended this step and, once it ended, why. One per request that got new tokens or
    finished in that update; the engine detokenizes and streams these."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None: still running
    # The stop token id that ended the request (None for EOS), or the stop string.
    stop_reason: int | str | None = None
    new_logprobs: list[Logprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    pooled: bytes | None = None  # a pooling request's vector (float32 LE), on its final output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
