"""RequestOutput -> OpenAI response objects and SSE chunks (pure functions, no Serve).

Streaming shape (one ``data:`` line per chunk, blank line after each):

    completions: {choices:[{index, text: delta}]} ... {choices:[{index, text:"", finish_reason}]}
    chat:        {choices:[{index, delta:{role:"assistant", content:""}}]}   (once per choice;
                 the first chunk carries prompt_token_ids with return_token_ids, as vLLM's)
                 {choices:[{index, delta:{content: delta}}]} ... {.., finish_reason}
                 with --reasoning-parser: delta:{reasoning: .., reasoning_content: ..} while
                 the model thinks (cluster/text/reasoning.py), content after
                 with tools: delta:{tool_calls:[{index, id?, type?, function:{name?,
                 arguments: fragment}}]} instead of / beside content (tool_parsers.py; the
                 text after the thinking only)
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
from dataclasses import dataclass

from pagedserve.cluster.front.openai import tool_parsers
from pagedserve.cluster.front.openai.schemas import (ChatCompletionChoice, ChatCompletionResponse,
                                               ChatCompletionStreamResponse, ChatLogprobs, ChatLogprobToken,
                                               ChatLogprobTop, ChatResponseMessage, ChatStreamChoice,
                                               CompletionChoice, CompletionLogprobs, CompletionResponse,
                                               CompletionStreamResponse, CompletionTokensDetails, DeltaMessage,
                                               PromptLogprob, PromptTokensDetails, UsageInfo, error_body)
from pagedserve.cluster.front.openai.tool_choice import ToolPlan
from pagedserve.cluster.text.reasoning import ReasoningParser, ReasoningStream
from pagedserve.cluster.wire.outputs import CompletionOutput, RequestOutput
from pagedserve.scheduler.outputs import Logprobs


def sse(obj) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj.model_dump(exclude_none=True))
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_failure(rid: str, status: int = 500, message: str | None = None) -> list[str]:
    """The in-band end of a stream whose headers are gone (as vLLM): an error, then [DONE]."""
    return [sse(json.dumps(error_body(status, message or f"internal error in request {rid}"))), SSE_DONE]


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    """A chat request's reasoning (--reasoning-parser): the parser, the template switches
    that say whether the model thinks (chat_template_kwargs), and whether the thinking is
    sent back (include_reasoning)."""

    parser: ReasoningParser
    chat_template_kwargs: dict | None = None
    include: bool = True

    def in_reasoning(self, prompt_token_ids) -> bool:
        """Whether this request's output starts inside the thinking."""
        return self.parser.starts_in_reasoning(prompt_token_ids, self.chat_template_kwargs)

    def stream(self, prompt_token_ids) -> ReasoningStream:
        return self.parser.stream(self.in_reasoning(prompt_token_ids))

    def split(self, text: str, prompt_token_ids) -> tuple[str | None, str | None]:
        return self.parser.split(text, self.in_reasoning(prompt_token_ids))

    def tokens(self, out: RequestOutput) -> int:
        """The thinking's tokens over the choices (usage's completion_tokens_details)."""
        starts = self.in_reasoning(out.prompt_token_ids)
        return sum(self.parser.reasoning_tokens(c.token_ids, starts) for c in out.outputs)


def usage_of(out: RequestOutput, reasoning: ReasoningPlan | None = None) -> UsageInfo:
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    details = None if reasoning is None else CompletionTokensDetails(reasoning_tokens=reasoning.tokens(out))
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens),
                     completion_tokens_details=details)


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
                  as_ids: bool = False, with_sampled: bool = False) -> ChatLogprobs | None:
    """``top_logprobs``: the N most likely tokens (OpenAI's meaning), N = top_logprobs.
    ``bytes`` are always the token's text, also when it is named by id. ``with_sampled``
    (vLLM's logprob_token_ids): the entries are the sampled token, then the ids asked for."""
    if lps is None:
        return None
    content = []
    for lp in lps:
        tok = lp.token_ids[0]
        if with_sampled:  # one entry per token, the sampled one first (vLLM's dict of them)
            picked: dict = {}
            for t, v in zip(lp.token_ids, lp.logprobs):
                picked.setdefault(t, v)
            pairs = list(picked.items())
        else:
            pairs = list(zip(lp.token_ids[1:], lp.logprobs[1:]))
        tops = [ChatLogprobTop(token=_name_of(t, token_text, as_ids), logprob=_lp(v),
                               bytes=list(_text_of(t, token_text).encode()))
                for t, v in pairs]
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
                  echo: str = "", reasoning: ReasoningPlan | None = None,
                  logprobs_with_sampled: bool = False) -> ChatCompletionResponse:
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        text, thought = c.text, None
        if reasoning is not None:  # cluster/text/reasoning.py: the thinking, then the answer
            thought, text = reasoning.split(c.text, out.prompt_token_ids)
            text = text or ""
            thought = thought if reasoning.include else None
        content, calls, finish = echo + text, None, c.finish_reason
        if reasoning is not None and not content:
            content = None
        if tools is not None:  # tool_parsers.py: the answer -> tool calls (+ content)
            content, calls, finish = tool_parsers.parse(tools, text, c.finish_reason)
        choices.append(ChatCompletionChoice(
            index=c.index, message=ChatResponseMessage(content=content, tool_calls=calls, reasoning=thought,
                                                       reasoning_content=thought),
            finish_reason=finish, stop_reason=c.stop_reason,
            logprobs=chat_logprobs(c.logprobs, token_text, as_ids=as_token_ids, with_sampled=logprobs_with_sampled),
            token_ids=list(c.token_ids) if return_token_ids else None))
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                  usage=usage_of(out, reasoning))


