"""RequestOutput -> OpenAI response objects and SSE chunks (pure functions, no Serve).

Streaming shape (one ``data:`` line per chunk, blank line after each):

    completions: {choices:[{index, text: delta}]} ... {choices:[{index, text:"", finish_reason}]}
    chat:        {choices:[{index, delta:{role:"assistant", content:""}}]}   (once per choice)
                 {choices:[{index, delta:{content: delta}}]} ... {.., finish_reason}
                 with tools: delta:{tool_calls:[{index, id?, type?, function:{name?,
                 arguments: fragment}}]} instead of / beside content (tool_parsers.py)
    both:        every chunk also carries usage (so far) with continuous_usage_stats
                 [{choices: [], usage}]  when stream_options.include_usage
                 data: [DONE]

/v1/completions adds, below: a batch
of prompts as one response, echo, and vLLM's ``prompt_logprobs`` field.

Choice indices of a batch (OpenAI, vLLM): prompt i's sample j is choice ``i * n + j``.

    prompts   p0            p1            p2          (n = 2)
    choices   0  1          2  3          4  5

Echo puts the prompt in front of every choice of its prompt: its text before the
generated text, and with ``logprobs`` its tokens before the generated ones (the first
with logprob None: nothing precedes it), from the engine's prompt logprobs.
"""

from __future__ import annotations

import dataclasses
import json

from pagedserve.cluster.front.openai import tool_parsers
from pagedserve.cluster.front.openai.schemas import (ChatCompletionChoice, ChatCompletionResponse,
                                               ChatCompletionStreamResponse, ChatLogprobs, ChatLogprobToken,
                                               ChatLogprobTop, ChatResponseMessage, ChatStreamChoice,
                                               CompletionChoice, CompletionLogprobs, CompletionResponse,
                                               CompletionStreamResponse, DeltaMessage, PromptLogprob,
                                               PromptTokensDetails, UsageInfo, error_body)
from pagedserve.cluster.front.openai.tool_choice import ToolPlan
from pagedserve.cluster.wire.outputs import CompletionOutput, RequestOutput
from pagedserve.scheduler.outputs import Logprobs


def sse(obj) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj.model_dump(exclude_none=True))
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_failure(rid: str, status: int = 500, message: str | None = None) -> list[str]:
    """The in-band end of a stream whose headers are gone (as vLLM): an error, then [DONE]."""
    return [sse(json.dumps(error_body(status, message or f"internal error in request {rid}"))), SSE_DONE]


def usage_of(out: RequestOutput) -> UsageInfo:
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


def _text_of(tok: int, token_text: dict[int, str]) -> str:
    return token_text.get(tok, f"<{tok}>")


# What a logprob of -inf is sent as: JSON has no -Infinity (OpenAI's and vLLM's choice).
MIN_LOGPROB = -9999.0


def _lp(v: float) -> float:
    return max(v, MIN_LOGPROB)


def _name_of(tok: int, token_text: dict[int, str], as_ids: bool) -> str:
    """A token as the client sees it in logprobs: its text, or vLLM's ``token_id:{id}``
    (return_tokens_as_token_ids: tokens that are not valid UTF-8 alone stay tellable apart)."""
    return f"token_id:{tok}" if as_ids else _text_of(tok, token_text)


def completion_logprobs(lps: list | None, token_text: dict[int, str],
                        offset: int = 0, as_ids: bool = False) -> CompletionLogprobs | None:
    """``lps``: one scheduler.outputs.Logprobs per token (sampled token first, then top-N).

    As OpenAI's legacy completions (and vLLM): each ``top_logprobs`` entry holds the
    sampled token and the N most likely ones, so up to N + 1 entries (N when the sampled
    token is among the top N), and ``logprobs: 0`` gives just the sampled token."""
    if lps is None:
        return None
    out = CompletionLogprobs()
    for lp in lps:
        tok = _name_of(lp.token_ids[0], token_text, as_ids)
        out.tokens.append(tok)
        out.text_offset.append(offset)
        offset += len(_text_of(lp.token_ids[0], token_text))  # an offset into the text
        if lp.logprobs[0] is None:  # an echoed prompt's first token: nothing conditions it
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_lp(lp.logprobs[0]))
        top: dict[str, float] = {}
        for t, v in zip(lp.token_ids, lp.logprobs):  # sampled first: it keeps its own logprob
            top.setdefault(_name_of(t, token_text, as_ids), _lp(v))
        out.top_logprobs.append(top)
    return out


