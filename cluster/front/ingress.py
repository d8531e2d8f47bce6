"""OpenAI-compatible HTTP routes (FastAPI under ``serve.ingress``): the Ray Serve ingress
deployment, as vLLM's api_server is to its serving objects.

Each route validates its body (pydantic -> 400) and hands it to the object that serves
its API family; what every route that generates shares sits in one object each:

    routes (this file) ─▶ serving_completion.py   /v1/completions: batches of prompts, echo
                       ─▶ serving_chat.py         /v1/chat/completions, its batch form
                       ─▶ beam_search.py          ``use_beam_search`` bodies of either
                       ─▶ responses/              /v1/responses (OpenAI's Responses API): a body
                                                  becomes a chat request, served by serving_chat
                       ─▶ anthropic/              /v1/messages (Anthropic's), translated to a chat
                       ─▶ embeddings/             /v1/embeddings: a pooling engine's vectors
                                │
                                ▼
                       replica_client.py   the connection to the engine replicas: the door's
                                           checks, the output channel, lifelines, failover
                       served_model.py     the replicas' info (404 for another model), metrics
                       serving_models.py   /v1/models, LoRA adapters loaded at run time,
                                           which model a request names
                       sse_stream.py       a streamed body: chunks, in-band errors, [DONE]

Several models (app.py build_openai_app): one ModelAPI per model, each over its own engine
deployment; a route picks one by the body's ``model`` (serving_models.py ``pick``) and hands
the body to that model's serving objects. /v1/models, /metrics and /health cover them all.

The request's first item from a replica is its admission, so a 400/429 is known before
any 200 header is sent. Leaving early (client disconnect -> Serve cancels the handler, or
the SSE body is closed) cancels the engine call, which aborts the request there. Every
generating request is in the live list (door.py) from its route until its response, or
its SSE body, ends.
"""

# No ``from __future__ import annotations``: FastAPI must see real classes on the
# methods that serve.ingress rewrites, or bodies turn into query parameters.

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import pydantic

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve

from pagedserve import __version__
from pagedserve.cluster.front.beam_search import create_beam_search
from pagedserve.cluster.front.door import DASHBOARD_HTML, LiveRequests, request_object
from pagedserve.cluster.front.metrics import render_models
from pagedserve.cluster.front.edge import (EdgeGuard, EdgeMiddleware, ErrorJSONResponse, IngressConfig, activate,
                                           error, install_error_handlers, remote_error)
from pagedserve.cluster.front.embeddings.protocol import EmbeddingRequest, embedding_id
from pagedserve.cluster.front.embeddings.serving import OpenAIServingEmbedding
from pagedserve.cluster.front.replica_client import ReplicaClient
from pagedserve.cluster.front.responses.protocol import ResponsesRequest, response_id
from pagedserve.cluster.front.responses.serving import OpenAIServingResponses
from pagedserve.cluster.front.responses.store import ResponseStore
from pagedserve.cluster.front.openai.schemas import (BatchChatCompletionRequest, ChatCompletionRequest,
                                               CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                               TokenizeRequest, TokenizeResponse, random_id)
from pagedserve.cluster.front.served_model import ServedModel
from pagedserve.cluster.front.serving_chat import OpenAIServingChat
from pagedserve.cluster.front.serving_completion import OpenAIServingCompletion
from pagedserve.cluster.front.anthropic import anthropic_format
from pagedserve.cluster.front.anthropic.serving_messages import AnthropicServingMessages
from pagedserve.cluster.front.serving_models import OpenAIServingModels
from pagedserve.cluster.ray_utils import serve_grpc_on_node_ip
from pagedserve.scheduler.pooling_params import runner_mismatch


logger = logging.getLogger("pagedserve")
# The body's fields that no OpenAI or vLLM schema has: accepted, logged and named here
# (schemas.NOT_IMPLEMENTED says which known ones are refused instead).
IGNORED_HEADER = "x-pagedserve-ignored-fields"
MAX_IGNORED_NAMED = 32  # a body of thousands of unknown keys names the first ones


app = FastAPI(title="pagedserve", description="OpenAI-compatible API over pagedserve engines")
install_error_handlers(app)
app.add_middleware(EdgeMiddleware)


