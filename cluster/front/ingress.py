"""OpenAI-compatible HTTP ingress (FastAPI under ``serve.ingress``).

It validates (pydantic -> 400), checks the model name (404), forwards the request to an
engine replica through a streaming Serve handle, and turns the outputs into a JSON body
or SSE. The outputs come on this replica's output channel (cluster/wire/output_channel.py;
one message per engine step); the handle call carries the admission, the end or the
failure. The call's first item is the engine's admission decision, so a 400/429 is known before any
200 header is sent. Leaving early (client disconnect -> Serve cancels this handler,
or the SSE generator is closed) cancels the engine call, which aborts the request there.

A lost replica (its process or node died: its lifeline, cluster/wire/lifeline.py, ends)
is routed around at once (cluster/front/routing.py, lost_replicas.py). Its requests that
have sent the client nothing yet are tried again on another replica (failover.py); a
stream that has sent tokens ends with an in-band 503 naming the replica.

/v1/completions: one engine request per prompt of a batch, answered as one response.

    prompt: [p0, p1, p2] ──▶ engine.generate(rid-0, p0) ─┐  each admitted on its own;
                        ──▶ engine.generate(rid-1, p1) ─┼─ one refused (400/429): the
                        ──▶ engine.generate(rid-2, p2) ─┘  others are cancelled, that answer
                                        │ merged as they come: (prompt index, output)
                                        ▼
                        choices i * n + j (openai_format.py); one JSON body, or SSE
                        with one [DONE] and, with include_usage, usage summed over prompts

A single prompt keeps the request id as its engine id. Every way out (client gone,
the SSE generator closed, a failure) cancels the engine streams that have not
finished, so no prompt of a batch keeps its blocks.
"""

# No ``from __future__ import annotations``: FastAPI must see real classes on the
# methods that serve.ingress rewrites, or bodies turn into query parameters.

import asyncio
import json
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass

import pydantic

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from ray import serve

from pagedserve import __version__
from pagedserve.cluster.front import openai_format as fmt
from pagedserve.cluster.front.door import (DASHBOARD_HTML, FrontLimit, LiveRequests, ShedGate, queue_header,
                                           request_object)
from pagedserve.cluster.front.edge import (EdgeGuard, EdgeMiddleware, IngressConfig, activate, error,
                                           install_error_handlers, remote_error)
from pagedserve.cluster.front.metrics import ServeMetrics
from pagedserve.cluster.front.failover import MAX_ATTEMPTS, Resumable, admission
from pagedserve.cluster.front.lost_replicas import mark_lost
from pagedserve.cluster.front.prompt_tokens import PromptTokens
from pagedserve.cluster.front.openai_format import ChoiceShaper, batch_response, combined, prompt_logprobs_json
from pagedserve.cluster.front.beam_search import create_beam_search
from pagedserve.cluster.front.schemas import (BatchChatCompletionRequest, ChatCompletionRequest,
                                               ChatCompletionResponse, CompletionRequest, DetokenizeRequest,
                                               DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                                               TokenizeResponse, UsageInfo, random_id)
from pagedserve.cluster.front.tenants import DEFAULT_TENANT
from pagedserve.cluster.front.tool_choice import constrain_to_schema, tool_plan
from pagedserve.cluster.ray_utils import bind_host, serve_grpc_on_node_ip
from pagedserve.cluster.wire.failures import ReplicaLost
from pagedserve.cluster.wire.lifeline import LifelineWatch
from pagedserve.cluster.wire.output_channel import OutputChannel
from pagedserve.cluster.wire.request import GenerateRequest
from pagedserve.cluster.wire.stream import Accumulated