def chat_logprobs(lps: list | None, token_text: dict[int, str],
                  as_ids: bool = False) -> ChatLogprobs | None:
    """``top_logprobs``: the N most likely tokens (OpenAI's meaning), N = top_logprobs.
    ``bytes`` are always the token's text, also when it is named by id."""
    if lps is None:
        return None
    content = []
    for lp in lps:
        tok = lp.token_ids[0]
        tops = [ChatLogprobTop(token=_name_of(t, token_text, as_ids), logprob=_lp(v),
                               bytes=list(_text_of(t, token_text).encode()))
                for t, v in zip(lp.token_ids[1:], lp.logprobs[1:])]
        content.append(ChatLogprobToken(token=_name_of(tok, token_text, as_ids), logprob=_lp(lp.logprobs[0]),
                                        bytes=list(_text_of(tok, token_text).encode()), top_logprobs=tops))
    return ChatLogprobs(content=content)


def completion_response(rid: str, created: int, model: str, out: RequestOutput,
                        token_text: dict[int, str], return_token_ids: bool,
                        echo_prompt: str | None = None, as_token_ids: bool = False) -> CompletionResponse:
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        text = (echo_prompt or "") + c.text
        choices.append(CompletionChoice(
            index=c.index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            logprobs=completion_logprobs(c.logprobs, token_text, as_ids=as_token_ids),
            token_ids=list(c.token_ids) if return_token_ids else None,
            prompt_token_ids=list(out.prompt_token_ids) if return_token_ids else None))
    return CompletionResponse(id=rid, created=created, model=model, choices=choices,
                              usage=usage_of(out))


def chat_response(rid: str, created: int, model: str, out: RequestOutput,
                  token_text: dict[int, str], return_token_ids: bool,
                  as_token_ids: bool = False, tools: ToolPlan | None = None,
                  echo: str = "") -> ChatCompletionResponse:
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        content, calls, finish = echo + c.text, None, c.finish_reason
        if tools is not None:  # tool_parsers.py: the text -> tool calls (+ content)
            content, calls, finish = tool_parsers.parse(tools, c.text, c.finish_reason)
        choices.append(ChatCompletionChoice(
            index=c.index, message=ChatResponseMessage(content=content, tool_calls=calls),
            finish_reason=finish, stop_reason=c.stop_reason,
            logprobs=chat_logprobs(c.logprobs, token_text, as_ids=as_token_ids),
            token_ids=list(c.token_ids) if return_token_ids else None))
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                  usage=usage_of(out))


