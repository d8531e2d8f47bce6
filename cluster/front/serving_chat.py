"""/v1/chat/completions and vLLM's batched chat (/v1/chat/completions/batch), as vLLM's
OpenAIServingChat: the messages rendered by the replicas' chat template (or by the front's
own tokenizer where the router needs token ids: prompt_tokens.py), ``tools`` turned into
what the engine is asked (tool_choice.py), one engine request per conversation.

    body ─▶ start:  model name, sampling params, tool plan ─▶ ReplicaClient.generate ─▶ ChatStarted
                                                                  (or the error response)
    ChatStarted ─▶ stream: SSE (sse_stream.py)
                ─▶ not:    collect, one ChatCompletionResponse
    With --reasoning-parser (the replicas' info names it) the answer's thinking goes to the
    message's ``reasoning`` (openai_format.ReasoningPlan); the engine request says so, and its
    grammar (structured outputs, a tool choice) then starts where the thinking ends.
    (the Responses API, cluster/front/responses/, starts and collects chat requests too)
    batch: every conversation started, then read, concurrently; one refused or failed
           conversation is the answer, and the others are cancelled.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.cluster.front.openai import openai_format as fmt
from pagedserve.cluster.front.door import REPLICA_HEADER, REQUEST_ID_HEADER, LiveRequests, admitted_headers
from pagedserve.cluster.front.edge import error, generation_error, remote_error
from pagedserve.cluster.front.openai.openai_format import prompt_logprobs_json
from pagedserve.cluster.front.replica_client import ReplicaClient
from pagedserve.cluster.front.openai.schemas import ChatCompletionResponse, UsageInfo
from pagedserve.cluster.front.served_model import ServedModel
from pagedserve.cluster.front.sse_stream import sse_events
from pagedserve.cluster.front.openai.tool_choice import constrain_to_schema, tool_plan
from pagedserve.cluster.text.reasoning import ReasoningParser
from pagedserve.cluster.wire.request import EngineRequest


@dataclass(slots=True)
class ChatStarted:
    """A chat request admitted by a replica, before its outputs are read."""

    rid: str
    stream: object
    params: object
    plan: object  # tool_choice.ToolPlan or None
    echo: str
    model: str
    created: int
    headers: dict
    reasoning: object = None  # openai_format.ReasoningPlan (--reasoning-parser) or None


class OpenAIServingChat:
    def __init__(self, engine, model: ServedModel, live: LiveRequests, client: ReplicaClient) -> None:
        self._engine = engine  # the replicas' Serve handle: tokenize
        self._model = model
        self._live = live
        self._client = client

    async def create(self, body, rid: str, tenant):
        """The /v1/chat/completions answer of ``body`` (live as ``rid``): JSON, SSE, or an error."""
        started = await self.start(body, rid, tenant)
        if not isinstance(started, ChatStarted):
            return started
        if body.stream:
            state = fmt.StreamState(rid, started.created, started.model, True, body.return_token_ids,
                                    body.return_tokens_as_token_ids, body.continuous_usage, started.plan,
                                    started.echo, started.reasoning,
                                    logprobs_with_sampled=bool(body.logprob_token_ids))
            self._live.hold(rid)
            events = sse_events([started.stream], state, body.include_usage, self._model, self._live)
            return StreamingResponse(events, media_type="text/event-stream", headers=started.headers)
        resp = await self.collect(body, started)
        if not isinstance(resp, ChatCompletionResponse):
            return resp
        return JSONResponse(resp.model_dump(), headers=started.headers)

    async def create_batch(self, body, rid: str, tenant):
        """vLLM's batched chat: each conversation an engine request of its own, admitted
        and read concurrently; one choice each (index i), usage summed. One refused or
        failed conversation is the answer, and the others are cancelled."""
        if body.prompt_logprobs is not None:  # per response in vLLM's shape: one prompt only
            return error(400, "Batch chat completions do not support `prompt_logprobs`.", param="prompt_logprobs")
        convs = body.conversations()
        arrival = self._live.arrival(rid)
        tasks = [asyncio.ensure_future(self.start(c, f"{rid}-{i}", tenant, arrival))
                 for i, c in enumerate(convs)]
        try:
            started = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
                if t.done() and not t.cancelled() and t.exception() is None and isinstance(t.result(), ChatStarted):
                    t.result().stream.cancel()
            raise
        refused = [s for s in started if not isinstance(s, ChatStarted)]
        if refused:
            for s in started:
                if isinstance(s, ChatStarted):
                    s.stream.cancel()
            return refused[0]
        reads = [asyncio.ensure_future(self.collect(c, s)) for c, s in zip(convs, started)]
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
        return JSONResponse(resp.model_dump(),
                            headers={REQUEST_ID_HEADER: rid, REPLICA_HEADER: started[0].headers[REPLICA_HEADER]})

    async def start(self, body, rid: str, tenant, arrival: float | None = None):
        """Admit one chat request: ChatStarted, or the error response. ``arrival``: when
        the front took it (default: the live entry of ``rid``)."""
        lora, bad = await self._model.resolve(body.model)
        if bad is not None:
            return bad
        info = await self._model.info()
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
        kwargs = body.template_kwargs()
        if body.add_special_tokens:  # the tokenizer's BOS etc. on top of the template's (vLLM)
            try:
                prompt = await self._engine.tokenize.remote(None, messages, True, template, tools, kwargs)
            except Exception as e:  # arrives wrapped (RayTaskError)
                return remote_error(e)
            messages = None
        parser = info.get("reasoning_parser")  # cluster/text/reasoning.py
        reasoning = None if parser is None else fmt.ReasoningPlan(ReasoningParser.from_description(parser), kwargs,
                                                                  body.include_reasoning)
        req = EngineRequest(rid, prompt, params, body.priority, body.cache_salt, messages, template, tenant, tools,
                            chat_template_kwargs=kwargs, reasoning=reasoning is not None, lora_request=lora)
        stream, adm = await self._client.generate(req, whole=not body.stream,
                                                  arrival=arrival if arrival is not None else self._live.arrival(rid),
                                                  ids_shown=body.return_token_ids)
        if stream is None:
            return adm
        return ChatStarted(rid, stream, params, plan, echo, self._model.response_name(info, lora), int(time.time()),
                           admitted_headers(rid, adm), reasoning)

    async def collect(self, body, started: ChatStarted):
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
            self._model.observe_abort()
            raise
        except Exception as e:  # a lost replica no other took (Resumable), or the system's
            return generation_error(rid, e)
        self._model.observe(final)
        resp = fmt.chat_response(rid, started.created, started.model, final, token_text, body.return_token_ids,
                                 body.return_tokens_as_token_ids, started.plan, started.echo, started.reasoning,
                                 logprobs_with_sampled=bool(body.logprob_token_ids))
        resp.prompt_logprobs = prompt_logprobs_json(plp, params.prompt_logprobs or 0, token_text)
        if body.return_token_ids:
            resp.prompt_token_ids = list(final.prompt_token_ids)
        return resp
