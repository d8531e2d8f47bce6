"""What the engine hands back to callers (offline LLM, the Serve ingress), vLLM-shaped."""

from __future__ import annotations

import array
import sys
from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    logprobs: list | None = None  # list[scheduler.outputs.Logprobs], one per token
    # What this step added (for streaming); empty when this sample did not move.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Set when this request failed on its own (its setup, sampling or detokenization
    # raised): finished, finish_reason "error", and the rest of the batch unaffected.
    error: str | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the
    # first (nothing precedes it) and for positions not computed yet (the prompt's own
    # token first, then the top-N; ``sampled_rank`` is its rank). As vLLM's, as lists.
    prompt_logprobs: list | None = None
    # An embedding request's vector (the pooling runner), float32 little-endian bytes, on its
    # final (and only) output; ``embedding`` reads it as floats. None for generation.
    pooled: bytes | None = None

    @property
    def embedding(self) -> list[float] | None:
        return None if self.pooled is None else decode_vector(self.pooled)


def decode_vector(data: bytes) -> list[float]:
    """float32 little-endian bytes -> Python floats."""
    vec = array.array("f")
    vec.frombytes(data)
    if sys.byteorder != "little":
        vec.byteswap()
    return vec.tolist()


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt, as vLLM's: ``out.outputs.embedding``."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
