"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): a translation layer
over the chat path, as vLLM's and Ray Serve LLM's Anthropic endpoints are. The body becomes
the chat request it means (schemas.py), OpenAIServingChat serves that (model,
chat template, tokenization, tools, the one engine request, the door's 429s, the abort of a
dropped client), and its answer comes back in Anthropic's shape (anthropic_format.py):

    body ─▶ MessagesRequest ─▶ to_chat() ─▶ OpenAIServingChat.create ─▶ JSON ─▶ Message
              (400: Anthropic's                                      └▶ SSE  ─▶ MessageStream events
               error shape)                                          └▶ error ─▶ the same status, reshaped

The body is validated here, not by FastAPI, so that every 400 has Anthropic's shape; the
status of every other error (404 model, 429 + Retry-After, 5xx) is the chat path's.
"""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing

import pydantic
from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.cluster.front.anthropic import anthropic_format as fmt
from pagedserve.cluster.front.anthropic.schemas import NOT_IMPLEMENTED, CountTokensRequest, MessagesRequest
from pagedserve.cluster.front.door import LiveRequests
from pagedserve.cluster.front.edge import ErrorJSONResponse, remote_error
from pagedserve.cluster.front.served_model import ServedModel
from pagedserve.cluster.front.serving_chat import OpenAIServingChat
from pagedserve.cluster.front.openai.tool_choice import AUTO_UNSUPPORTED

_AUTO_UNSUPPORTED = AUTO_UNSUPPORTED.replace("tool_choice 'required'", 'tool_choice {"type": "any"}').replace(
    "a named function", '{"type": "tool", "name": ...}').replace("'none'", '{"type": "none"}').replace(
    "tool_choice 'auto'", 'tool_choice {"type": "auto"} (the default with tools)')
# Headers of the chat's response that are its own, not the body's.
_BODY_HEADERS = ("content-length", "content-type")


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def anthropic_error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return ErrorJSONResponse(fmt.error_body(status, message), status_code=status, headers=headers)


def _validation_message(e: pydantic.ValidationError) -> str:
    """Anthropic's wording: ``field.path: what is wrong`` for each error. Of a union (content
    as a string or blocks) only the branch that got furthest speaks; pydantic's names of the
    branches are left out of the path."""
    found = []
    for err in e.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if "[" not in str(p))
        kind, msg = err.get("type"), err.get("msg", "invalid")
        if kind == "extra_forbidden":
            name = str(err["loc"][-1]) if err.get("loc") else ""
            msg = ("not implemented by this server (deploy/README.md lists what /v1/messages takes)"
                   if name in NOT_IMPLEMENTED else "Extra inputs are not permitted")
        elif kind == "json_invalid":
            msg = f"the body is not valid JSON ({(err.get('ctx') or {}).get('error', msg)})"
        else:
            msg = msg.removeprefix("Value error, ")
        found.append((where, msg))
    deeper = [(w, m) for w, m in found if not any(o != w and o.startswith(w + ".") for o, _ in found)]
    return "; ".join(f"{w}: {m}" if w else m for w, m in deeper) or "invalid request"


def _kept_headers(response) -> dict:
    return {k: v for k, v in response.headers.items() if k.lower() not in _BODY_HEADERS}


class AnthropicServingMessages:
    def __init__(self, engine, model: ServedModel, live: LiveRequests, chat: OpenAIServingChat) -> None:
        self._engine = engine  # the replicas' Serve handle: tokenize
        self._model = model
        self._live = live
        self._chat = chat

    async def _chat_body(self, raw: bytes, kind):
        """The chat request the body ``raw`` (a ``kind``) means, with the body; or the
        Anthropic 400/404."""
        try:
            body = kind.model_validate_json(raw or b"{}")
            chat = body.to_chat()
        except pydantic.ValidationError as e:  # the body's, or what the chat path refuses of it
            return anthropic_error(400, _validation_message(e)), None
        except ValueError as e:
            return anthropic_error(400, str(e)), None
        bad = await self._model.check_model(body.model)
        if bad is not None:
            return self._reshaped(bad), None
        # The chat's words for it would name its own tool_choice values.
        if chat.tool_choice == "auto" and not (await self._model.info()).get("chat_template_tools", False):
            return anthropic_error(400, _AUTO_UNSUPPORTED), None
        return chat, body

    @staticmethod
    def _reshaped(response) -> JSONResponse:
        """An error response of the chat path (OpenAI's shape), in Anthropic's."""
        try:
            body = json.loads(response.body)
        except ValueError:
            body = {}
        return ErrorJSONResponse(fmt.from_openai_error(response.status_code, body), status_code=response.status_code,
                                 headers=_kept_headers(response))

    async def create(self, raw: bytes, tenant):
        """POST /v1/messages: the Message, its SSE stream, or an error in Anthropic's shape."""
        chat, body = await self._chat_body(raw, MessagesRequest)
        if body is None:
            return chat
        rid = message_id()
        with self._live.handled(rid, tenant):
            response = await self._chat.create(chat, rid, tenant)
        if isinstance(response, StreamingResponse):
            events = _events(response.body_iterator, fmt.MessageStream(rid, body.model, body.show_thinking()))
            return StreamingResponse(events, media_type="text/event-stream", headers=_kept_headers(response))
        if response.status_code != 200:
            return self._reshaped(response)
        return JSONResponse(fmt.message(json.loads(response.body), body.show_thinking()),
                            headers=_kept_headers(response))

    async def count_tokens(self, raw: bytes):
        """POST /v1/messages/count_tokens: {"input_tokens": n}, the prompt /v1/messages would
        send for the same conversation (its chat template, its tools where it renders them)."""
        chat, body = await self._chat_body(raw, CountTokensRequest)
        if body is None:
            return chat
        try:
            messages = [m.template_dict() for m in chat.messages]
            tools = ([t.model_dump(exclude_none=True) for t in chat.tools]
                     if chat.tools and chat.tool_choice != "none" else None)
            ids = await self._engine.tokenize.remote(None, messages, False, chat.template_mode(), tools,
                                                     chat.template_kwargs())
        except ValueError as e:
            return anthropic_error(400, str(e))
        except Exception as e:  # arrives wrapped (RayTaskError)
            return self._reshaped(remote_error(e))
        return JSONResponse({"input_tokens": len(ids)})


async def _events(chunks, stream: fmt.MessageStream):
    """The chat's SSE lines as Anthropic's events. Closing this (a client that leaves) closes
    the chat's generator, which aborts the request and frees it (sse_stream.py)."""
    async with aclosing(chunks) as lines:
        async for line in lines:
            for out in stream.feed(line):
                yield out