class StreamState:
    """Per-request bookkeeping of what was already sent, per choice index.

    ``continuous_usage`` (stream_options.continuous_usage_stats with include_usage, as in
    vLLM): every chunk carries usage, with the completion tokens of its own choice so far."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, return_token_ids: bool,
                 as_token_ids: bool = False, continuous_usage: bool = False,
                 tools: ToolPlan | None = None, echo: str = ""):
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.return_token_ids = return_token_ids
        self.as_token_ids, self.continuous_usage = as_token_ids, continuous_usage
        self.tools = tools
        self.tool_streams: dict[int, tool_parsers.ToolStream] = {}  # per choice index
        self.echo = echo  # chat echo: a content chunk of its own after the role's (vLLM)
        self.role_sent: set[int] = set()
        self.finish_sent: set[int] = set()

    def chunks(self, out: RequestOutput, token_text: dict[int, str]) -> list[str]:
        lines = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            if self.chat and c.index not in self.role_sent:
                self.role_sent.add(c.index)
                role = self._chat_chunk(c.index, DeltaMessage(role="assistant", content=""))
                lines.append(sse(self._with_usage(role, out, 0)))
                if self.echo:
                    echoed = self._chat_chunk(c.index, DeltaMessage(content=self.echo))
                    lines.append(sse(self._with_usage(echoed, out, 0)))
            moved = bool(c.delta_text or c.delta_token_ids)
            ending = c.finish_reason is not None and c.index not in self.finish_sent
            if not moved and not ending:
                continue
            if ending:
                self.finish_sent.add(c.index)
            chunk = self._chunk(c, token_text, ending)
            if chunk is not None:
                lines.append(sse(self._with_usage(chunk, out, len(c.token_ids))))
        return lines

    def _with_usage(self, chunk, out: RequestOutput, num_completion_tokens: int):
        if self.continuous_usage:
            prompt = len(out.prompt_token_ids)
            chunk.usage = UsageInfo(prompt_tokens=prompt, completion_tokens=num_completion_tokens,
                                    total_tokens=prompt + num_completion_tokens)
        return chunk

    def _chat_chunk(self, index: int, delta: DeltaMessage, **kw) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.rid, created=self.created, model=self.model,
                                            choices=[ChatStreamChoice(index=index, delta=delta, **kw)])

    def _chunk(self, c: CompletionOutput, token_text: dict[int, str], ending: bool):
        finish = c.finish_reason if ending else None
        stop = c.stop_reason if ending else None
        ids = list(c.delta_token_ids) if self.return_token_ids else None
        if self.chat:
            delta = DeltaMessage(content=c.delta_text)
            if self.tools is not None:
                delta, finish = self._tool_delta(c, ending, finish)
                if not (ending or delta.content or delta.tool_calls or ids or c.delta_logprobs):
                    return None  # held back (a tag or a name not complete yet): nothing to say
            return self._chat_chunk(c.index, delta, finish_reason=finish,
                                    stop_reason=stop, token_ids=ids,
                                    logprobs=chat_logprobs(c.delta_logprobs, token_text, self.as_token_ids))
        choice = CompletionChoice(index=c.index, text=c.delta_text, finish_reason=finish,
                                  stop_reason=stop, token_ids=ids,
                                  logprobs=completion_logprobs(c.delta_logprobs, token_text,
                                                               as_ids=self.as_token_ids))
        return CompletionStreamResponse(id=self.rid, created=self.created, model=self.model,
                                        choices=[choice])

    def _tool_delta(self, c: CompletionOutput, ending: bool, finish: str | None):
        """The choice's text through its ToolStream: content and/or tool call deltas."""
        ts = self.tool_streams.setdefault(c.index, tool_parsers.ToolStream(self.tools))
        content, calls = ts.feed(c.delta_text)
        if ending:
            tail, more, finish = ts.finish(finish)
            content = (content or "") + (tail or "") or None
            calls = calls + more
        return DeltaMessage(content=content, tool_calls=calls or None), finish

    def usage_chunk(self, out: RequestOutput) -> str:
        cls = ChatCompletionStreamResponse if self.chat else CompletionStreamResponse
        return sse(cls(id=self.rid, created=self.created, model=self.model, choices=[],
                       usage=usage_of(out)))


def prompt_logprobs_json(plp: list | None, num: int, token_text: dict[int, str]) -> list | None:
    """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}}, the prompt's own token first, then the top ``num``."""
    if plp is None:
        return None
    out: list = []
    for lp in plp:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_ids[0]): PromptLogprob(logprob=lp.logprobs[0], rank=lp.sampled_rank,
                                                     decoded_token=token_text.get(lp.token_ids[0]))}
        for rank, (t, v) in enumerate(zip(lp.token_ids[1:1 + num], lp.logprobs[1:1 + num]), 1):
            entry.setdefault(str(t), PromptLogprob(logprob=v, rank=rank, decoded_token=token_text.get(t)))
        out.append(entry)
    return out


