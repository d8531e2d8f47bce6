"""EngineRequest: the one request object, from the front to the engine (vLLM's
EngineCoreRequest is the model). Built once, where the request enters; every function on
the way takes it whole, not its fields.

    front: serving_chat / serving_completion / beam_search ─▶ EngineRequest(...)
        ─▶ ReplicaClient.generate(req) ─Ray call─▶ EngineDeployment.generate(req)
        ─▶ AsyncEngine.generate(req): tokenizer pool: encode + LLMEngine.make_request(req)
        ─▶ engine thread: admission + LLMEngine.add_engine_request(req)

The offline ``LLM`` builds one too (``LLMEngine.add_request``). The front's router reads it
before Serve sends it (cluster/front/router/routing.py: the prompt's token ids, cache salt
and tenant name the blocks a replica may already hold).

As sent: ``prompt`` is the text (the replica tokenizes it), or token ids: sent so by the
client, or tokenized by the front when its router needs them (then ``messages`` is None: the
chat was rendered there). ``LLMEngine.make_request`` then validates it once and fills in the
last five fields (``prompt_token_ids`` set means validated: the engine thread trusts it).
Every 4xx a request can get comes from there: token ids in the vocabulary, an empty prompt,
prompt truncation, the context length, logprobs and stop ids against the vocabulary and
``--max-logprobs``, logit_bias ids, a grammar that compiles, a LoRA adapter that loads, a
generation request to an embedding model or the reverse, Matryoshka ``dimensions``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler.lora import LoRARequest
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt: str | list[int] | None
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    messages: list[dict] | None = None  # a chat still to render (the replica's template)
    add_generation_prompt: bool | str = True  # "continue": vLLM's continue_final_message
    tenant: str | None = None
    tools: list[dict] | None = None  # for a template that renders tools
    # vLLM's chat_template_kwargs: more variables for the template, e.g. {"enable_thinking": False}
    chat_template_kwargs: dict | None = None
    # A chat answer whose thinking the front tells apart (--reasoning-parser): its grammar
    # (structured outputs, a tool choice) applies from the end of the thinking on.
    reasoning: bool = False
    # The LoRA adapter the body's ``model`` named (the front resolves it: "<adapter>" or
    # "<base>:<adapter>"); None: the base model. The worker reads it from its path.
    lora_request: LoRARequest | None = None
    # An embedding request (/v1/embeddings, LLM.embed): the prompt is run, nothing sampled,
    # and the final output carries the pooled vector (RequestOutput.pooled); ``params`` then
    # only truncate the prompt. None: a generation request. make_request fills in the
    # model's pooling type and normalize where it leaves them None.
    pooling: PoolingParams | None = None
    # Filled in by LLMEngine.make_request, on the process that runs the engine:
    prompt_token_ids: list[int] | None = None  # after truncate_prompt_tokens: what the model sees
    prompt_text: str | None = None  # RequestOutput.prompt: the text the model saw, None when sent as ids
    grammar: object | None = None  # the compiled structured-outputs grammar (cached by spec)
    # The grammar waits for this token, the end of the thinking (None: from the first token).
    grammar_after_token: int | None = None
    arrival_time: float | None = None  # time.monotonic() there; None: when the engine takes it

    @property
    def token_ids(self) -> list[int] | None:
        """The prompt's ids as sent, if it was sent as ids (what the router reads)."""
        return self.prompt if isinstance(self.prompt, list) else None

    @property
    def needs_encoding(self) -> bool:
        """Text or a chat still to tokenize (a replica does it on its tokenizer pool)."""
        return self.messages is not None or isinstance(self.prompt, str)
