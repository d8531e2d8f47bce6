"""/v1/responses, as vLLM's OpenAIServingResponses: a Responses body becomes one chat
request (protocol.py), which the chat route admits and reads (serving_chat.start /
collect: model name, chat template, tokenization, tools, structured outputs, the door's
429); its answer becomes a response object or the typed stream events (events.py).

    body ─▶ previous_response_id? its stored conversation (404 if none) ─▶ to_chat
         ─▶ OpenAIServingChat.start ─▶ stream: sse_events(ResponsesStream) ─┐
                                    ─▶ not:    collect ─▶ events.finished  ─┴▶ store (store: true)

A client that leaves cancels the engine request as on the chat route (collect, or the SSE
body closed): a response never finished is never stored.
"""

from __future__ import annotations

from functools import partial

from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.cluster.front.door import LiveRequests
from pagedserve.cluster.front.edge import error
from pagedserve.cluster.front.openai.schemas import ChatCompletionResponse
from pagedserve.cluster.front.responses import events
from pagedserve.cluster.front.responses.protocol import ResponseObject, ResponsesRequest, items_to_messages
from pagedserve.cluster.front.responses.store import ResponseStore, StoredResponse
from pagedserve.cluster.front.served_model import ServedModel
from pagedserve.cluster.front.serving_chat import ChatStarted, OpenAIServingChat
from pagedserve.cluster.front.sse_stream import sse_events


def _not_found(response_id: str, param: str | None = None) -> JSONResponse:
    return error(404, f"Response with id '{response_id}' not found.", param=param)


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, model: ServedModel, live: LiveRequests,
                 store: ResponseStore | None = None) -> None:
        self._chat = chat
        self._model = model
        self._live = live
        self.store = store or ResponseStore()

    async def create(self, body: ResponsesRequest, rid: str, tenant):
        """The answer of ``body`` (live as ``rid``): a response object, its events, or an error."""
        history: list[dict] = []
        if body.previous_response_id is not None:
            prev = self.store.get(body.previous_response_id, tenant)
            if prev is None:
                return _not_found(body.previous_response_id, "previous_response_id")
            history = prev.conversation
        try:
            conversation = history + body.input_messages()
            chat = body.to_chat(conversation)
        except ValueError as e:
            return error(400, str(e), param=getattr(e, "param", None))
        started = await self._chat.start(chat, rid, tenant)
        if not isinstance(started, ChatStarted):
            return started
        shell = body.shell(rid, started.model, started.created)
        keep = partial(self._keep, body.store, tenant, conversation)
        if body.stream:
            state = events.ResponsesStream(shell, started.plan, keep, started.reasoning)
            self._live.hold(rid)
            lines = sse_events([started.stream], state, False, self._model, self._live)
            return StreamingResponse(lines, media_type="text/event-stream", headers=started.headers)
        answer = await self._chat.collect(chat, started)
        if not isinstance(answer, ChatCompletionResponse):
            return answer
        final = events.finished(shell, answer)
        keep(final)
        return JSONResponse(final.to_json(), headers=started.headers)

    def _keep(self, store: bool, tenant, conversation: list[dict], final: ResponseObject) -> None:
        if store:  # the output sent back is valid input: one conversion for both
            said = items_to_messages([item.model_dump() for item in final.output], at="output")
            self.store.put(StoredResponse(final, conversation + said, tenant))

    def retrieve(self, response_id: str, tenant) -> JSONResponse:
        entry = self.store.get(response_id, tenant)
        return _not_found(response_id) if entry is None else JSONResponse(entry.response.to_json())

    def delete(self, response_id: str, tenant) -> JSONResponse:
        if not self.store.delete(response_id, tenant):
            return _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    def cancel(self, response_id: str, tenant) -> JSONResponse:
        """OpenAI cancels background responses only; this server runs none (``background``
        is refused), and a stored response is a finished one."""
        if self.store.get(response_id, tenant) is None:
            return _not_found(response_id)
        return error(400, "Only responses created with background=true can be cancelled; this server "
                          "runs none in the background, and this one has finished.", param="response_id")
