"""RequestOutput -> OpenAI response objects and SSE chunks (pure functions, no Serve).

Streaming shape (one ``data:`` line per chunk, blank line after each):

    completions: {choices:[{index, text: delta}]} ... {choices:[{index, text:"", finish_reason}]}
    chat:        {choices:[{index, delta:{role:"assistant", content:""}}]}   (once per choice)
                 {choices:[{index, delta:{content: delta}}]} ... {.., finish_reason}
    both:        [{choices: [], usage}]  when stream_options.include_usage
                 data: [DONE]
"""

from __future__ import annotations

import json

from pagedserve.cluster.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.cluster.serve.responses import (ChatCompletionChoice, ChatCompletionResponse,
                              ChatCompletionStreamResponse, ChatLogprobs, ChatLogprobToken,
                              ChatLogprobTop, ChatResponseMessage, ChatStreamChoice,
                              CompletionChoice, CompletionLogprobs, CompletionResponse,
                              CompletionStreamResponse, DeltaMessage, PromptTokensDetails,
                              UsageInfo)


def sse(obj) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj.model_dump(exclude_none=True))
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage_of(out: RequestOutput) -> UsageInfo:
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


def _text_of(tok: int, token_text: dict[int, str]) -> str:
    return token_text.get(tok, f"<{tok}>")


def completion_logprobs(lps: list | None, token_text: dict[int, str],
                        offset: int = 0) -> CompletionLogprobs | None:
    """``lps``: one scheduler.outputs.Logprobs per token (sampled token first, then top-N)."""
    if lps is None:
        return None
    out = CompletionLogprobs()
    for lp in lps:
        tok = _text_of(lp.token_ids[0], token_text)
        out.tokens.append(tok)
        out.token_logprobs.append(lp.logprobs[0])
        out.text_offset.append(offset)
        offset += len(tok)
        out.top_logprobs.append({_text_of(t, token_text): v
                                 for t, v in zip(lp.token_ids[1:], lp.logprobs[1:])} or None)
    return out


def chat_logprobs(lps: list | None, token_text: dict[int, str]) -> ChatLogprobs | None:
    if lps is None:
        return None
    content = []
    for lp in lps:
        tok = _text_of(lp.token_ids[0], token_text)
        tops = [ChatLogprobTop(token=_text_of(t, token_text), logprob=v,
                               bytes=list(_text_of(t, token_text).encode()))
                for t, v in zip(lp.token_ids[1:], lp.logprobs[1:])]
        content.append(ChatLogprobToken(token=tok, logprob=lp.logprobs[0],
                                        bytes=list(tok.encode()), top_logprobs=tops))
    return ChatLogprobs(content=content)


def completion_response(rid: str, created: int, model: str, out: RequestOutput,
                        token_text: dict[int, str], return_token_ids: bool,
                        echo_prompt: str | None = None) -> CompletionResponse:
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        text = (echo_prompt or "") + c.text
        choices.append(CompletionChoice(
            index=c.index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            logprobs=completion_logprobs(c.logprobs, token_text),
            token_ids=list(c.token_ids) if return_token_ids else None,
            prompt_token_ids=list(out.prompt_token_ids) if return_token_ids else None))
    return CompletionResponse(id=rid, created=created, model=model, choices=choices,
                              usage=usage_of(out))


def chat_response(rid: str, created: int, model: str, out: RequestOutput,
                  token_text: dict[int, str], return_token_ids: bool,
                  echo: str = "") -> ChatCompletionResponse:
    choices = [ChatCompletionChoice(
        index=c.index, message=ChatResponseMessage(content=echo + c.text),
        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        logprobs=chat_logprobs(c.logprobs, token_text),
        token_ids=list(c.token_ids) if return_token_ids else None)
        for c in sorted(out.outputs, key=lambda c: c.index)]
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                  usage=usage_of(out))


class StreamState:
    """Per-request bookkeeping of what was already sent, per choice index."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, return_token_ids: bool,
                 echo: str = ""):
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.return_token_ids = return_token_ids
        self.echo = echo  # chat echo: a content chunk of its own after the role's (vLLM)
        self.role_sent: set[int] = set()
        self.finish_sent: set[int] = set()

    def chunks(self, out: RequestOutput, token_text: dict[int, str]) -> list[str]:
        lines = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            if self.chat and c.index not in self.role_sent:
                self.role_sent.add(c.index)
                lines.append(sse(self._chat_chunk(c.index, DeltaMessage(role="assistant", content=""))))
                if self.echo:
                    lines.append(sse(self._chat_chunk(c.index, DeltaMessage(content=self.echo))))
            moved = bool(c.delta_text or c.delta_token_ids)
            ending = c.finish_reason is not None and c.index not in self.finish_sent
            if not moved and not ending:
                continue
            if ending:
                self.finish_sent.add(c.index)
            lines.append(sse(self._chunk(c, token_text, ending)))
        return lines

    def _chat_chunk(self, index: int, delta: DeltaMessage, **kw) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.rid, created=self.created, model=self.model,
                                            choices=[ChatStreamChoice(index=index, delta=delta, **kw)])

    def _chunk(self, c: CompletionOutput, token_text: dict[int, str], ending: bool):
        finish = c.finish_reason if ending else None
        stop = c.stop_reason if ending else None
        ids = list(c.delta_token_ids) if self.return_token_ids else None
        if self.chat:
            return self._chat_chunk(c.index, DeltaMessage(content=c.delta_text), finish_reason=finish,
                                    stop_reason=stop, token_ids=ids,
                                    logprobs=chat_logprobs(c.delta_logprobs, token_text))
        choice = CompletionChoice(index=c.index, text=c.delta_text, finish_reason=finish,
                                  stop_reason=stop, token_ids=ids,
                                  logprobs=completion_logprobs(c.delta_logprobs, token_text))
        return CompletionStreamResponse(id=self.rid, created=self.created, model=self.model,
                                        choices=[choice])

    def usage_chunk(self, out: RequestOutput) -> str:
        cls = ChatCompletionStreamResponse if self.chat else CompletionStreamResponse
        return sse(cls(id=self.rid, created=self.created, model=self.model, choices=[],
                       usage=usage_of(out)))
