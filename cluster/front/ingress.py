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
                       serving_models.py   /v1/models, LoRA adapters loaded at run time
                       sse_stream.py       a streamed body: chunks, in-band errors, [DONE]

The request's first item from a replica is its admission, so a 400/429 is known before
any 200 header is sent. Leaving early (client disconnect -> Serve cancels the handler, or
the SSE body is closed) cancels the engine call, which aborts the request there. Every
generating request is in the live list (door.py) from its route until its response, or
its SSE body, ends.
"""

# No ``from __future__ import annotations``: FastAPI must see real classes on the
# methods that serve.ingress rewrites, or bodies turn into query parameters.

import json
import logging

import pydantic

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve

from pagedserve import __version__
from pagedserve.cluster.front.beam_search import create_beam_search
from pagedserve.cluster.front.door import DASHBOARD_HTML, LiveRequests, request_object
from pagedserve.cluster.front.edge import (EdgeGuard, EdgeMiddleware, IngressConfig, activate, error,
                                           install_error_handlers, remote_error)
from pagedserve.cluster.front.embeddings.protocol import EmbeddingRequest, embedding_id
from pagedserve.cluster.front.embeddings.serving import OpenAIServingEmbedding
from pagedserve.cluster.front.replica_client import ReplicaClient
from pagedserve.cluster.front.responses.protocol import ResponsesRequest, response_id
from pagedserve.cluster.front.responses.serving import OpenAIServingResponses
from pagedserve.cluster.front.openai.schemas import (BatchChatCompletionRequest, ChatCompletionRequest,
                                               CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                               TokenizeRequest, TokenizeResponse, random_id)
from pagedserve.cluster.front.served_model import ServedModel
from pagedserve.cluster.front.serving_chat import OpenAIServingChat
from pagedserve.cluster.front.serving_completion import OpenAIServingCompletion
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


@serve.deployment(name="OpenAIIngress", num_replicas=1, max_ongoing_requests=4096,
                  ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine, stats, config: IngressConfig | None = None) -> None:
        serve_grpc_on_node_ip()  # before Serve starts this replica's gRPC server
        self.engine = engine
        self.stats = stats
        self.config = config or IngressConfig()
        self._model = ServedModel(engine)
        self._live = LiveRequests()  # id -> (tenant, replica) while the request lives
        self._client = ReplicaClient(engine, self._model, self._live, self.config.tokenize_for_router)
        self._completion = OpenAIServingCompletion(engine, self._model, self._live, self._client)
        self._chat = OpenAIServingChat(engine, self._model, self._live, self._client)
        self._responses = OpenAIServingResponses(self._chat, self._model, self._live)
        self._messages = AnthropicServingMessages(engine, self._model, self._live, self._chat)
        self._embedding = OpenAIServingEmbedding(engine, self._model, self._live, self._client)
        self._models = OpenAIServingModels(engine, self._model, self.config.allow_runtime_lora_updating)
        activate(EdgeGuard(self.config, self._model.max_model_len))

    async def info(self) -> dict:
        return await self._model.info()

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
        rid = random_id("chatcmpl" if chat else "cmpl")
        return await self._answer(body, request, rid, lambda b, r, t: self._create(b, chat, r, t))

    async def _create(self, body, chat: bool, rid: str, tenant):
        info = await self._model.info()
        if info.get("runner") == "pooling":  # an embedding model (the engine refuses it too)
            return error(400, runner_mismatch(info["served_model_name"], pooling=False,
                                              api="Chat Completions" if chat else "Completions"), param="model")
        try:
            width = body.beam_width()
        except ValueError as e:
            return error(400, str(e))
        if width is not None:  # cluster/front/beam_search.py
            return await create_beam_search(self.engine, self._model, self._client, body, chat, rid, tenant, width)
        serving = self._chat if chat else self._completion
        return await serving.create(body, rid, tenant)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        return await self._generate(body, chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        return await self._generate(body, chat=True, request=request)

    @app.post("/v1/chat/completions/batch")
    async def batch_chat_completions(self, body: BatchChatCompletionRequest, request: Request):
        return await self._answer(body, request, random_id("chatcmpl"), self._chat.create_batch)

    @app.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingRequest, request: Request):
        return await self._answer(body, request, embedding_id(), self._embedding.create)

    @app.post("/v1/messages")
    async def messages(self, request: Request):
        """Anthropic's Messages API over the chat path (anthropic/serving_messages.py), which
        validates the body itself: its 400s have Anthropic's shape."""
        return await self._messages.create(await request.body(), getattr(request.state, "tenant", None))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(self, request: Request):
        return await self._messages.count_tokens(await request.body())

    @app.post("/v1/responses")
    async def create_response(self, body: ResponsesRequest, request: Request):
        return await self._answer(body, request, response_id(), self._responses.create)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(self, response_id: str, request: Request):
        # OpenAI's replay of a stored stream (?stream=true&starting_after=N) is not served.
        asked = sorted(set(request.query_params) & {"stream", "starting_after", "include", "include[]"})
        if asked:
            return error(400, f"{asked[0]}: not implemented by this server (deploy/README.md)", param=asked[0])
        return self._responses.retrieve(response_id, getattr(request.state, "tenant", None))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request):
        return self._responses.delete(response_id, getattr(request.state, "tenant", None))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str, request: Request):
        return self._responses.cancel(response_id, getattr(request.state, "tenant", None))

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
        merged = await self.stats.merged.remote()
        for _ in range(4 * max(1, merged.get("num_replicas", 1))):
            # A batch's prompts are engine requests {id}-0, {id}-1, ...: the first speaks for it.
            st = (await self.engine.request_info.remote(request_id)
                  or await self.engine.request_info.remote(f"{request_id}-0"))
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
        return JSONResponse({"replicas": await self.stats.views.remote()})

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
    async def tokenizer_info(self):
        try:
            return JSONResponse(await self.engine.tokenizer_info.remote())
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
        return await self._client.health()  # a replica's answer, never cached info

    @app.get("/metrics")
    async def metrics(self):
        await self.info()
        merged = await self.stats.merged.remote()
        return Response(self._model.metrics.render(merged),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest):
        bad = await self._model.check_model(body.model)
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
            ids = await self.engine.tokenize.remote(body.prompt, messages, body.add_special_tokens, template, tools,
                                                    body.chat_template_kwargs)
            strs = await self.engine.token_strs.remote(ids) if body.return_token_strs else None
        except Exception as e:  # arrives wrapped (RayTaskError)
            return remote_error(e)
        info = await self.info()
        resp = TokenizeResponse(count=len(ids), max_model_len=info["max_model_len"], tokens=ids, token_strs=strs)
        return _with_unknown_fields(JSONResponse(resp.model_dump()), body)

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest):
        bad = await self._model.check_model(body.model)
        if bad is not None:
            return bad
        try:
            text = await self.engine.detokenize.remote(body.tokens)
        except Exception as e:  # arrives wrapped (RayTaskError)
            return remote_error(e)
        return _with_unknown_fields(JSONResponse(DetokenizeResponse(prompt=text).model_dump()), body)