class StreamState:
    """Per-request bookkeeping of what was already sent, per choice index.

    ``continuous_usage`` (stream_options.continuous_usage_stats with include_usage, as in
    vLLM): every chunk carries usage, with the completion tokens of its own choice so far.
    As vLLM's: with ``return_token_ids`` every chunk has its ``token_ids`` (a list, maybe
    empty) and the first one the prompt's (chat: on the chunk, completions: on the choice);
    a completion asked for ``logprobs`` has them on every chunk (maybe empty)."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, return_token_ids: bool,
                 as_token_ids: bool = False, continuous_usage: bool = False,
                 tools: ToolPlan | None = None, echo: str = "", reasoning: ReasoningPlan | None = None,
                 logprobs: bool = False, logprobs_with_sampled: bool = False):
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.return_token_ids = return_token_ids
        self.as_token_ids, self.continuous_usage = as_token_ids, continuous_usage
        self.tools = tools
        self.tool_streams: dict[int, tool_parsers.ToolStream] = {}  # per choice index
        self.reasoning = reasoning
        self.reasoning_streams: dict[int, ReasoningStream] = {}  # per choice index
        self.logprobs, self.logprobs_with_sampled = logprobs, logprobs_with_sampled
        self.echo = echo  # chat echo: a content chunk of its own after the role's (vLLM)
        self.role_sent: set[int] = set()
        self.prompt_ids_sent: set[int] = set()  # choices whose prompt ids went out
        self.finish_sent: set[int] = set()

    def chunks(self, out: RequestOutput, token_text: dict[int, str]) -> list[str]:
        lines = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            if self.chat and c.index not in self.role_sent:
                self.role_sent.add(c.index)
                role = self._chat_chunk(c.index, DeltaMessage(role="assistant", content=""))
                if self.return_token_ids and not self.prompt_ids_sent:  # the stream's first chunk
                    self.prompt_ids_sent.add(c.index)
                    role.prompt_token_ids = list(out.prompt_token_ids)
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
            chunk = self._chunk(c, out, token_text, ending)
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

    def _chunk(self, c: CompletionOutput, out: RequestOutput, token_text: dict[int, str], ending: bool):
        finish = c.finish_reason if ending else None
        stop = c.stop_reason if ending else None
        ids = list(c.delta_token_ids) if self.return_token_ids else None
        if self.chat:
            delta = DeltaMessage(content=c.delta_text)
            if self.tools is not None or self.reasoning is not None:
                delta, finish = self._parsed_delta(c, out, ending, finish)
                said = delta.content or delta.reasoning or delta.tool_calls
                if self.reasoning is not None and not self.reasoning.include and not (said or ending):
                    return None  # thinking the client did not ask for: not even its tokens
                if not (ending or said or ids or c.delta_logprobs):
                    return None  # held back (a tag or a name not complete yet): nothing to say
            return self._chat_chunk(c.index, delta, finish_reason=finish,
                                    stop_reason=stop, token_ids=ids,
                                    logprobs=chat_logprobs(c.delta_logprobs, token_text, self.as_token_ids,
                                                           self.logprobs_with_sampled))
        lps = c.delta_logprobs if c.delta_logprobs is not None or not self.logprobs else []
        choice = CompletionChoice(index=c.index, text=c.delta_text, finish_reason=finish,
                                  stop_reason=stop, token_ids=ids,
                                  logprobs=completion_logprobs(lps, token_text, as_ids=self.as_token_ids))
        if self.return_token_ids and c.index not in self.prompt_ids_sent:  # the choice's first chunk
            self.prompt_ids_sent.add(c.index)
            choice.prompt_token_ids = list(out.prompt_token_ids)
        return CompletionStreamResponse(id=self.rid, created=self.created, model=self.model,
                                        choices=[choice])

    def _parsed_delta(self, c: CompletionOutput, out: RequestOutput, ending: bool, finish: str | None):
        """The choice's text through its ReasoningStream (the thinking) and its ToolStream
        (the answer after it): reasoning, content and/or tool call deltas."""
        text, thought = c.delta_text, None
        if self.reasoning is not None:
            rs = self.reasoning_streams.get(c.index)
            if rs is None:
                rs = self.reasoning_streams[c.index] = self.reasoning.stream(out.prompt_token_ids)
            thought, text = rs.feed(text)
            if ending:
                tail, _ = rs.finish()
                thought = (thought or "") + (tail or "") or None
            thought = thought if self.reasoning.include else None
        calls: list = []
        content = text
        if self.tools is not None:
            ts = self.tool_streams.setdefault(c.index, tool_parsers.ToolStream(self.tools))
            content, calls = ts.feed(text or "")
            if ending:
                tail, more, finish = ts.finish(finish)
                content = (content or "") + (tail or "") or None
                calls = calls + more
        return DeltaMessage(content=content, reasoning=thought, reasoning_content=thought,
                            tool_calls=calls or None), finish

    def usage_chunk(self, out: RequestOutput) -> str:
        cls = ChatCompletionStreamResponse if self.chat else CompletionStreamResponse
        return sse(cls(id=self.rid, created=self.created, model=self.model, choices=[],
                       usage=usage_of(out, self.reasoning)))


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
