"""StepRates: a replica's prefill rate and decode step time, measured from the steps its
engine ran, for the fronts' KV router (published with its KV events,
cluster/wire/kv_events.py; the cost model is cluster/front/router/kv_routing.py).

    a step: dt seconds, P prefill tokens, D decoding requests (from its plan)
      P = 0, D > 0   decode_step_s  <- EMA of dt          (the inter-token latency)
      P > 0          prefill time   =  dt - decode_step_s  if D > 0 (the decode share of the
                                       step; at least a quarter of dt), else dt
                     prefill_tok_s  =  EMA(P) / EMA(prefill time)

The rate is a ratio of averages, not an average of ratios: a 16-token prefill dominated by
the step's fixed cost does not weigh as much as a 2,000-token one. Neither figure is given
before it rests on some evidence (MIN_PREFILL_TOKENS prefilled, MIN_DECODE_STEPS decode
steps): a replica that has served two short prompts would otherwise look several times
slower than one that served a long one, and take no new prefix while the other is idle;
until then the router uses the fleet's figures. Pure Python (it reads a plan and the
scheduler's requests) and runs on the engine thread, after each step.
"""

from __future__ import annotations

EMA = 0.2  # weight of the newest step: ~5 steps of memory, as the replica's step-time average
MIN_PREFILL_SHARE = 0.25  # of a mixed step's time, whatever its decodes were measured at
MIN_PREFILL_TOKENS = 1024
MIN_DECODE_STEPS = 4


def step_mix(plan, scheduler) -> tuple[int, int]:
    """(prompt tokens prefilled, requests decoding) in the step ``plan`` ran: a request's
    tokens count as prefill up to its prompt length, past that it decodes (as the live
    view's timeline tells them apart). One that finished in the step is gone from the
    scheduler: it decoded."""
    if plan is None or not plan.num_scheduled_tokens:
        return 0, 0
    computed = {n.req_id: (n.num_computed_tokens, len(n.prompt_token_ids)) for n in plan.scheduled_new_reqs}
    cached = plan.scheduled_cached_reqs
    for rid, c in zip(cached.req_ids, cached.num_computed_tokens):
        req = scheduler.get_request(rid)
        computed[rid] = (c, req.num_prompt_tokens if req is not None else c)
    prefill = decoding = 0
    for rid, n in plan.num_scheduled_tokens.items():
        before, prompt = computed.get(rid, (0, 0))
        if before < prompt:
            prefill += min(n, prompt - before)
        else:
            decoding += 1
    return prefill, decoding


class StepRates:
    def __init__(self) -> None:
        self._decode_s: float | None = None  # EMA of a decode-only step's seconds
        self._tokens = 0.0  # EMAs of a prefill step's prompt tokens and its prefill seconds
        self._seconds = 0.0
        self._num_prefilled = self._num_decode_steps = 0  # the evidence so far

    @property
    def prefill_tok_s(self) -> float | None:
        """None: not measured enough yet."""
        return self._tokens / self._seconds if self._num_prefilled >= MIN_PREFILL_TOKENS else None

    @property
    def decode_step_s(self) -> float | None:
        return self._decode_s if self._num_decode_steps >= MIN_DECODE_STEPS else None

    def observe(self, plan, scheduler, dt: float) -> None:
        """The step ``plan`` ran took ``dt`` seconds."""
        self.add(dt, *step_mix(plan, scheduler))

    def add(self, dt: float, prefill_tokens: int, num_decoding: int) -> None:
        if dt <= 0 or (prefill_tokens == 0 and num_decoding == 0):
            return
        if prefill_tokens == 0:
            self._decode_s = dt if self._decode_s is None else (1 - EMA) * self._decode_s + EMA * dt
            self._num_decode_steps += 1
            return
        prefill_s = dt
        if num_decoding and self._decode_s is not None:
            prefill_s = max(dt - self._decode_s, MIN_PREFILL_SHARE * dt)
        self._num_prefilled += prefill_tokens
        if self._seconds == 0:
            self._tokens, self._seconds = float(prefill_tokens), prefill_s
        else:
            self._tokens = (1 - EMA) * self._tokens + EMA * prefill_tokens
            self._seconds = (1 - EMA) * self._seconds + EMA * prefill_s
