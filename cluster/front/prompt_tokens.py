"""The front's copy of the replicas' tokenizer, kept where the router needs a prompt's
token ids (the KV router, routing.py): a chat is rendered and a prompt tokenized here, on
the front's tokenizer pool (cluster/text/tokenizer_pool.py), and the replica gets the ids
(cluster/wire/request.py), so no prompt is tokenized twice.

The tokenizer comes from a replica over Ray, once (the HF tokenizer object pickles as its
own files' content), so the front's node needs no copy of the model. Until it has come,
or if it cannot come, prompts go to the replicas as text, which tokenize them as with
one replica, and the router routes them by load.
"""

from __future__ import annotations

import asyncio
import logging

from pagedserve.cluster.text.tokenizer_pool import TokenizerPool

logger = logging.getLogger("pagedserve")
LOAD_TIMEOUT_S = 30.0  # a call that hangs is given up, and tried again on a later request


class PromptTokens:
    def __init__(self, engine, max_model_len) -> None:
        """``engine``: the engine deployment's handle; ``max_model_len``: an async callable."""
        self._engine = engine
        self._max_model_len = max_model_len
        self._pool: TokenizerPool | None = None
        self._loading: asyncio.Task | None = None

    def _start(self) -> None:
        if self._loading is None or (self._loading.done() and self._pool is None):
            self._loading = asyncio.ensure_future(self._load())

    async def _load(self) -> None:
        try:
            tokenizer = await asyncio.wait_for(self._engine.tokenizer.remote(), LOAD_TIMEOUT_S)
            self._pool = TokenizerPool(tokenizer, await self._max_model_len())
            logger.info("the front tokenizes prompts for its router (%s)", type(tokenizer).__name__)
        except Exception:  # (TimeoutError included) the replicas tokenize; tried again later
            logger.warning("no tokenizer at the front yet; prompts go as text", exc_info=True)

    async def encode(self, prompt, messages, add_generation_prompt, tools, truncating: bool) -> list[int] | None:
        """The prompt's token ids, or None: already ids, or no tokenizer here yet. Raises
        ValueError (a 400) as the replica's pool would: the same checks, the same words."""
        if isinstance(prompt, list) or (prompt is None and messages is None):
            return None
        pool = self._pool
        if pool is None:
            self._start()
            return None
        if messages is None and not truncating:
            pool.check_chars(prompt)  # O(1), before the pool does any work
        return await pool.run(pool.encode_prompt, prompt, messages, add_generation_prompt, tools)
