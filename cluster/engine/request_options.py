"""Per-request options the engine applies around the scheduler, outside the step:
prompt truncation (``truncate_prompt_tokens``) and ``best_of`` selection."""

from __future__ import annotations

from pagedserve.cluster.wire.outputs import CompletionOutput
from pagedserve.scheduler.sampling_params import SamplingParams


def truncate_prompt(ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """``truncate_prompt_tokens`` ids (-1: max_model_len), as vLLM truncates: from the
    left by default, so the text nearest the completion stays; ``truncation_side``
    "right" keeps the first ones. Runs before the length check, so a prompt longer than
    the model fits once truncated (the check still counts max_tokens against what is left)."""
    k = params.truncate_prompt_tokens
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({k}) must be <= max_model_len ({max_model_len}).")
    return ids[:k] if params.truncation_side == "right" else ids[-k:]


def sample_params(params: SamplingParams, index: int, seed: int | None) -> SamplingParams:
    """The params of sample ``index`` of a request forked into n (or best_of) samples.
    Only sample 0 computes prompt logprobs: its siblings share the prompt and join the
    prefix cache behind it instead of recomputing it. best_of ranks samples by their
    cumulative logprob, so its samples always compute the sampled token's logprob."""
    logprobs = params.logprobs
    if logprobs is None and num_samples(params) > params.n:
        logprobs = 0
    return params.clone(n=1, best_of=None, seed=seed, logprobs=logprobs,
                        prompt_logprobs=params.prompt_logprobs if index == 0 else None)


def num_samples(params: SamplingParams) -> int:
    return max(params.n, params.best_of or 0)


def select_best(completions: list[CompletionOutput], params: SamplingParams) -> list[CompletionOutput]:
    """The ``n`` samples with the highest cumulative logprob (vLLM V0's best_of), best
    first (ties: the lower sample index), re-indexed 0..n-1; their logprobs dropped
    unless the request asked for them."""
    def score(c: CompletionOutput) -> float:
        return sum(lp.logprobs[0] for lp in (c.logprobs or ()))

    best = sorted(completions, key=lambda c: (-score(c), c.index))[: params.n]
    for i, c in enumerate(best):
        c.index = i
        if params.logprobs is None:
            c.logprobs = c.delta_logprobs = None
    return best
