"""EngineRequest: one request as the engine takes it, built and validated once.

    HTTP body ─pydantic─▶ SamplingParams ─replica's tokenizer pool: make_request─▶ EngineRequest
                                                                                      │ trusted
                                 engine thread: add_engine_request (capacity only) ◀──┘

``LLMEngine.make_request`` does every check a request can fail (token ids in the vocabulary,
an empty prompt, prompt truncation, the context length, logprobs and stop ids against the
vocabulary and ``--max-logprobs``, logit_bias ids, a grammar that compiles). It reads only
configuration and the tokenizer, so the serving layer runs it on its tokenizer pool, off the
engine thread; ``add_engine_request`` then checks what only the engine's state can judge (a
request id in use, the scheduler's room) and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]  # after truncate_prompt_tokens: what the model sees
    params: SamplingParams  # vocabulary limits applied (logprobs=-1 is the vocabulary size)
    prompt: str | None = None  # the prompt's text as the model saw it; None when sent as ids
    grammar: object | None = None  # the compiled structured-outputs grammar (cached by spec)
    priority: int = 0
    cache_salt: str | None = None
    tenant: str | None = None
    arrival_time: float | None = None  # time.monotonic(); None: when the engine takes it
