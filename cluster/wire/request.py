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
last four fields (``prompt_token_ids`` set means validated: the engine thread trusts it).
Every 4xx a request can get comes from there: token ids in the vocabulary, an empty prompt,
prompt truncation, the context length, logprobs and stop ids against the vocabulary and
``--max-logprobs``, logit_bias ids, a grammar that compiles, a LoRA adapter that loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler.lora import LoRARequest
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
    # The LoRA adapter the body's ``model`` named (the front resolves it: "<adapter>" or
    # "<base>:<adapter>"); None: the base model. The worker reads it from its path.
    lora_request: LoRARequest | None = None
    # Filled in by LLMEngine.make_request, on the process that runs the engine:
    prompt_token_ids: list[int] | None = None  # after truncate_prompt_tokens: what the model sees
    prompt_text: str | None = None  # RequestOutput.prompt: the text the model saw, None when sent as ids
    grammar: object | None = None  # the compiled structured-outputs grammar (cached by spec)
    arrival_time: float | None = None  # time.monotonic() there; None: when the engine takes it

    @property
    def token_ids(self) -> list[int] | None:
        """The prompt's ids as sent, if it was sent as ids (what the router reads)."""
        return self.prompt if isinstance(self.prompt, list) else None

    @property
    def needs_encoding(self) -> bool:
        """Text or a chat still to tokenize (a replica does it on its tokenizer pool)."""
        return self.messages is not None or isinstance(self.prompt, str)
