"""A chat answer as a Responses object: its output items, usage and status, whole
(``finished``) or as the typed stream events (``ResponsesStream``).

    output:  [reasoning {content: [reasoning_text]}]   the thinking, first (--reasoning-parser)
             [message {content: [output_text]}]        the text (always one, may be empty,
                                                        unless the answer is only calls)
             [function_call {call_id, name, arguments}] one per tool call, after the text
    status:  "completed", or "incomplete" with incomplete_details {reason: max_output_tokens}
             when the engine stopped at the length limit (vLLM's reading)

A stream (every event carries ``type`` and ``sequence_number``, 0, 1, 2, ...):

    response.created, response.in_progress                     (status in_progress, no output)
    thinking: response.output_item.added {reasoning}            once the first thinking arrives
           response.content_part.added {reasoning_text ""}
           response.reasoning_text.delta ...                    per engine step
           response.reasoning_text.done, response.content_part.done, response.output_item.done
    text:  response.output_item.added {message}                 once the first text arrives
           response.content_part.added {output_text ""}
           response.output_text.delta ...                       per engine step
           response.output_text.done, response.content_part.done, response.output_item.done
    call:  response.output_item.added {function_call, arguments ""}
           response.function_call_arguments.delta ...           (named / required: per step;
           response.function_call_arguments.done                 auto: the whole block at once)
           response.output_item.done
    response.completed                                          the whole object, usage too

Tool calls come out of the chat route's own parser (openai/tool_parsers.ToolStream), and
the thinking out of its reasoning parser (text/reasoning.ReasoningStream), so a streamed
and a whole answer name the same calls and the same thinking. As vLLM's, the last event is
response.completed also for an incomplete response (its status says so). The stream is
read by sse_stream.sse_events as a chat stream is: it ends with ``data: [DONE]``, which the
openai SDK reads as the end, and a failure after the headers is its in-band error.
"""

from __future__ import annotations

import json
from typing import Callable

from pagedserve.cluster.front.openai import tool_parsers
from pagedserve.cluster.front.openai.openai_format import ReasoningPlan, usage_of
from pagedserve.cluster.front.openai.schemas import ChatCompletionResponse, DeltaToolCall, UsageInfo
from pagedserve.cluster.front.openai.tool_choice import ToolPlan
from pagedserve.cluster.front.responses.protocol import (FunctionCallOutput, OutputMessage, OutputText,
                                                         ReasoningOutput, ReasoningText, ResponseObject,
                                                         ResponseUsage)
from pagedserve.cluster.wire.outputs import RequestOutput


def _usage(u: UsageInfo) -> ResponseUsage:
    usage = ResponseUsage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
                          total_tokens=u.total_tokens)
    if u.prompt_tokens_details is not None:
        usage.input_tokens_details.cached_tokens = u.prompt_tokens_details.cached_tokens
    if u.completion_tokens_details is not None:
        usage.output_tokens_details.reasoning_tokens = u.completion_tokens_details.reasoning_tokens
    return usage


def _ended(shell: ResponseObject, output: list, usage: UsageInfo, finish_reason: str | None) -> ResponseObject:
    incomplete = finish_reason == "length"
    return shell.model_copy(update=dict(
        status="incomplete" if incomplete else "completed", output=output, usage=_usage(usage),
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None))


def finished(shell: ResponseObject, chat: ChatCompletionResponse) -> ResponseObject:
    """The whole response of a chat answer (one choice)."""
    choice = chat.choices[0]
    msg = choice.message
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    output: list = []
    if msg.reasoning:
        # an item follows it (the message, maybe empty, or the calls): it is complete
        output.append(ReasoningOutput(content=[ReasoningText(text=msg.reasoning)], status="completed"))
    if msg.content or not msg.tool_calls:
        output.append(OutputMessage(status=status, content=[OutputText(text=msg.content or "")]))
    for call in msg.tool_calls or ():
        output.append(FunctionCallOutput(call_id=call.id, name=call.function.name, arguments=call.function.arguments))
    return _ended(shell, output, chat.usage, choice.finish_reason)