logger = logging.getLogger("pagedserve")
REPLICA_HEADER = "x-pagedserve-replica"
REQUEST_ID_HEADER = "x-pagedserve-request-id"  # Serve sets x-request-id itself
QUEUE_HEADER = "x-pagedserve-queue"  # why-waiting at admission (door.py)
# The body's fields that no OpenAI or vLLM schema has: accepted, logged and named here
# (schemas.NOT_IMPLEMENTED says which known ones are refused instead).
IGNORED_HEADER = "x-pagedserve-ignored-fields"
MAX_IGNORED_NAMED = 32  # a body of thousands of unknown keys names the first ones
HEALTH_TIMEOUT_S = 5.0  # /health: an engine that does not answer within this is unhealthy
# How often the front looks whether the Ray cluster has grown past one node (its output
# channel then listens on the node's address too: ray_utils.bind_host).
BIND_RECHECK_S = 10.0


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
class _ChatStarted:
    """A chat request admitted by a replica, before its outputs are read."""

    rid: str
    stream: object
    params: object
    plan: object  # tool_choice.ToolPlan or None
    echo: str
    model: str
    created: int
    headers: dict


# ---- /v1/completions: one engine request per prompt of a batch (the route is below)
async def _start_all(ingress, rid: str, prompts: list, params, body, tenant):
    """Admit every prompt (concurrently); (streams, admissions) or (None, error response)."""
    ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    arrival = ingress._live.arrival(rid)
    tasks = [asyncio.ensure_future(ingress._start(sub, p, params, body, None, tenant, arrival=arrival))
             for sub, p in zip(ids, prompts)]
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError:  # the client left while we were admitting
        _drop(tasks)
        raise
    results = [t.result() if not t.exception() else (None, t.exception()) for t in tasks]
    refused = [r for s, r in results if s is None]
    if not refused:
        return [s for s, _ in results], [a for _, a in results]
    for s, _ in results:
        if s is not None:
            s.cancel()
    if isinstance(refused[0], BaseException):
        raise refused[0]
    return None, refused[0]


def _drop(tasks) -> None:
    for t in tasks:
        if not t.done():
            t.cancel()  # _start cancels its own stream
        elif not t.cancelled() and t.exception() is None and t.result()[0] is not None:
            t.result()[0].cancel()


async def _merged(streams, finished: list[bool]):
    """(prompt index, (RequestOutput, token_text)) from every stream, as they come."""
    if len(streams) == 1:
        # One prompt: read it as the caller reads, with no pump in between: the steps its
        # reader missed come merged into one item (ChannelStream).
        try:
            async for item in streams[0]:
                finished[0] = item[0].finished
                yield 0, item
        finally:
            if not finished[0]:
                streams[0].cancel()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, _END))
        except BaseException as e:  # re-raised by the consumer, which would wait forever else
            queue.put_nowait((i, e))
            if isinstance(e, asyncio.CancelledError):
                raise

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is _END:
                left -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            finished[i] = item[0].finished
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s, done in zip(streams, finished):
            if not done:
                s.cancel()  # the engine aborts that prompt's request


async def create_completion(ingress, body, rid: str, tenant):
    """The /v1/completions handler body (OpenAIIngress._generate_as for non-chat)."""
    bad = await ingress._check_model(body.model)
    if bad is not None:
        return bad
    info = await ingress.info()
    try:
        params = body.to_sampling_params()  # model-dependent checks: LLMEngine.make_request
        prompts = body.prompts()
    except ValueError as e:
        return error(400, str(e))
    if not body.add_special_tokens:  # vLLM's: the text without BOS etc.; tokenized here
        try:
            prompts = [p if isinstance(p, list) else await ingress.engine.tokenize.remote(p, None, False)
                       for p in prompts]
        except Exception as e:  # arrives wrapped (RayTaskError)
            return remote_error(e)
    model = info["served_model_name"]
    created = int(time.time())
    streams, adms = await _start_all(ingress, rid, prompts, params, body, tenant)
    if streams is None:
        return adms
    ingress._live.placed(rid, adms[0].replica_id)
    headers = {"x-pagedserve-replica": adms[0].replica_id, "x-pagedserve-request-id": rid}
    queued = queue_header(adms[0].queue)
    if queued is not None:
        headers["x-pagedserve-queue"] = queued
    shapers = []
    for i, (p, adm) in enumerate(zip(prompts, adms)):
        echo = None
        if body.echo:
            truncated = params.truncate_prompt_tokens is not None and isinstance(p, str)
            echo = p if isinstance(p, str) and not truncated else \
                await ingress.engine.detokenize.remote(adm.prompt_token_ids)
        shapers.append(ChoiceShaper(i, params.n, echo, body.logprobs, body.prompt_only))
    finished = [False] * len(streams)
    if body.stream:
        state = fmt.StreamState(rid, created, model, False, body.return_token_ids,
                                body.return_tokens_as_token_ids, body.continuous_usage)
        ingress._live.hold(rid)
        return StreamingResponse(_sse(ingress, streams, finished, shapers, state, body.include_usage),
                                 media_type="text/event-stream", headers=headers)
    finals: list = [None] * len(streams)
    token_text: dict[int, str] = {}
    try:
        async with aclosing(_merged(streams, finished)) as merged:
            async for i, (out, tt) in merged:
                finals[i] = shapers[i].shape(out)
                token_text.update(tt or {})
    except asyncio.CancelledError:  # client went away: _merged cancelled the streams
        raise
    except ReplicaLost as e:  # and no other replica took it (Resumable)
        return error(503, f"{e}; request {rid} could not be completed elsewhere", 1)
    except Exception:  # a system error: logged with the request id, this request only
        logger.exception("request %s failed", rid)
        return error(500, f"internal error while generating request {rid}; see the server log")
    for out in finals:
        ingress._observe(out)
    resp = batch_response(rid, created, model, finals, shapers, token_text, body.return_token_ids,
                          params.prompt_logprobs, body.return_tokens_as_token_ids)
    return JSONResponse(resp.model_dump(exclude_none=True), headers=headers)


