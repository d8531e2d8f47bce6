"""Per-request state kept by a worker between steps, updated only from plan diffs.

The scheduler owns allocation; the worker mirrors what it needs to build tensors:
token ids (prompt + outputs it sampled itself), the block table and how many tokens
already have K/V in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.scheduler.lora import LoRARequest
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # prompt + outputs; kept in sync so a step slices it instead of concatenating.
    token_ids: list[int] = field(default_factory=list)
    # EOS and stop_token_ids, masked by the sampler while len(outputs) < min_tokens.
    stop_token_ids: set[int] = field(default_factory=set)
    lora_request: LoRARequest | None = None  # its adapter (worker/lora); None: the base model
    pooling: PoolingParams | None = None  # a pooling request (worker/pooler.py); None: it samples

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