class ResponsesStream:
    """One response's stream events, as sse_stream.sse_events reads a stream state:
    ``chunks(out, token_text)`` per engine output. ``on_done`` gets the finished response
    object (for the store) before response.completed goes out."""

    def __init__(self, shell: ResponseObject, plan: ToolPlan | None,
                 on_done: Callable[[ResponseObject], None], reasoning: ReasoningPlan | None = None) -> None:
        self.rid = shell.id  # sse_events names the request by it
        self.shell = shell
        self.tools = tool_parsers.ToolStream(plan) if plan is not None else None
        self.reasoning = reasoning
        self.thinking = None  # its ReasoningStream, made with the first output (the prompt's ids)
        self.on_done = on_done
        self.seq = 0
        self.output: list = []  # the items so far; the last one may be open
        self.open = False
        self.started = False

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def chunks(self, out: RequestOutput, token_text: dict) -> list[str]:
        lines = []
        if not self.started:
            self.started = True
            for kind in ("response.created", "response.in_progress"):
                lines.append(self._event(kind, response=self.shell.to_json()))
        c = out.outputs[0]  # a Responses request is one sample
        finish = c.finish_reason
        text = c.delta_text
        if self.reasoning is not None:
            if self.thinking is None:
                self.thinking = self.reasoning.stream(out.prompt_token_ids)
            thought, text = self.thinking.feed(text)
            if finish is not None:
                thought = (thought or "") + (self.thinking.finish()[0] or "")
            if thought and self.reasoning.include:
                lines += self._thought(thought)
            text = text or ""
        text, calls = (text, []) if self.tools is None else self.tools.feed(text)
        if finish is not None and self.tools is not None:
            tail, more, finish = self.tools.finish(finish)
            text, calls = (text or "") + (tail or ""), calls + more
        if text:
            lines += self._text(text)
        for delta in calls:
            lines += self._call(delta)
        if finish is None:
            return lines
        if not any(isinstance(i, (OutputMessage, FunctionCallOutput)) for i in self.output):
            # nothing said: one empty message, as the whole answer has
            lines += self._text("")
        lines += self._close("incomplete" if finish == "length" else "completed")
        final = _ended(self.shell, self.output, usage_of(out, self.reasoning), finish)
        self.on_done(final)
        lines.append(self._event("response.completed", response=final.to_json()))
        return lines

    def _where(self) -> dict:
        return {"item_id": self.output[-1].id, "output_index": len(self.output) - 1}

    def _thought(self, delta: str) -> list[str]:
        lines = []
        if not (self.open and isinstance(self.output[-1], ReasoningOutput)):
            lines += self._close("completed")
            self.output.append(ReasoningOutput(status="in_progress"))
            self.open = True
            lines.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                     item=self.output[-1].model_dump(mode="json")))
            self.output[-1].content.append(ReasoningText(text=""))
            lines.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                     part=self.output[-1].content[0].model_dump(mode="json")))
        self.output[-1].content[0].text += delta
        lines.append(self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=delta))
        return lines

    def _text(self, delta: str) -> list[str]:
        lines = []
        if not (self.open and isinstance(self.output[-1], OutputMessage)):
            lines += self._close("completed")
            self.output.append(OutputMessage(status="in_progress"))
            self.open = True
            lines.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                     item=self.output[-1].model_dump(mode="json")))
            self.output[-1].content.append(OutputText(text=""))
            lines.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                     part=self.output[-1].content[0].model_dump(mode="json")))
        if delta:
            self.output[-1].content[0].text += delta
            lines.append(self._event("response.output_text.delta", **self._where(), content_index=0,
                                     delta=delta, logprobs=[]))
        return lines

    def _call(self, delta: DeltaToolCall) -> list[str]:
        lines = []
        if delta.id is not None:  # a call's header: a new item
            lines += self._close("completed")
            self.output.append(FunctionCallOutput(call_id=delta.id, name=delta.function.name, arguments="",
                                                  status="in_progress"))
            self.open = True
            lines.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                     item=self.output[-1].model_dump(mode="json")))
        if delta.function.arguments:
            self.output[-1].arguments += delta.function.arguments
            lines.append(self._event("response.function_call_arguments.delta", **self._where(),
                                     delta=delta.function.arguments))
        return lines

    def _close(self, status: str) -> list[str]:
        """The open item's done events (none open: nothing)."""
        if not self.open:
            return []
        self.open = False
        item, lines = self.output[-1], []
        if isinstance(item, ReasoningOutput):
            part = item.content[0]
            lines.append(self._event("response.reasoning_text.done", **self._where(), content_index=0,
                                     text=part.text))
            lines.append(self._event("response.content_part.done", **self._where(), content_index=0,
                                     part=part.model_dump(mode="json")))
            item.status = status
        elif isinstance(item, OutputMessage):
            part = item.content[0]
            lines.append(self._event("response.output_text.done", **self._where(), content_index=0,
                                     text=part.text, logprobs=[]))
            lines.append(self._event("response.content_part.done", **self._where(), content_index=0,
                                     part=part.model_dump(mode="json")))
            item.status = status
        else:
            lines.append(self._event("response.function_call_arguments.done", **self._where(),
                                     name=item.name, arguments=item.arguments))
            item.status = "completed"
        lines.append(self._event("response.output_item.done", output_index=len(self.output) - 1,
                                 item=item.model_dump(mode="json")))
        return lines
