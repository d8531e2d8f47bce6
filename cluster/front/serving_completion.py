"""/v1/completions, as vLLM's OpenAIServingCompletion: one engine request per prompt of a
batch, answered as one response.

    prompt: [p0, p1, p2] ──▶ generate(rid-0, p0) ─┐  each admitted on its own (replica_client.py);
                        ──▶ generate(rid-1, p1) ─┼─ one refused (400/429): the others are
                        ──▶ generate(rid-2, p2) ─┘  cancelled, and that answer is the response
                                        │ merged as they come: (prompt index, output)
                                        ▼
                        choices i * n + j (openai_format.py); one JSON body, or SSE
                        with one [DONE] and, with include_usage, usage summed over prompts

A single prompt keeps the request id as its engine id. Every way out (client gone, the SSE
body closed, a failure) cancels the engine streams that have not finished
(merged_streams.py), so no prompt of a batch keeps its blocks. ``echo`` puts the prompt's
text in front of each choice: the text as sent, or the tokens the engine kept, decoded.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.cluster.front.openai import openai_format as fmt
from pagedserve.cluster.front.door import LiveRequests, admitted_headers
from pagedserve.cluster.front.edge import error, generation_error, remote_error
from pagedserve.cluster.front.merged_streams import merged, start_all
from pagedserve.cluster.front.openai.openai_format import ChoiceShaper, batch_response
from pagedserve.cluster.front.replica_client import ReplicaClient
from pagedserve.cluster.front.served_model import ServedModel
from pagedserve.cluster.front.sse_stream import sse_events
from pagedserve.cluster.wire.request import EngineRequest


class OpenAIServingCompletion:
    def __init__(self, engine, model: ServedModel, live: LiveRequests, client: ReplicaClient) -> None:
        self._engine = engine  # the replicas' Serve handle: tokenize, detokenize
        self._model = model
        self._live = live
        self._client = client

    async def create(self, body, rid: str, tenant):
        """The /v1/completions answer of ``body`` (live as ``rid``): JSON, SSE, or an error."""
        lora, bad = await self._model.resolve(body.model)
        if bad is not None:
            return bad
        info = await self._model.info()
        try:
            params = body.to_sampling_params()  # model-dependent checks: LLMEngine.make_request
            prompts = body.prompts()
        except ValueError as e:
            return error(400, str(e))
        if not body.add_special_tokens:  # vLLM's: the text without BOS etc.; tokenized here
            try:
                prompts = [p if isinstance(p, list) else await self._engine.tokenize.remote(p, None, False)
                           for p in prompts]
            except Exception as e:  # arrives wrapped (RayTaskError)
                return remote_error(e)
        model = self._model.response_name(info, lora)
        created = int(time.time())
        streams, adms = await self._start_all(rid, prompts, params, body, tenant, lora)
        if streams is None:
            return adms
        self._live.placed(rid, adms[0].replica_id)
        headers = admitted_headers(rid, adms[0])
        shapers = []
        for i, (p, adm) in enumerate(zip(prompts, adms)):
            echo = None
            if body.echo:
                truncated = params.truncate_prompt_tokens is not None and isinstance(p, str)
                echo = p if isinstance(p, str) and not truncated else \
                    await self._engine.detokenize.remote(adm.prompt_token_ids)
            shapers.append(ChoiceShaper(i, params.n, echo, body.logprobs, body.prompt_only))
        if body.stream:
            state = fmt.StreamState(rid, created, model, False, body.return_token_ids,
                                    body.return_tokens_as_token_ids, body.continuous_usage,
                                    logprobs=body.logprobs is not None)
            self._live.hold(rid)
            events = sse_events(streams, state, body.include_usage, self._model, self._live, shapers)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        finished = [False] * len(streams)
        finals: list = [None] * len(streams)
        token_text: dict[int, str] = {}
        try:
            async with aclosing(merged(streams, finished)) as items:
                async for i, (out, tt) in items:
                    finals[i] = shapers[i].shape(out)
                    token_text.update(tt or {})
        except asyncio.CancelledError:  # client went away: merged() cancelled the streams
            self._model.observe_abort(finished.count(False))
            raise
        except Exception as e:  # a lost replica no other took (Resumable), or the system's
            return generation_error(rid, e)
        for out in finals:
            self._model.observe(out)
        resp = batch_response(rid, created, model, finals, shapers, token_text, body.return_token_ids,
                              params.prompt_logprobs, body.return_tokens_as_token_ids)
        return JSONResponse(resp.model_dump(), headers=headers)

    async def _start_all(self, rid: str, prompts: list, params, body, tenant, lora):
        """Admit every prompt (concurrently); (streams, admissions) or (None, error response).
        ``lora``: the adapter the body's model names (None: the base model)."""
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        reqs = [EngineRequest(sub, p, params, body.priority, body.cache_salt, tenant=tenant, lora_request=lora)
                for sub, p in zip(ids, prompts)]
        return await start_all(self._client, reqs, whole=not body.stream, arrival=self._live.arrival(rid),
                               ids_shown=body.return_token_ids)