async def _sse(ingress, streams, finished, shapers, state: fmt.StreamState, include_usage: bool):
    finals: list = [None] * len(streams)
    try:
        try:
            # aclosing: a client that leaves closes this generator at a yield; the merge
            # must then cancel the unfinished streams now, not when it is collected.
            async with aclosing(_merged(streams, finished)) as merged:
                async for i, (out, tt) in merged:
                    finals[i] = shaped = shapers[i].shape(out)
                    for line in state.chunks(shaped, tt or {}):
                        yield line
        except ReplicaLost as e:  # tokens were sent: it cannot move (Resumable)
            logger.warning("request %s: %s mid-stream", state.rid, e)
            for line in fmt.sse_failure(state.rid, 503, f"{e}; request {state.rid} ended mid-stream"):
                yield line
            return
        except Exception:  # headers are gone: report in-band, as vLLM does
            logger.exception("request %s failed mid-stream", state.rid)
            for line in fmt.sse_failure(state.rid):
                yield line
            return
        if include_usage:
            yield state.usage_chunk(combined(state.rid, finals))
        yield fmt.SSE_DONE
        for out in finals:
            ingress._observe(out)
    finally:
        ingress._live.release(state.rid)


@serve.deployment(name="OpenAIIngress", num_replicas=1, max_ongoing_requests=4096,
                  ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine, stats, config: IngressConfig | None = None) -> None:
        serve_grpc_on_node_ip()  # before Serve starts this replica's gRPC server
        self.engine = engine
        self.stats = stats
        self.config = config or IngressConfig()
        self._info: dict | None = None
        self._metrics: ServeMetrics | None = None
        self._live = LiveRequests()  # id -> (tenant, replica) while the request lives
        self._gate = ShedGate()  # replicas' recent 429s: refuse at the door while all shed
        self._limit = FrontLimit()  # requests in flight here, bound while they wait to reach a replica
        self._channel: OutputChannel | None = None  # made on the loop that reads it
        self._lifelines: dict[str, LifelineWatch | None] = {}  # replica id -> its watch; None: dead
        self._loss: asyncio.Future | None = None  # done when a replica is lost; then renewed
        self._bind_checked = 0.0  # when the channel's address was last chosen (BIND_RECHECK_S)
        # The KV router scores replicas on token ids: the prompt is tokenized here, once.
        self._tokens = PromptTokens(self.info) if self.config.tokenize_for_router else None
        activate(EdgeGuard(self.config, self._max_model_len))

    async def _max_model_len(self) -> int:
        return (await self.info())["max_model_len"]

    async def info(self) -> dict:
        if self._info is None:
            self._info = await self.engine.info.remote()
            self._metrics = ServeMetrics(self._info["served_model_name"], self._info.get("kv_sizing"))
        return self._info

    async def _check_model(self, model: str | None) -> JSONResponse | None:
        info = await self.info()
        if model is not None and model != info["served_model_name"]:
            return error(404, f"The model `{model}` does not exist. "
                              f"Available: `{info['served_model_name']}`.")
        return None

    # ------------------------------------------------------------ generation
    async def _start(self, rid: str, prompt, params, body, messages=None, tenant=None,
                     template: bool | str = True, tools=None, arrival: float | None = None):
        """Open the engine stream; return (stream, admission) or (None, error response).
        ``template``: what the chat template appends (ChatCompletionRequest.template_mode);
        ``arrival``: when this front took the request (its TTFT starts there). A request
        whose replica is lost before it has sent anything is tried on another (Resumable)."""
        if self._tokens is not None:
            try:
                ids = await self._tokens.encode(prompt, messages, template, tools,
                                                params.truncate_prompt_tokens is not None)
            except ValueError as e:
                return None, error(400, str(e))
            if ids is not None:
                prompt, messages = ids, None

        async def again(retry: bool = False):
            for attempt in range(MAX_ATTEMPTS):
                try:
                    return await self._start_once(rid, prompt, params, body, messages, tenant, template,
                                                  tools, arrival, retry or attempt > 0)
                except ReplicaLost as e:
                    if attempt + 1 == MAX_ATTEMPTS:
                        return None, error(503, f"{e}; no replica took the request {rid}", 1)
                    logger.warning("%s while request %s waited for admission; trying again", e, rid)
                    if self._metrics is not None:
                        self._metrics.requests_retried.inc()

        async def resume():
            if self._metrics is not None:
                self._metrics.requests_retried.inc()
            return await again(retry=True)

        stream, adm = await again()
        if stream is None:
            return None, adm
        resumable = Resumable(stream, adm, resume, not body.stream,
                              lambda a: self._live.placed(rid, a.replica_id))
        return resumable, adm

    async def _start_once(self, rid: str, prompt, params, body, messages, tenant, template, tools, arrival,
                          retry: bool = False):
        """One try. ``retry``: its replica was lost: the door let it in once already, and
        its wait so far is the loss's, not a queue's (the front limit does not see it)."""
        who = tenant or DEFAULT_TENANT
        now = time.monotonic()
        # (This request is in the live list already: the others are one fewer.)
        shed = None if retry else self._gate.refuse(now, who) or self._limit.refuse(
            now, len(self._live) - 1, lambda: self._live.tenant_share(tenant))
        if shed is not None:  # every replica is shedding (this tenant): no trip (door.py)
            if self._metrics is not None:
                self._metrics.shed_at_ingress.inc()
            return None, error(429, shed[0], shed[1])
        if self._channel is None:  # the outputs' way back: cluster/wire/output_channel.py
            self._channel = OutputChannel(bind_host())
            self._loss = asyncio.get_running_loop().create_future()
            self._bind_checked = now
        elif now - self._bind_checked > BIND_RECHECK_S:
            self._bind_checked = now
            asyncio.ensure_future(self._recheck_bind())  # a GCS call: never on this loop
        sub = self._channel.open(rid, arrival, self._first_output)
        req = GenerateRequest(rid, prompt, params, body.priority, body.cache_salt, messages, template, tenant, tools)
        stream = self.engine.options(stream=True).generate.remote(req, output_route=self._channel.route)
        try:
            adm = await admission(rid, stream, lambda: self._loss)
        except BaseException as e:
            sub.close()
            if isinstance(e, (asyncio.CancelledError, ReplicaLost)):
                stream.cancel()
            raise
        if arrival is not None and not retry:  # the wait before the replica: the front limit's signal
            now = time.monotonic()
            self._limit.observe(max(0.0, now - arrival - adm.replica_s), now)
        if not adm.accepted:
            sub.close()
            if adm.status == 429:
                self._gate.refused(adm.replica_id, adm.shed_s, time.monotonic(), adm.shed_tenant)
            return None, error(adm.status, adm.message, adm.retry_after_s)
        self._gate.accepted(adm.replica_id, time.monotonic(), who)
        self._watch(adm)
        if self._lifelines.get(adm.replica_id) is None and adm.lifeline is not None:
            sub.close()  # admitted by a replica this front has just seen die
            stream.cancel()
            raise ReplicaLost(adm.replica_id, "lost before its admission was read")
        return Accumulated(sub.attach(stream, adm.replica_id)), adm

    async def _recheck_bind(self) -> None:
        try:
            host = await asyncio.to_thread(bind_host)
        except Exception:  # the GCS is away: keep the address, look again later
            logger.debug("bind_host failed", exc_info=True)
            return
        self._channel.listen_on(host)

    def _watch(self, adm) -> None:
        """Watch the lifeline of a replica this front has not watched yet."""
        if adm.lifeline is None or adm.replica_id in self._lifelines:
            return
        self._lifelines[adm.replica_id] = LifelineWatch(adm.replica_id, adm.lifeline, self._replica_lost)

    def _replica_lost(self, replica_id: str, reason: str) -> None:
        """A replica's lifeline ended: route nothing more there, fail or retry what it held."""
        self._lifelines[replica_id] = None  # seen dead: never watched again
        mark_lost(replica_id)
        n = self._channel.fail_replica(replica_id, ReplicaLost(replica_id, reason))
        logger.warning("engine replica %s lost (%s): %d requests in flight there", replica_id, reason, n)
        if self._metrics is not None:
            self._metrics.replicas_lost.inc()
        loss, self._loss = self._loss, asyncio.get_running_loop().create_future()
        loss.set_result(replica_id)

    async def _generate(self, body, chat: bool, request: Request):
        tenant = getattr(request.state, "tenant", None)
        rid = random_id("chatcmpl" if chat else "cmpl")
        self._live.add(rid, tenant)
        try:
            response = await self._generate_as(body, chat, rid, tenant)
        finally:
            self._live.release(rid)  # a stream keeps it until its body generator ends
        return _with_unknown_fields(response, body, rid)

    async def _generate_as(self, body, chat: bool, rid: str, tenant):
        try:
            width = body.beam_width()
        except ValueError as e:
            return error(400, str(e))
        if width is not None:  # cluster/front/beam_search.py
            return await create_beam_search(self, body, chat, rid, tenant, width)
        if not chat:  # batches of prompts, echo: cluster/front/ingress.py
            return await create_completion(self, body, rid, tenant)
        started = await self._chat_start(body, rid, tenant)
        if not isinstance(started, _ChatStarted):
            return started
        if body.stream:
            state = fmt.StreamState(rid, started.created, started.model, True, body.return_token_ids,
                                    body.return_tokens_as_token_ids, body.continuous_usage, started.plan,
                                    started.echo)
            self._live.hold(rid)
            return StreamingResponse(self._sse(started.stream, state, body.include_usage),
                                     media_type="text/event-stream", headers=started.headers)
        resp = await self._chat_collect(body, started)
        if not isinstance(resp, ChatCompletionResponse):
            return resp
        return JSONResponse(resp.model_dump(exclude_none=True), headers=started.headers)

    async def _chat_start(self, body, rid: str, tenant, arrival: float | None = None):
        """Admit one chat request: _ChatStarted, or the error response. ``arrival``: when
        the front took it (default: the live entry of ``rid``)."""
        bad = await self._check_model(body.model)
        if bad is not None:
            return bad
        info = await self.info()
        plan = None  # tool_choice.py: how tools are used, if at all
        try:
            params = body.to_sampling_params()  # model-dependent checks: LLMEngine.make_request
            prompt, messages = None, [m.template_dict() for m in body.messages]
            template, echo = body.template_mode(), body.echo_text()
            plan = tool_plan(body, info.get("chat_template_tools", False))
            if plan is not None and plan.schema is not None:
                constrain_to_schema(params, plan.schema)
        except ValueError as e:
            return error(400, str(e))
        tools = plan.tools if plan is not None else None
        if body.add_special_tokens:  # the tokenizer's BOS etc. on top of the template's (vLLM)
            try:
                prompt = await self.engine.tokenize.remote(None, messages, True, template, tools)
            except Exception as e:  # arrives wrapped (RayTaskError)
                return remote_error(e)
            messages = None
        stream, adm = await self._start(rid, prompt, params, body, messages, tenant, template, tools,
                                        arrival if arrival is not None else self._live.arrival(rid))
        if stream is None:
            return adm
        # The id as GET /v1/requests/{id} takes it, before a streamed body names it.
        headers = {REPLICA_HEADER: adm.replica_id, REQUEST_ID_HEADER: rid}
        queued = queue_header(adm.queue)
        if queued is not None:
            headers[QUEUE_HEADER] = queued
        return _ChatStarted(rid, stream, params, plan, echo, info["served_model_name"], int(time.time()), headers)

    async def _chat_collect(self, body, started: _ChatStarted):
        """The whole answer of an admitted, unstreamed chat request, or the error response."""
        rid, stream, params = started.rid, started.stream, started.params
        final, token_text, plp = None, {}, None
        try:
            async for out, tt in stream:
                final = out
                plp = plp or out.prompt_logprobs
                token_text.update(tt or {})
        except asyncio.CancelledError:  # client went away: the engine aborts the request
            stream.cancel()
            self._observe_abort()
            raise
        except ReplicaLost as e:  # and no other replica took it (Resumable)
            return error(503, f"{e}; request {rid} could not be completed elsewhere", 1)
        except Exception:  # a system error: logged with the request id, this request only
            logger.exception("request %s failed", rid)
            return error(500, f"internal error while generating request {rid}; see the server log")
        self._observe(final)
        resp = fmt.chat_response(rid, started.created, started.model, final, token_text, body.return_token_ids,
                                 body.return_tokens_as_token_ids, started.plan, started.echo)
        resp.prompt_logprobs = prompt_logprobs_json(plp, params.prompt_logprobs or 0, token_text)
        if body.return_token_ids:
            resp.prompt_token_ids = list(final.prompt_token_ids)
        return resp

    async def _batch_chat(self, body, rid: str, tenant):
        """vLLM's batched chat: each conversation an engine request of its own, admitted
        and read concurrently; one choice each (index i), usage summed. One refused or
        failed conversation is the answer, and the others are cancelled."""
        if body.prompt_logprobs is not None:  # per response in vLLM's shape: one prompt only
            return error(400, "Batch chat completions do not support `prompt_logprobs`.", param="prompt_logprobs")
        convs = body.conversations()
        arrival = self._live.arrival(rid)
        tasks = [asyncio.ensure_future(self._chat_start(c, f"{rid}-{i}", tenant, arrival))
                 for i, c in enumerate(convs)]
        try:
            started = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
                if t.done() and not t.cancelled() and t.exception() is None and isinstance(t.result(), _ChatStarted):
                    t.result().stream.cancel()
            raise
        refused = [s for s in started if not isinstance(s, _ChatStarted)]
        if refused:
            for s in started:
                if isinstance(s, _ChatStarted):
                    s.stream.cancel()
            return refused[0]
        reads = [asyncio.ensure_future(self._chat_collect(c, s)) for c, s in zip(convs, started)]
        try:
            answers = await asyncio.gather(*reads)
        except BaseException:
            for t in reads:
                t.cancel()
            raise
        failed = [a for a in answers if not isinstance(a, ChatCompletionResponse)]
        if failed:
            return failed[0]
        choices = []
        for i, a in enumerate(answers):
            for c in a.choices:
                c.index = i
                choices.append(c)
        usage = UsageInfo(prompt_tokens=sum(a.usage.prompt_tokens for a in answers),
                          completion_tokens=sum(a.usage.completion_tokens for a in answers))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        resp = ChatCompletionResponse(id=rid, created=started[0].created, model=started[0].model,
                                      choices=choices, usage=usage)
        return JSONResponse(resp.model_dump(exclude_none=True),
                            headers={REQUEST_ID_HEADER: rid, REPLICA_HEADER: started[0].headers[REPLICA_HEADER]})

    async def _sse(self, stream, state: fmt.StreamState, include_usage: bool):
        final = None
        try:
            try:
                async for out, tt in stream:
                    final = out
                    for line in state.chunks(out, tt or {}):
                        yield line
            except ReplicaLost as e:  # tokens were sent: it cannot move (Resumable)
                logger.warning("request %s: %s mid-stream", state.rid, e)
                for line in fmt.sse_failure(state.rid, 503, f"{e}; request {state.rid} ended mid-stream"):
                    yield line
                return
            except Exception:  # headers are gone: report in-band, as vLLM does
                logger.exception("request %s failed mid-stream", state.rid)
                for line in fmt.sse_failure(state.rid):
                    yield line
                return
            if include_usage and final is not None:
                yield state.usage_chunk(final)
            yield fmt.SSE_DONE
            self._observe(final)
        finally:
            self._live.release(state.rid)
            if final is None or not final.finished:
                stream.cancel()  # disconnect mid-stream: abort in the engine
                self._observe_abort()

    def _first_output(self, ttft_s: float) -> None:
        """A request's first output reached this front, ``ttft_s`` after it arrived here."""
        if self._metrics is not None:
            self._metrics.front_ttft.observe(ttft_s)

    def _observe(self, final) -> None:
        if final is not None and final.metrics is not None and self._metrics is not None:
            self._metrics.observe_finished(final.metrics, max(len(c.token_ids) for c in final.outputs),
                                           [c.finish_reason for c in final.outputs])

    def _observe_abort(self) -> None:
        if self._metrics is not None:
            self._metrics.count_finished(["abort"])

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        return await self._generate(body, chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        return await self._generate(body, chat=True, request=request)

    @app.post("/v1/chat/completions/batch")
    async def batch_chat_completions(self, body: BatchChatCompletionRequest, request: Request):
        tenant = getattr(request.state, "tenant", None)
        rid = random_id("chatcmpl")
        self._live.add(rid, tenant)
        try:
            response = await self._batch_chat(body, rid, tenant)
        finally:
            self._live.release(rid)
        return _with_unknown_fields(response, body, rid)

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
        info = await self.info()
        # As vLLM: root is --model as the user gave it, never the directory it resolved to
        # (the default model's prepared cache entry is nobody's business).
        card = ModelCard(id=info["served_model_name"], root=info["model_root"],
                         max_model_len=info["max_model_len"])
        return JSONResponse(ModelList(data=[card]).model_dump())

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
        # Asks an engine replica (loop alive, every TP worker answers), never cached info:
        # 503 as vLLM answers when its engine is dead, until Serve has replaced it. A
        # replica lost while it is asked (its lifeline) is not the answer: a live one is.
        for attempt in range(MAX_ATTEMPTS):
            loss = self._loss
            call = asyncio.ensure_future(self._ask_health())
            waits = {call} if loss is None else {call, loss}
            await asyncio.wait(waits, timeout=HEALTH_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            if call.done():
                e = call.exception()
                if e is None:
                    return Response(status_code=200)
                if not (loss is not None and loss.done() and attempt + 1 < MAX_ATTEMPTS):
                    cause = getattr(e, "cause", None) or e
                    return error(503, f"The engine is unhealthy: {type(cause).__name__}: {cause}"[:500])
                continue
            call.cancel()
            if loss is None or not loss.done():
                return error(503, f"The engine did not answer within {HEALTH_TIMEOUT_S:.0f} s")
        return error(503, "engine replicas were lost while they were asked")

    async def _ask_health(self) -> None:
        await self.engine.health.remote()

    @app.get("/metrics")
    async def metrics(self):
        await self.info()
        merged = await self.stats.merged.remote()
        return Response(self._metrics.render(merged),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest):
        bad = await self._check_model(body.model)
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
            ids = await self.engine.tokenize.remote(body.prompt, messages, body.add_special_tokens, template, tools)
            strs = await self.engine.token_strs.remote(ids) if body.return_token_strs else None
        except Exception as e:  # arrives wrapped (RayTaskError)
            return remote_error(e)
        info = await self.info()
        resp = TokenizeResponse(count=len(ids), max_model_len=info["max_model_len"], tokens=ids, token_strs=strs)
        return _with_unknown_fields(JSONResponse(resp.model_dump()), body)

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest):
        bad = await self._check_model(body.model)
        if bad is not None:
            return bad
        try:
            text = await self.engine.detokenize.remote(body.tokens)
        except Exception as e:  # arrives wrapped (RayTaskError)
            return remote_error(e)
        return _with_unknown_fields(JSONResponse(DetokenizeResponse(prompt=text).model_dump()), body)


logger = logging.getLogger("pagedserve")
_END = object()
