"""Checks of a request's sampling parameters that need the engine's numbers (the vocabulary
size and ``--max-logprobs``), so they cannot live in ``SamplingParams._verify``.

Called once per request, by ``LLMEngine.make_request`` (offline, or on the serving
replica's tokenizer pool), before anything is queued: a stop token id past the vocabulary
can never be sampled (the client would wait for a stop that cannot come), and a logprobs
count past the bound would make every step of the batch gather a huge top-k. The 400 names
the field as both APIs spell it (``logprobs``; ``top_logprobs`` in chat).
"""

from __future__ import annotations

from pagedserve.scheduler.sampling_params import SamplingParams


def check_vocab_limits(params: SamplingParams, vocab_size: int, max_logprobs: int) -> SamplingParams:
    """Raises ValueError naming the field; returns ``params`` with ``logprobs=-1`` turned
    into the vocabulary size (vLLM's meaning of -1), everything else unchanged."""
    for t in params.stop_token_ids:
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop_token_ids: token id {t} is outside the vocabulary "
                             f"[0, {vocab_size}).")
    bad = [t for t in params.logprob_token_ids or () if t >= vocab_size]
    if bad:  # vLLM's words
        raise ValueError(f"token_id(s) {bad} in logprob_token_ids contain out-of-vocab token ids. "
                         f"Vocabulary size: {vocab_size}")
    n = params.logprobs
    if n is None:
        return params
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    wanted = vocab_size if n == -1 else n
    if wanted > limit:
        asked = f"{n} (the whole vocabulary, {vocab_size})" if n == -1 else str(n)
        raise ValueError(f"logprobs (top_logprobs in a chat request): requested {asked} logprobs per "
                         f"token, more than the maximum allowed, {limit} (the server's --max-logprobs).")
    return params.clone(logprobs=wanted) if n == -1 else params
