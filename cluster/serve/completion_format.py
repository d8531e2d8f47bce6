"""What /v1/completions adds on top of openai_format.py, as pure functions: a batch
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

from pagedserve.cluster.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.cluster.serve import openai_format as fmt
from pagedserve.cluster.serve.responses import CompletionResponse, PromptLogprob
from pagedserve.scheduler.outputs import Logprobs


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
        resp = fmt.completion_response(rid, created, model, out, token_text, return_token_ids,
                                       as_token_ids=as_token_ids)
        plp = (prompt_logprobs_json(shaper.prompt_logprobs, num_prompt_logprobs, token_text)
               if num_prompt_logprobs is not None else None)
        for choice in resp.choices:
            choice.prompt_logprobs = plp
        choices.extend(resp.choices)
    return CompletionResponse(id=rid, created=created, model=model, choices=choices,
                              usage=fmt.usage_of(combined(rid, finals)))
