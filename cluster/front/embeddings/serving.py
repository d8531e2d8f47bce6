"""/v1/embeddings, as vLLM's OpenAIServingEmbedding: one engine request per input, each
run by the pooling runner (its prompt only: prefill, chunked or not, batched with the
others by the scheduler, nothing sampled) and answered with its pooled hidden state.

    input: [t0, t1, t2] ──▶ start_all: generate(rid-0, t0, pooling) ... (replica_client.py)
                             one refused (400/429): the others are cancelled, that is the answer
                        ◀── each final RequestOutput's ``pooled`` (float32 LE bytes)
                        ──▶ {"object": "list", "data": [{"object": "embedding", "index": i,
                             "embedding": [floats] | "base64"}], "model", "usage"}

The model must be served by the pooling runner (``info()["runner"]``); a generation model
asked for embeddings is a 400 saying how to serve one (vLLM's words first). ``dimensions``
is checked here against the model's Matryoshka support (a 400 naming the field), and again
by the engine, which every other way in goes through.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from fastapi.responses import JSONResponse

from pagedserve.cluster.front.door import LiveRequests, admitted_headers
from pagedserve.cluster.front.edge import error, generation_error, remote_error
from pagedserve.cluster.front.embeddings.protocol import (EmbeddingData, EmbeddingRequest, EmbeddingResponse,
                                                          EmbeddingUsage, encode)
from pagedserve.cluster.front.merged_streams import merged, start_all
from pagedserve.cluster.front.replica_client import ReplicaClient
from pagedserve.cluster.front.served_model import ServedModel
from pagedserve.cluster.wire.request import EngineRequest
from pagedserve.scheduler.pooling_params import check_dimensions, runner_mismatch

_PARAMS = ("dimensions", "truncate_prompt_tokens", "use_activation", "normalize")


def _param(message: str) -> str | None:
    """The field a ValueError's message is about (the first it names)."""
    return next((p for p in _PARAMS if p in message), None)


class OpenAIServingEmbedding:
    def __init__(self, engine, model: ServedModel, live: LiveRequests, client: ReplicaClient) -> None:
        self._engine = engine  # the replicas' Serve handle: tokenize
        self._model = model
        self._live = live
        self._client = client

    async def create(self, body: EmbeddingRequest, rid: str, tenant):
        """The /v1/embeddings answer of ``body`` (live as ``rid``): JSON or an error."""
        lora, bad = await self._model.resolve(body.model)
        if bad is not None:
            return bad
        info = await self._model.info()
        name = info["served_model_name"]
        if info.get("runner") != "pooling":
            return error(400, runner_mismatch(name, pooling=True), param="model")
        if lora is not None:  # the pooling runner takes no adapters (config.check_pooling)
            return error(400, f"LoRA adapter {lora.lora_name!r}: embeddings run the base model only.", param="model")
        try:
            inputs = body.inputs()
        except ValueError as e:
            return error(400, str(e), param="input")
        try:
            params, pooling = body.to_params()
            check_dimensions(pooling.dimensions, name, info["embedding_size"], *info["matryoshka"])
        except ValueError as e:
            return error(400, str(e), param=_param(str(e)))
        if not body.add_special_tokens:  # vLLM's: the text without BOS etc.; tokenized here
            try:
                inputs = [p if isinstance(p, list) else await self._engine.tokenize.remote(p, None, False)
                          for p in inputs]
            except Exception as e:  # arrives wrapped (RayTaskError)
                return remote_error(e)
        ids = [rid] if len(inputs) == 1 else [f"{rid}-{i}" for i in range(len(inputs))]
        reqs = [EngineRequest(sub, p, params, body.priority, body.cache_salt, tenant=tenant, pooling=pooling)
                for sub, p in zip(ids, inputs)]
        streams, adms = await start_all(self._client, reqs, whole=True, arrival=self._live.arrival(rid),
                                        ids_shown=False)
        if streams is None:
            return adms
        self._live.placed(rid, adms[0].replica_id)
        finished = [False] * len(streams)
        finals: list = [None] * len(streams)
        try:
            async with aclosing(merged(streams, finished)) as items:
                async for i, (out, _) in items:
                    finals[i] = out
        except asyncio.CancelledError:  # client went away: merged() cancelled the streams
            self._model.observe_abort(finished.count(False))
            raise
        except Exception as e:  # a lost replica no other took (Resumable), or the system's
            return generation_error(rid, e)
        data = []
        for i, out in enumerate(finals):
            self._model.observe(out)
            if out is None or out.pooled is None:
                return generation_error(rid, RuntimeError(f"input {i} ended without an embedding"))
            data.append(EmbeddingData(index=i, embedding=encode(out.pooled, body.encoding_format)))
        num_tokens = sum(len(out.prompt_token_ids) for out in finals)
        resp = EmbeddingResponse(id=rid, model=name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
        return JSONResponse(resp.model_dump(), headers=admitted_headers(rid, adms[0]))
