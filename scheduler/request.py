"""One generation request as the scheduler sees it.

Token bookkeeping (all counts in tokens):

    all_token_ids = prompt_token_ids + output_token_ids          (num_tokens)
                    [0 ....... num_computed_tokens) [...... num_tokens)
                     K/V in the paged cache          still to compute

A request is "decoding" when exactly one token is left to compute (the last sampled
one); prefill, chunked prefill and recompute after preemption only differ in how far
``num_computed_tokens`` lags behind.
"""

from __future__ import annotations

import enum
import time

from pagedserve.scheduler.lora import LoRARequest
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # lost its blocks; waits (at the front) to be recomputed
    # Everything from here on is finished; order matters for ``is_finished``.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    """The OpenAI ``finish_reason`` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_STATUS_TO_REASON: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP.value,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH.value,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT.value,
}


class Request:
    __slots__ = (
        "req_id", "prompt_token_ids", "output_token_ids", "all_token_ids",
        "num_prompt_tokens", "num_computed_tokens", "sampling_params", "eos_token_id",
        "arrival_time", "priority", "cache_salt", "status", "stop_reason", "max_tokens",
        "num_cached_tokens", "num_preemptions", "block_hashes", "stop_token_ids",
        "min_tokens", "ignore_eos", "tenant", "resumed_step", "preempted_step", "cache_tenant",
        "num_output_placeholders", "lora_request", "pooling_params",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {req_id!r}: the prompt must contain at least one token.")
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Kept in sync with prompt + output so slicing a block never concatenates lists.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # Who pays for this request in the fair share, and whose prefix cache it may read
        # (the scheduler salts the cache per tenant); None: the shared "default" tenant.
        self.tenant = tenant or "default"
        self.resumed_step = -1  # step it last resumed after a preemption (hysteresis)
        self.preempted_step = -1  # step whose plan last preempted it
        # Tokens sampled in steps already planned but not yet reported (async scheduling:
        # the next plan is made while a step runs; synchronous stepping brings this back
        # to 0 before every plan).
        self.num_output_placeholders = 0
        self.cache_tenant: str | None = None  # set by the scheduler when tenants are isolated
        # The LoRA adapter it runs with (None: the base model): salts its block hashes and
        # takes one of the step's max_loras slots while it runs (scheduler/lora.py).
        self.lora_request = lora_request
        # A pooling request (scheduler/pooling_params.py): its prompt only, then it ends with
        # its pooled hidden state instead of a sampled token; None: a generation request.
        self.pooling_params = pooling_params
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Resolved by Scheduler.add_request against max_model_len and the pool size;
        # until then the user's value (None: "as long as the model allows").
        self.max_tokens: int | None = self.sampling_params.max_tokens
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.block_hashes: list[int] = []
        # Copied out of sampling_params: the stop check runs once per token per request.
        self.stop_token_ids = frozenset(self.sampling_params.stop_token_ids)
        self.min_tokens = self.sampling_params.min_tokens
        self.ignore_eos = self.sampling_params.ignore_eos

    def stops_on(self, token: int) -> bool:
        """Whether ``token`` ends the request once past min_tokens: its EOS (unless
        ignore_eos) or one of its stop_token_ids."""
        return (token == self.eos_token_id and not self.ignore_eos) or token in self.stop_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _STATUS_TO_REASON.get(self.status)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __lt__(self, other: "Request") -> bool:
        # Only used to break exact ties inside the priority heap.
        return (self.priority, self.arrival_time, self.req_id) < (
            other.priority, other.arrival_time, other.req_id)

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={len(self.output_token_ids)}, computed={self.num_computed_tokens})")