def _with_unknown_fields(response: Response, body, rid: str | None = None) -> Response:
    """``response`` naming the fields of ``body`` that it ignored, if any (logged too)."""
    names = body.unknown_fields()
    if names:
        shown = [n.encode("ascii", "backslashreplace").decode()[:100] for n in names[:MAX_IGNORED_NAMED]]
        text = ", ".join(shown) + (f", ... ({len(names)} in all)" if len(names) > len(shown) else "")
        logger.warning("request %s: ignored field(s) no OpenAI or vLLM schema has: %s", rid or "-", text)
        response.headers[IGNORED_HEADER] = "".join(c if c.isprintable() else "?" for c in text)
    return response


@dataclass(slots=True)
class ModelAPI:
    """One served model's side of the front: its engine deployment's handle, its stats
    aggregator, and one serving object per API family over them."""
    engine: Any
    stats: Any
    model: ServedModel
    client: ReplicaClient
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    responses: OpenAIServingResponses
    messages: AnthropicServingMessages
    embedding: OpenAIServingEmbedding

    @classmethod
    def over(cls, engine, stats, live: LiveRequests, tokenize_for_router: bool, store: ResponseStore) -> "ModelAPI":
        model = ServedModel(engine)
        client = ReplicaClient(engine, model, live, tokenize_for_router)
        chat = OpenAIServingChat(engine, model, live, client)
        return cls(engine, stats, model, client, OpenAIServingCompletion(engine, model, live, client), chat,
                   OpenAIServingResponses(chat, model, live, store), AnthropicServingMessages(engine, model, live, chat),
                   OpenAIServingEmbedding(engine, model, live, client))


def _body_model(raw: bytes) -> str | None:
    """The ``model`` of a JSON body not validated yet (None: none to read)."""
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


