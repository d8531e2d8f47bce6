"""Beam search as vLLM's OpenAI server runs it (``use_beam_search``): at the front, over
the engine, one token at a time.

    beams (the prompt alone at first)
      │ every step: one engine request per live beam, max_tokens 1, greedy, with the
      │ 2 x width most likely next tokens and their logprobs (the beams share the prompt
      │ and each other's heads in the prefix cache, so a step prefills one token each)
      ▼
    candidates = beam + token, scored by cumulative logprob
      ├─ an EOS candidate ends: it joins the finished (unless ignore_eos)
      └─ the best ``width`` others are the next step's beams
    after max_tokens steps (or when no beam is left): finished + live, best ``width`` by
    cumulative logprob / length ** length_penalty (the length counts the prompt, not EOS),
    as Hugging Face's and vLLM's beam search rank them.

The engine's sampler stays as it is: beam search is a loop of ordinary requests, which
the scheduler batches with everyone else's.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.cluster.front.openai import openai_format as fmt
from pagedserve.cluster.front.edge import error, remote_error
from pagedserve.cluster.front.replica_client import ReplicaClient
from pagedserve.cluster.front.openai.schemas import (ChatCompletionChoice, ChatCompletionResponse, ChatResponseMessage,
                                               CompletionChoice, CompletionResponse, UsageInfo)
from pagedserve.cluster.front.served_model import ServedModel
from pagedserve.cluster.wire.outputs import CompletionOutput, RequestOutput
from pagedserve.cluster.wire.request import EngineRequest
from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class Beam:
    tokens: list[int]  # the prompt's, then the generated ones (an ending EOS included)
    cum_logprob: float = 0.0
    finish_reason: str = "length"
    stop_reason: int | None = None

    def rank(self, eos: frozenset[int], length_penalty: float) -> float:
        """Smaller is better: log(-score), score = cum_logprob / length ** length_penalty
        (negative; -inf for a sure sequence). In logs, so no length_penalty overflows."""
        n = len(self.tokens) - (1 if self.tokens and self.tokens[-1] in eos else 0)
        if self.cum_logprob >= 0.0:
            return -math.inf
        return math.log(-self.cum_logprob) - length_penalty * math.log(max(n, 1))


# One step: the token lists of the live beams -> for each, {token id: logprob} of its
# most likely next tokens.
Step = Callable[[list[list[int]]], Awaitable[list[dict[int, float]]]]


async def beam_search(step: Step, prompt: list[int], width: int, max_tokens: int, eos: frozenset[int],
                      ignore_eos: bool = False, length_penalty: float = 1.0) -> list[Beam]:
    """The best ``width`` beams, best first."""
    live, done = [Beam(list(prompt))], []
    for _ in range(max_tokens):
        tops = await step([b.tokens for b in live])
        candidates = []
        for beam, top in zip(live, tops):
            for token, logprob in top.items():
                cum = beam.cum_logprob + logprob
                if token in eos and not ignore_eos:
                    done.append(Beam(beam.tokens + [token], cum, "stop", token))
                else:
                    candidates.append((cum, token, beam))
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep the beam order, then the token order
        live = [Beam(b.tokens + [t], cum) for cum, t, b in candidates[:width]]
        if not live:
            break
    done.extend(live)
    return sorted(done, key=lambda b: b.rank(eos, length_penalty))[:width]


# ---------------------------------------------------------------- over HTTP
class _Refused(Exception):
    """A step's engine request was refused (400, 429, 503): that answer is the request's."""

    def __init__(self, response) -> None:
        super().__init__()
        self.response = response


async def create_beam_search(engine, model: ServedModel, client: ReplicaClient, body, chat: bool, rid: str,
                             tenant, width: int):
    """The /v1/completions or /v1/chat/completions answer of a ``use_beam_search`` body
    (schemas._SamplingFields.beam_width has refused what beam search does not take): n
    choices per prompt, the best beams first. ``engine``: the replicas' Serve handle
    (tokenize, detokenize); each step's engine requests go through ``client``."""
    lora, bad = await model.resolve(body.model)
    if bad is not None:
        return bad
    try:
        body.to_sampling_params()  # the ranges every request is held to (n >= 1, max_tokens >= 1, ...)
    except ValueError as e:
        return error(400, str(e))
    info = await model.info()
    if 2 * width > info["max_logprobs"]:
        return error(400, f"use_beam_search with n={width} ranks {2 * width} candidates per beam and step; "
                          f"this server returns at most {info['max_logprobs']} logprobs (--max-logprobs).", param="n")
    try:
        if chat:
            messages = [m.template_dict() for m in body.messages]
            prompts = [await engine.tokenize.remote(None, messages, body.add_special_tokens,
                                                    body.template_mode(), None, body.chat_template_kwargs)]
            asked = body.max_completion_tokens or body.max_tokens
        else:
            prompts = [p if isinstance(p, list) else await engine.tokenize.remote(p, None, body.add_special_tokens)
                       for p in body.prompts()]
            asked = body.max_tokens
    except ValueError as e:
        return error(400, str(e))
    except Exception as e:  # arrives wrapped (RayTaskError)
        return remote_error(e)
    limit = info["max_model_len"]
    for p in prompts:
        if len(p) + (asked or 1) > limit:
            return error(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{len(p) + (asked or 1)} tokens ({len(p)} in the prompt, {asked or 1} for the "
                              "completion). Please reduce the prompt or max_tokens.")
    eos = frozenset(info.get("eos_token_ids") or ())
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    ids = itertools.count()

    async def one(tokens: list[int]) -> dict[int, float]:
        req = EngineRequest(f"{rid}-beam-{next(ids)}", tokens, step_params, body.priority, body.cache_salt,
                            tenant=tenant, lora_request=lora)
        stream, adm = await client.generate(req, whole=not body.stream)
        if stream is None:
            raise _Refused(adm)
        final = None
        try:
            async for out, _ in stream:
                final = out
        finally:
            if final is None or not final.finished:
                stream.cancel()
        if final is None or final.error or not final.outputs[0].logprobs:
            why = "no output" if final is None else final.error or final.outputs[0].finish_reason
            raise RuntimeError(f"a beam step of request {rid} failed: {why}")
        lp = final.outputs[0].logprobs[0]
        return dict(zip(lp.token_ids, lp.logprobs))

    async def step(beams: list[list[int]]) -> list[dict[int, float]]:
        return list(await asyncio.gather(*(one(t) for t in beams)))

    try:
        found = await asyncio.gather(*(beam_search(step, p, width, asked or (limit - len(p)), eos, body.ignore_eos,
                                                   body.length_penalty) for p in prompts))
    except _Refused as e:
        return e.response
    created, model = int(time.time()), ServedModel.response_name(info, lora)
    choices, generated, finals = [], 0, []
    for i, (prompt, beams) in enumerate(zip(prompts, found)):
        outputs = []
        for j, b in enumerate(beams):
            out = b.tokens[len(prompt):]
            if b.finish_reason == "stop" and not body.include_stop_str_in_output:
                out = out[:-1]  # the EOS: neither in the text nor in the ids, as vLLM
            generated += len(out)
            text = await engine.detokenize.remote(out, body.skip_special_tokens)
            index = j if chat else i * width + j
            outputs.append(CompletionOutput(index, text, out, b.finish_reason, b.stop_reason,
                                            delta_text=text, delta_token_ids=out))
            ids_out = out if body.return_token_ids else None
            if chat:
                choices.append(ChatCompletionChoice(index=j, message=ChatResponseMessage(content=text),
                                                    finish_reason=b.finish_reason, stop_reason=b.stop_reason,
                                                    token_ids=ids_out))
            else:
                choices.append(CompletionChoice(index=index, text=text, finish_reason=b.finish_reason,
                                                stop_reason=b.stop_reason, token_ids=ids_out,
                                                prompt_token_ids=prompt if body.return_token_ids else None))
        finals.append(RequestOutput(rid, None, prompt, outputs, finished=True))
    if body.stream:  # as vLLM streams it: each choice whole in one chunk, once the search ends
        return StreamingResponse(_stream(rid, created, model, chat, body, finals), media_type="text/event-stream")
    prompt_tokens = sum(len(p) for p in prompts)
    usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated)
    if chat:
        resp = ChatCompletionResponse(id=rid, created=created, model=model, choices=choices, usage=usage,
                                      prompt_token_ids=prompts[0] if body.return_token_ids else None)
    else:
        resp = CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=usage)
    return JSONResponse(resp.model_dump())


async def _stream(rid: str, created: int, model: str, chat: bool, body, finals: list):
    state = fmt.StreamState(rid, created, model, chat, body.return_token_ids, False, body.continuous_usage)
    for out in finals:
        for line in state.chunks(out, {}):
            yield line
    if body.include_usage:
        yield state.usage_chunk(fmt.combined(rid, finals))
    yield fmt.SSE_DONE
