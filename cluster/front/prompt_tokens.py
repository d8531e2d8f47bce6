"""The front's copy of the replicas' tokenizer, kept where the router needs a prompt's
token ids (the KV router, routing.py): a chat is rendered and a prompt tokenized here, on
the front's tokenizer pool (cluster/text/tokenizer_pool.py), and the replica gets the ids
(cluster/wire/request.py), so no prompt is tokenized twice.

The tokenizer is loaded from where the replicas loaded theirs (the path in their info():
the model's directory, or the GGUF's converted one in $PAGEDSERVE_CACHE; a repo id or URI is
fetched onto this node, config and tokenizer only: worker/loading/model_fetch.py), on a thread, once.
Until it is loaded, or where the front's node has no such files, prompts go to the replicas
as text, which tokenize them as with one replica, and the router routes them by load.
"""

from __future__ import annotations

import asyncio
import logging

from pagedserve.cluster.text.tokenizer_pool import TokenizerPool, load_tokenizer
from pagedserve.worker.loading.model_fetch import local_model_path

logger = logging.getLogger("pagedserve")


class PromptTokens:
    def __init__(self, info) -> None:
        """``info``: an async callable, the replicas' info() (cluster/replica/engine_replica.py)."""
        self._info = info
        self._pool: TokenizerPool | None = None
        self._loading: asyncio.Task | None = None

    def _start(self) -> None:
        if self._loading is None or (self._loading.done() and self._pool is None):
            self._loading = asyncio.ensure_future(self._load())

    async def _load(self) -> None:
        try:
            info = await self._info()
            # A repo id or URI model is fetched onto this node too (its config and tokenizer only).
            revision = info.get("revision") if info["tokenizer"] == info.get("model") else None
            path = await asyncio.to_thread(local_model_path, info["tokenizer"], revision, info.get("download_dir"),
                                           config_only=True)
            tokenizer = await asyncio.to_thread(load_tokenizer, path)
            self._pool = TokenizerPool(tokenizer, info["max_model_len"])
            logger.info("the front tokenizes prompts for its router (%s)", info["tokenizer"])
        except Exception:  # the replicas tokenize; tried again on a later request
            logger.warning("no tokenizer at the front; prompts go as text", exc_info=True)

    async def encode(self, req) -> list[int] | None:
        """The prompt ids of ``req`` (an EngineRequest, cluster/wire/request.py), or None:
        already ids, or no tokenizer here yet. Raises ValueError (a 400) as the replica's
        pool would: the same checks, the same words."""
        prompt, messages = req.prompt, req.messages
        if isinstance(prompt, list) or (prompt is None and messages is None):
            return None
        pool = self._pool
        if pool is None:
            self._start()
            return None
        if messages is None and req.params.truncate_prompt_tokens is None:
            pool.check_chars(prompt)  # O(1), before the pool does any work
        return await pool.run(pool.encode_prompt, prompt, messages, req.add_generation_prompt, req.tools,
                              req.chat_template_kwargs)