class ChoiceShaper:
    """Turns prompt ``i``'s engine outputs into its choices: indices moved to ``i * n + j``,
    the echo in front (once per choice when streaming), and for ``max_tokens: 0`` the
    one token the engine had to sample dropped (only its prompt was wanted)."""

    def __init__(self, prompt_idx: int, n: int, echo: str | None, echo_logprobs: int | None,
                 prompt_only: bool) -> None:
        self.base = prompt_idx * n
        self.echo = echo
        self.echo_logprobs = echo_logprobs  # top-N of the echoed tokens (request.logprobs)
        self.prompt_only = prompt_only
        self.prompt_logprobs: list | None = None  # the first non-None the engine sent
        self._echoed: set[int] = set()

    def _echo_lps(self, out: RequestOutput) -> list[Logprobs]:
        plp = self.prompt_logprobs or [None] * len(out.prompt_token_ids)
        k = self.echo_logprobs or 0
        first = Logprobs(token_ids=[out.prompt_token_ids[0]], logprobs=[None])  # type: ignore[list-item]
        return [first] + [Logprobs(lp.token_ids[:1 + k], lp.logprobs[:1 + k], lp.sampled_rank)
                          for lp in plp[1:] if lp is not None]

    def shape(self, out: RequestOutput) -> RequestOutput:
        if self.prompt_logprobs is None and out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        asked_lp = self.echo_logprobs is not None
        echo_lps = self._echo_lps(out) if self.echo is not None and asked_lp else []
        outputs = []
        for c in out.outputs:
            c = dataclasses.replace(c, index=self.base + c.index)
            if self.prompt_only:
                c = dataclasses.replace(c, text="", token_ids=[], delta_text="", delta_token_ids=[],
                                        logprobs=[] if asked_lp else None, delta_logprobs=None)
            if self.echo is not None:
                c.text = self.echo + c.text
                if asked_lp:
                    c.logprobs = echo_lps + list(c.logprobs or ())
                if c.index not in self._echoed:  # the stream's first chunk of this choice
                    self._echoed.add(c.index)
                    c.delta_text = self.echo + c.delta_text
                    if asked_lp:
                        c.delta_logprobs = echo_lps + list(c.delta_logprobs or ())
            outputs.append(c)
        return dataclasses.replace(out, outputs=outputs)


def combined(rid: str, finals: list[RequestOutput]) -> RequestOutput:
    """The batch as one RequestOutput, for usage (summed) and metrics."""
    outputs: list[CompletionOutput] = [c for f in finals for c in f.outputs]
    return RequestOutput(rid, None, [t for f in finals for t in f.prompt_token_ids], outputs,
                         finished=all(f.finished for f in finals),
                         num_cached_tokens=sum(f.num_cached_tokens for f in finals))


def batch_response(rid: str, created: int, model: str, finals: list[RequestOutput],
                   shapers: list[ChoiceShaper], token_text: dict[int, str], return_token_ids: bool,
                   num_prompt_logprobs: int | None, as_token_ids: bool = False) -> CompletionResponse:
    choices = []
    for out, shaper in zip(finals, shapers):
        resp = completion_response(rid, created, model, out, token_text, return_token_ids,
                                       as_token_ids=as_token_ids)
        plp = (prompt_logprobs_json(shaper.prompt_logprobs, num_prompt_logprobs, token_text)
               if num_prompt_logprobs is not None else None)
        for choice in resp.choices:
            choice.prompt_logprobs = plp
        choices.extend(resp.choices)
    return CompletionResponse(id=rid, created=created, model=model, choices=choices,
                              usage=usage_of(combined(rid, finals)))