@serve.deployment(name="OpenAIIngress", num_replicas=1, max_ongoing_requests=4096,
                  ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine, stats, config: IngressConfig | None = None) -> None:
        """``engine``, ``stats``: one model's engine deployment and stats aggregator, or a
        list of each, one per model (app.py build_openai_app)."""
        serve_grpc_on_node_ip()  # before Serve starts this replica's gRPC server
        engines = engine if isinstance(engine, list) else [engine]
        stats_handles = stats if isinstance(stats, list) else [stats]
        self.config = config or IngressConfig()
        kv = self.config.tokenize_for_router
        kv = kv if isinstance(kv, tuple) else (kv,) * len(engines)
        self._live = LiveRequests()  # id -> (tenant, replica) while the request lives
        store = ResponseStore()  # one for all models: a follow-up may name another model
        self._apis = [ModelAPI.over(e, s, self._live, k, store) for e, s, k in zip(engines, stats_handles, kv)]
        self._models = OpenAIServingModels(engines, [a.model for a in self._apis],
                                           self.config.allow_runtime_lora_updating)
        activate(EdgeGuard(self.config, self._max_model_len))

    async def _max_model_len(self) -> int:
        return max(await asyncio.gather(*(a.model.max_model_len() for a in self._apis)))

    async def info(self) -> dict:
        return await self._apis[0].model.info()

    async def _api(self, model: str | None) -> tuple[ModelAPI | None, JSONResponse | None]:
        """The model a body's ``model`` names (serving_models.py ``pick``), or the 400/404."""
        k, bad = await self._models.pick(model)
        return (None, bad) if bad is not None else (self._apis[k], None)

    async def _answer(self, body, request: Request, rid: str, serve):
        """``serve(body, rid, tenant)``: the request is live (door.py) from here until its
        answer, a stream until its body generator ends."""
        tenant = getattr(request.state, "tenant", None)
        self._live.add(rid, tenant)
        try:
            response = await serve(body, rid, tenant)
        finally:
            self._live.release(rid)  # a stream keeps it until its body generator ends
        return _with_unknown_fields(response, body, rid)

    async def _generate(self, body, chat: bool, request: Request):
        api, bad = await self._api(body.model)
        if bad is not None:
            return bad
        rid = random_id("chatcmpl" if chat else "cmpl")
        return await self._answer(body, request, rid, lambda b, r, t: self._create(api, b, chat, r, t))

    async def _create(self, api: ModelAPI, body, chat: bool, rid: str, tenant):
        info = await api.model.info()
        if info.get("runner") == "pooling":  # an embedding model (the engine refuses it too)
            return error(400, runner_mismatch(info["served_model_name"], pooling=False,
                                              api="Chat Completions" if chat else "Completions"), param="model")
        try:
            width = body.beam_width()
        except ValueError as e:
            return error(400, str(e))
        if width is not None:  # cluster/front/beam_search.py
            return await create_beam_search(api.engine, api.model, api.client, body, chat, rid, tenant, width)
        serving = api.chat if chat else api.completion
        return await serving.create(body, rid, tenant)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        return await self._generate(body, chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        return await self._generate(body, chat=True, request=request)

    @app.post("/v1/chat/completions/batch")
    async def batch_chat_completions(self, body: BatchChatCompletionRequest, request: Request):
        api, bad = await self._api(body.model)
        if bad is not None:
            return bad
        return await self._answer(body, request, random_id("chatcmpl"), api.chat.create_batch)

    @app.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingRequest, request: Request):
        api, bad = await self._api(body.model)
        if bad is not None:
            return bad
        return await self._answer(body, request, embedding_id(), api.embedding.create)

    async def _messages_api(self, raw: bytes) -> tuple[ModelAPI | None, JSONResponse | None]:
        """The model an Anthropic body names, or the 400/404 in Anthropic's shape. A body
        without a readable model goes to the first, whose validation names what is wrong."""
        model = _body_model(raw)
        if model is None:
            return self._apis[0], None
        api, bad = await self._api(model)
        if bad is None:
            return api, None
        info = json.loads(bad.body)
        return None, ErrorJSONResponse(anthropic_format.from_openai_error(bad.status_code, info),
                                       status_code=bad.status_code)

    @app.post("/v1/messages")
    async def messages(self, request: Request):
        """Anthropic's Messages API over the chat path (anthropic/serving_messages.py), which
        validates the body itself: its 400s have Anthropic's shape."""
        raw = await request.body()
        api, bad = await self._messages_api(raw)
        return bad if bad is not None else await api.messages.create(raw, getattr(request.state, "tenant", None))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(self, request: Request):
        raw = await request.body()
        api, bad = await self._messages_api(raw)
        return bad if bad is not None else await api.messages.count_tokens(raw)

    @app.post("/v1/responses")
    async def create_response(self, body: ResponsesRequest, request: Request):
        api, bad = await self._api(body.model)
        if bad is not None:
            return bad
        return await self._answer(body, request, response_id(), api.responses.create)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(self, response_id: str, request: Request):
        # OpenAI's replay of a stored stream (?stream=true&starting_after=N) is not served.
        asked = sorted(set(request.query_params) & {"stream", "starting_after", "include", "include[]"})
        if asked:
            return error(400, f"{asked[0]}: not implemented by this server (deploy/README.md)", param=asked[0])
        return self._apis[0].responses.retrieve(response_id, getattr(request.state, "tenant", None))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request):
        return self._apis[0].responses.delete(response_id, getattr(request.state, "tenant", None))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str, request: Request):
        return self._apis[0].responses.cancel(response_id, getattr(request.state, "tenant", None))

    @app.post("/invocations")
    async def invocations(self, request: Request):
        """SageMaker's entry, as vLLM serves it: a body with ``messages`` is a chat
        completion, one with ``prompt`` a completion."""
        try:
            data = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            return error(400, f"the body is not valid JSON ({e})")
        kind = (None if not isinstance(data, dict) else ChatCompletionRequest if "messages" in data
                else CompletionRequest if "prompt" in data else None)
        if kind is None:
            return error(400, "Cannot find suitable handler for request. Expected one of: "
                              "['ChatCompletionRequest', 'CompletionRequest'] (a body with `messages` or `prompt`).")
        try:
            body = kind.model_validate(data)
        except pydantic.ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        return await self._generate(body, chat=kind is ChatCompletionRequest, request=request)

    @app.get("/v1/requests/{request_id}")
    async def request_status(self, request_id: str, request: Request):
        """Where a live request stands. Only its own tenant sees it (404 for anyone else,
        the same answer as for an id that never was, so ids of others cannot be probed)."""
        live = self._live.get(request_id)
        if live is None or live[0] != getattr(request.state, "tenant", None):
            return error(404, f"no live request {request_id!r} (finished, or never was)",
                         param="request_id")
        # A Serve handle cannot pick the replica: ask until the one holding it answers
        # (one replica by default; with k, each try hits it with chance ~1/k).
        if live[1] is None:  # accepted by the ingress, not yet by a replica (tokenizing)
            return JSONResponse(request_object(request_id, {"status": "admitting", "tenant": live[0]}))
        for api in self._apis:  # which model's it is, the live table does not say
            merged = await api.stats.merged.remote()
            for _ in range(4 * max(1, merged.get("num_replicas", 1))):
                # A batch's prompts are engine requests {id}-0, {id}-1, ...: the first speaks for it.
                st = (await api.engine.request_info.remote(request_id)
                      or await api.engine.request_info.remote(f"{request_id}-0"))
                if st is not None:
                    return JSONResponse(request_object(request_id, st))
                if self._live.get(request_id) is None:
                    break  # it just finished
        return error(404, f"request {request_id!r} is not in any replica's queue or batch now",
                     param="request_id")

    @app.get("/dashboard")
    async def dashboard(self):
        return HTMLResponse(DASHBOARD_HTML)

    @app.get("/dashboard/state")
    async def dashboard_state(self):
        views = await asyncio.gather(*(a.stats.views.remote() for a in self._apis))
        return JSONResponse({"replicas": {rid: v for view in views for rid, v in view.items()}})

    # ------------------------------------------------------------ the rest
    @app.get("/v1/models")
    async def models(self):
        return await self._models.list_models()  # the base model and its LoRA adapters

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, body: dict):
        return await self._models.load_lora_adapter(body)  # 404 unless VLLM_ALLOW_RUNTIME_LORA_UPDATING

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, body: dict):
        return await self._models.unload_lora_adapter(body)

    @app.get("/version")
    async def version(self):
        return JSONResponse({"version": __version__})  # vLLM's shape

    @app.get("/load")
    async def load(self):
        """vLLM's server-load figure: the generation requests this front holds now."""
        return JSONResponse({"server_load": len(self._live)})

    @app.get("/tokenizer_info")
    async def tokenizer_info(self, model: str | None = None):
        api, bad = await self._api(model)  # ?model=: which model's, where several are served
        if bad is not None:
            return bad
        try:
            return JSONResponse(await api.engine.tokenizer_info.remote())
        except Exception as e:  # arrives wrapped (RayTaskError)
            return remote_error(e)

    @app.get("/ping")
    async def ping(self):
        return await self.health()  # SageMaker's name for it (vLLM serves both)

    @app.post("/ping")
    async def ping_post(self):
        return await self.health()

    @app.get("/health")
    async def health(self):
        for api in self._apis:  # every model's: a replica's answer, never cached info
            answer = await api.client.health()
            if answer.status_code != 200:
                return answer
        return answer

    @app.get("/metrics")
    async def metrics(self):
        await asyncio.gather(*(a.model.info() for a in self._apis))
        merged = await asyncio.gather(*(a.stats.merged.remote() for a in self._apis))
        return Response(render_models([(a.model.metrics, m) for a, m in zip(self._apis, merged)]),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest):
        api, bad = await self._api(body.model)
        if bad is None:
            bad = await api.model.check_model(body.model)
        if bad is not None:
            return bad
        if (body.prompt is None) == (body.messages is None):
            return error(400, "give exactly one of `prompt` or `messages`.")
        try:
            messages = None if body.messages is None else [m.template_dict() for m in body.messages]
            template = body.template_mode()
        except ValueError as e:
            return error(400, str(e))
        try:
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            ids = await api.engine.tokenize.remote(body.prompt, messages, body.add_special_tokens, template, tools,
                                                    body.chat_template_kwargs)
            strs = await api.engine.token_strs.remote(ids) if body.return_token_strs else None
        except Exception as e:  # arrives wrapped (RayTaskError)
            return remote_error(e)
        info = await api.model.info()
        resp = TokenizeResponse(count=len(ids), max_model_len=info["max_model_len"], tokens=ids, token_strs=strs)
        return _with_unknown_fields(JSONResponse(resp.model_dump()), body)

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest):
        api, bad = await self._api(body.model)
        if bad is None:
            bad = await api.model.check_model(body.model)
        if bad is not None:
            return bad
        try:
            text = await api.engine.detokenize.remote(body.tokens)
        except Exception as e:  # arrives wrapped (RayTaskError)
            return remote_error(e)
        return _with_unknown_fields(JSONResponse(DetokenizeResponse(prompt=text).model_dump()), body)
