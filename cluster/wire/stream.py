"""What crosses from the engine replica to the ingress for one request: on its Ray stream
an ``Admission`` (accepted, or the HTTP status of a refusal), then its end or failure; on
the ingress's output channel (cluster/wire/output_channel.py) its outputs.

The engine hands out RequestOutputs with cumulative fields (the whole output text, token
ids and logprobs, the prompt's ids) next to the step's deltas. Sent as they are, each
token of a stream would carry everything before it across the hop: O(n^2) bytes per
request, pickled on the engine replica, whose event loop shares the GIL with the step
thread. So (as vLLM's engine core sends only deltas to its API server):

- ``merge(a, b)``: two outputs of one request that are both waiting to be sent become
  one (b's state, a's and b's deltas), so a consumer that fell behind catches up in one
  message instead of one per step;
- ``slim(out, first)``: a stream item holds the deltas only (the prompt ids on the first
  item); the final item is sent whole, so its cumulative fields stay authoritative (n,
  best_of's choice, a stop string's trimmed text);
- ``Accumulated``: on the ingress, rebuilds each item's cumulative fields from the deltas,
  so every consumer sees the RequestOutputs the engine made.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagedserve.cluster.wire.outputs import CompletionOutput, RequestOutput


def _cat(a: list | None, b: list | None) -> list | None:
    if a is None:
        return b
    return a + b if b else a


def merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """``b`` (the later output of the same request) with ``a``'s deltas in front; full
    outputs on the engine replica, slim ones on the ingress (cluster/wire/output_channel.py)."""
    prev = {c.index: c for c in a.outputs}
    outputs = []
    for c in b.outputs:
        p = prev.get(c.index)
        if p is not None and (p.delta_text or p.delta_token_ids or p.delta_logprobs):
            c = dataclasses.replace(c, delta_text=p.delta_text + c.delta_text,
                                    delta_token_ids=p.delta_token_ids + c.delta_token_ids,
                                    delta_logprobs=_cat(p.delta_logprobs, c.delta_logprobs))
        outputs.append(c)
    plp = b.prompt_logprobs if b.prompt_logprobs is not None else a.prompt_logprobs
    if a.prompt_token_ids and not b.prompt_token_ids:  # slim items: only the first has them
        return dataclasses.replace(b, outputs=outputs, prompt_logprobs=plp, prompt=a.prompt,
                                   prompt_token_ids=a.prompt_token_ids)
    return dataclasses.replace(b, outputs=outputs, prompt_logprobs=plp)


def merge_texts(a: dict | None, b: dict | None) -> dict | None:
    if not a:
        return b
    return {**a, **b} if b else a


def merge_items(a: tuple, b: tuple) -> tuple:
    """Two (RequestOutput, token_text) stream items of one request, ``b`` the later, as one."""
    return merge(a[0], b[0]), merge_texts(a[1], b[1])


def slim(out: RequestOutput, first: bool) -> RequestOutput:
    """The wire form of a stream item (see the module docstring); the final one whole."""
    if out.finished:
        return out
    outputs = [CompletionOutput(index=c.index, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                logprobs=None if c.logprobs is None else [],
                                delta_text=c.delta_text, delta_token_ids=list(c.delta_token_ids),
                                delta_logprobs=c.delta_logprobs)
               for c in out.outputs]
    return dataclasses.replace(out, outputs=outputs, prompt=out.prompt if first else None,
                               prompt_token_ids=list(out.prompt_token_ids) if first else [])


class Accumulated:
    """An engine stream's items, (RequestOutput, token_text), with their cumulative
    fields rebuilt from the deltas ``slim`` left. ``cancel()`` cancels the engine stream."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._prompt = None
        self._prompt_ids: list[int] = []
        self._samples: dict[int, CompletionOutput] = {}

    def __aiter__(self):
        return self

    async def __anext__(self):
        out, token_text = await self._stream.__anext__()
        return self.rebuild(out), token_text

    def cancel(self) -> None:
        self._stream.cancel()

    def rebuild(self, out: RequestOutput) -> RequestOutput:
        if out.prompt_token_ids:
            self._prompt, self._prompt_ids = out.prompt, out.prompt_token_ids
        if out.finished:  # sent whole
            return out
        outputs = []
        for c in out.outputs:
            acc = self._samples.get(c.index)
            if acc is None:
                acc = self._samples[c.index] = CompletionOutput(
                    index=c.index, logprobs=None if c.logprobs is None else [])
            acc.text += c.delta_text
            acc.token_ids.extend(c.delta_token_ids)
            if acc.logprobs is not None and c.delta_logprobs:
                acc.logprobs.extend(c.delta_logprobs)
            # A snapshot: consumers may keep an item while the next one extends the lists.
            outputs.append(dataclasses.replace(
                c, text=acc.text, token_ids=list(acc.token_ids),
                logprobs=None if acc.logprobs is None else list(acc.logprobs)))
        return dataclasses.replace(out, outputs=outputs, prompt=self._prompt, prompt_token_ids=self._prompt_ids)


# ---- what a generate() Ray stream carries (cluster/replica/engine_replica.py)
@dataclass(slots=True)
class Admission:
    accepted: bool
    replica_id: str
    status: int = 200
    message: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    retry_after_s: int | None = None
    # Accepted: the request's status after its first step (engine.request_status), None
    # if it already finished; the ingress turns a waiting one into x-pagedserve-queue.
    queue: dict | None = None
    # A 429's unrounded time for the measured rate to drain the excess (None before any
    # measurement): the ingress's ShedGate (cluster/front/door.py) refuses for that long itself.
    shed_s: float | None = None
    # The tenant whose own share refused it (None: the replica refuses everyone): the gate
    # then sheds only that tenant's requests.
    shed_tenant: str | None = None
    # Seconds the request spent in the replica before this answer (tokenization, the engine
    # thread, its first step): the ingress subtracts it from its own wait to see how long the
    # request took to reach the replica (cluster/front/door.py FrontLimit).
    replica_s: float = 0.0
    # "host:port" of the replica's Lifeline (cluster/wire/lifeline.py): the front watches it
    # to learn at once when the replica's process or node is gone. None: not watched.
    lifeline: str | None = None


class QueueStatus:
    """A request's status after its first step (the first item of its stream)."""

    __slots__ = ("status",)

    def __init__(self, status: dict | None) -> None:
        self.status = status
