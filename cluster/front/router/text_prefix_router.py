"""``--request-router prefix``: Ray Serve LLM's PrefixCacheAffinityRouter over the engine
replicas, the peer the KV router (routing.py) is measured against. Its policy is Ray's,
unchanged: a character-level prefix tree in an actor, built from where it routed earlier
prompts. What this adds is how it reads a request: Ray's reads ``.prompt`` or
``.messages`` from the first argument that has either attribute, and stops at the first
one even when it is None; an EngineRequest (cluster/wire/request.py) has both, one of
them None. Other calls (info, tokenize) and token-id prompts have no text: None, which
Ray's router takes as "route by load". Like every router of the front, it skips the
replicas the front saw die and records where each request goes (routing.py
_SkipsLostReplicas). Imported only when chosen: Ray's router needs pyarrow (the bench extra).
"""

from __future__ import annotations

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter

from pagedserve.cluster.front.router.routing import _SkipsLostReplicas


class TextPrefixRouter(_SkipsLostReplicas, PrefixCacheAffinityRouter):
    def _extract_text_from_request(self, pending_request) -> str | None:
        if pending_request.metadata.call_method != "generate" or not pending_request.args:
            return None
        req = pending_request.args[0]
        prompt = req.messages if req.messages is not None else req.prompt
        if not isinstance(prompt, (str, list)) or (prompt and isinstance(prompt[0], int)):
            return None
        return self._normalize_prompt_to_string(prompt) or None
