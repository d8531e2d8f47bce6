"""Seeded synthetic workloads whose lengths scale to the server's ``max_model_len``.

Prompts are token-id lists by default (the OpenAI completions API and vLLM both accept
``prompt: [int, ...]``), so prompt lengths are exact whatever the tokenizer; outputs have
fixed lengths through ``ignore_eos`` + ``max_tokens``. Nominal lengths are for a 2,048-token
context and shrink with ``scale = min(1, max_model_len / 2048)``; every request is then
clipped so that prompt + output fits ``max_model_len``.

    workload       prompt (nominal)            output (nominal)    extras
    chat           lognormal, mean ~200        lognormal, mean ~180
    short          ~20 (Alpaca-like)           ~60
    long-doc       50-100% of max_model_len    16-32
    shared-prefix  one of 4 system prompts     ~32                 ~90% share a prefix
                   (~300) + ~40 unique
    multi-turn     previous turns + ~60 new    ~60                 turn k waits for turn k-1
    mixed          a blend of the above        as drawn            ~5% n=2, ~5% cancelled
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORKLOADS = ("chat", "short", "long-doc", "shared-prefix", "multi-turn", "mixed")
NOMINAL_MAX_MODEL_LEN = 2048
FIRST_ID = 5  # ids below are special tokens in the project's test tokenizer (bos, eos, pad, ...)
_WORDS = ("the model serves many requests while the cache keeps every block of memory in "
          "pages so the scheduler can batch decode and prefill steps together").split()


@dataclass(slots=True)
class RequestSpec:
    request_id: str
    prompt: list[int] | str
    prompt_len: int  # exact for token-id prompts, approximate (words) for text
    max_tokens: int
    n: int = 1
    ignore_eos: bool = True
    # Cancel (close the stream) after this many tokens: the server must abort and free KV.
    cancel_after: int | None = None
    # Client-side stop after this many tokens, counted as a success: emulates a stop
    # condition the server cannot see in advance (max_tokens asked large, output short).
    stop_after: int | None = None
    parent: int | None = None  # index of the request that must finish first (multi-turn)
    kind: str = ""
    cache_salt: str | None = None  # isolates this request's prefix-cache lookups (vLLM's field)
    tenant: str | None = None  # sent as x-tenant (the server needs --allow-tenant-header)


class _Gen:
    def __init__(self, max_model_len: int, vocab_size: int, seed: int, text: bool) -> None:
        self.rng = random.Random(seed)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.scale = min(1.0, max_model_len / NOMINAL_MAX_MODEL_LEN)
        self.text = text

    def n(self, x: float, lo: int = 1) -> int:
        return max(lo, round(x * self.scale))

    def lognormal(self, mean: float, sigma: float, lo: int, hi: int) -> int:
        mu = math.log(mean) - sigma * sigma / 2  # so the mean of the draw is ``mean``
        return int(min(hi, max(lo, round(self.rng.lognormvariate(mu, sigma)))))

    def ids(self, k: int) -> list[int]:
        return [self.rng.randrange(FIRST_ID, self.vocab_size) for _ in range(k)]

    def fit(self, prompt_len: int, out: int) -> tuple[int, int]:
        out = max(1, min(out, self.max_model_len - 1))
        return max(1, min(prompt_len, self.max_model_len - out)), out

    def prompt(self, ids: list[int]) -> list[int] | str:
        if not self.text:
            return ids
        # One word per id: roughly one token per word with a BPE vocabulary.
        return " ".join(_WORDS[i % len(_WORDS)] for i in ids)

    def spec(self, i: int, kind: str, ids: list[int], out: int, **kw) -> RequestSpec:
        return RequestSpec(f"{kind}-{i}", self.prompt(ids), len(ids), out, kind=kind, **kw)


def _chat(g: _Gen, i: int) -> RequestSpec:
    p, o = g.fit(g.lognormal(g.n(200), 0.8, 4, g.max_model_len), g.lognormal(g.n(180), 0.8, 1, g.max_model_len))
    return g.spec(i, "chat", g.ids(p), o)


def _short(g: _Gen, i: int) -> RequestSpec:
    p, o = g.fit(g.lognormal(g.n(20), 0.4, 2, 200), g.lognormal(g.n(60), 0.5, 1, 400))
    return g.spec(i, "short", g.ids(p), o)


def _long_doc(g: _Gen, i: int) -> RequestSpec:
    out = g.rng.randint(16, 32)
    p, o = g.fit(int(g.rng.uniform(0.5, 1.0) * g.max_model_len), out)
    return g.spec(i, "long-doc", g.ids(p), o)


class _SharedPrefix:
    def __init__(self, g: _Gen, num_prefixes: int = 4, share: float = 0.9) -> None:
        self.prefixes = [g.ids(g.n(300, 8)) for _ in range(num_prefixes)]
        self.share = share

    def __call__(self, g: _Gen, i: int) -> RequestSpec:
        suffix = g.ids(g.lognormal(g.n(40), 0.4, 2, 200))
        prefix = g.rng.choice(self.prefixes) if g.rng.random() < self.share else g.ids(len(self.prefixes[0]))
        p, o = g.fit(len(prefix) + len(suffix), g.n(32, 4))
        return g.spec(i, "shared-prefix", (prefix + suffix)[:p], o)  # clip the tail, keep the prefix


def _multi_turn(g: _Gen, start: int, num: int) -> list[RequestSpec]:
    """Conversations of 2-4 turns; turn k's prompt is turn k-1's prompt + a reply of
    turn k-1's length (drawn up front, so the workload is the same for every server)
    + a new user message. Turn k waits for turn k-1 to finish."""
    specs: list[RequestSpec] = []
    while len(specs) < num:
        history: list[int] = []
        parent = None
        for turn in range(g.rng.randint(2, 4)):
            if len(specs) >= num:
                break
            msg = g.ids(g.lognormal(g.n(60), 0.5, 2, 300))
            out = g.lognormal(g.n(60), 0.5, 1, 300)
            if len(history) + len(msg) + out > g.max_model_len:
                break
            history = history + msg
            idx = start + len(specs)
            specs.append(g.spec(idx, "multi-turn", list(history), out, parent=parent))
            parent = idx
            history = history + g.ids(out)  # stands in for the assistant reply
    return specs


def generate_workload(name: str, num_prompts: int, *, max_model_len: int, vocab_size: int,
                      seed: int = 0, output_len: int | None = None, text: bool = False,
                      cancel_frac: float | None = None, multi_n_frac: float | None = None) -> list[RequestSpec]:
    """``num_prompts`` requests of workload ``name`` (one of ``WORKLOADS``), seeded.

    ``output_len`` fixes every output length (clipped to fit); ``text`` makes word prompts
    instead of token ids. ``mixed`` defaults to 5% ``n=2`` and 5% mid-stream cancellations."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if vocab_size <= FIRST_ID + 1:
        raise ValueError(f"vocab_size must be > {FIRST_ID + 1}, got {vocab_size}")
    g = _Gen(max_model_len, vocab_size, seed, text)
    shared = _SharedPrefix(g)
    simple = {"chat": _chat, "short": _short, "long-doc": _long_doc, "shared-prefix": shared}
    if name == "multi-turn":
        specs = _multi_turn(g, 0, num_prompts)
    elif name == "mixed":
        specs = []
        kinds = ["chat", "short", "long-doc", "shared-prefix", "multi-turn"]
        while len(specs) < num_prompts:
            kind = g.rng.choice(kinds)
            if kind == "multi-turn":
                specs += _multi_turn(g, len(specs), min(3, num_prompts - len(specs)))
            else:
                specs.append(simple[kind](g, len(specs)))
        cancel_frac = 0.05 if cancel_frac is None else cancel_frac
        multi_n_frac = 0.05 if multi_n_frac is None else multi_n_frac
    else:
        specs = [simple[name](g, i) for i in range(num_prompts)]
    parents = {s.parent for s in specs if s.parent is not None}
    for i, s in enumerate(specs):
        if output_len is not None:
            s.max_tokens = max(1, min(output_len, max_model_len - s.prompt_len))
        # Children are never cancelled or forked: a parent that never completes would
        # hang its conversation, and n>1 replies have no single history to carry on.
        if multi_n_frac and s.parent is None and g.rng.random() < multi_n_frac:
            s.n = 2
        elif cancel_frac and i not in parents and g.rng.random() < cancel_frac and s.max_tokens >= 4:
            s.cancel_after = max(1, s.max_tokens // 2)
    return specs


def summarize(specs: list[RequestSpec]) -> dict[str, float]:
    """Mean prompt / output lengths and counts, for the report's header."""
    k = max(1, len(specs))
    return {"num_prompts": len(specs),
            "mean_prompt_len": sum(s.prompt_len for s in specs) / k,
            "mean_output_len": sum(s.max_tokens for s in specs) / k,
            "num_n_gt_1": sum(s.n > 1 for s in specs),
            "num_cancel": sum(s.cancel_after is not None for s in specs),
            "num_follow_ups": sum(s.parent is not None for s in specs)}
