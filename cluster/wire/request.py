"""GenerateRequest: one generation request as the front hands it to an engine replica,
the single argument of the replica's ``generate`` call. The front's router reads it
before Serve sends it (cluster/front/router/routing.py: the prompt's token ids, cache salt and
tenant name the blocks a replica may already hold).

``prompt`` is the text (the replica tokenizes it), or token ids: sent so by the client, or
tokenized by the front when its router needs them (then ``messages`` is None: the chat
was rendered there). The replica validates it once (cluster/engine/engine_request.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt: str | list[int] | None
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    messages: list[dict] | None = None  # a chat still to render (the replica's template)
    add_generation_prompt: bool | str = True  # "continue": vLLM's continue_final_message
    tenant: str | None = None
    tools: list[dict] | None = None  # for a template that renders tools

    @property
    def token_ids(self) -> list[int] | None:
        return self.prompt if isinstance(self.prompt, list) else None
