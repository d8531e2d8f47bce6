"""Every bench's prompts and length distributions, seeded, in one module: each workload is
defined once, under a name, and the benches import it.

``generate_workload`` (the HTTP load of ``python -m pagedserve.loadtest bench``, of the
continuous-batching, mixed-saturation, rate-sweep and vs-vllm scenarios of ``compare``, and
of serving/bench_door) has lengths that scale to the server's ``max_model_len``. Prompts
are token-id lists by default (the OpenAI completions API and vLLM both accept ``prompt:
[int, ...]``), so prompt lengths are exact whatever the tokenizer; outputs have fixed
lengths through ``ignore_eos`` + ``max_tokens``. Nominal lengths are for a 2,048-token
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

The benches with no HTTP server take ``(prompt token ids, output length)`` pairs or bare
prompts with fixed caps instead (no scaling); each is its own distribution, kept as the
bench that first drew it had it, so a seed gives the same numbers as in its history:

    function               prompt                      output                 used by
    offline_chat_pairs     lognormal (sigma 0.6,       1 + exponential (mean  offline/bench_offline,
                           mean 200), 4 to             180), 2 to 1,024, and  peers/bench_vs_vllm
                           max_model_len // 2          prompt + output fits
    scheduler_chat_pairs   lognormal (sigma 0.8,       1 + exponential (mean  offline/bench_scheduler,
                           mean 200), 1 to 2,000       180), 1 to max_tokens  bench_thrash, bench_kv_dtype
    long_context_pairs     uniform 1,500-2,500         256                    offline/bench_kv_dtype --workload long
    fixed_length_prompts   exactly ``length`` ids      (the caller's)         peers/vs_vllm, bench_scheduler (a)
    fixed_length_specs     exactly ``prompt_len`` ids  exactly output_len     peers/bench_vs_vllm (HTTP)

The scenarios of ``compare`` (scenarios/) each send a request set shaped for the one effect
they measure (``m`` = max_model_len; token-id prompts; no scaling beyond ``m``):

    function               prompt                      output                 scenario
    kv_pressure_specs      uniform m/8 to m/4          asks m - prompt, stops paged-kv
                                                       reading after uniform
                                                       m/8 to m/4
    decode_and_doc_specs   decoders: 16; documents:    decoders: decode_len;  chunked-prefill
                           uniform 0.8 m to m - 8      documents: 4
    long_prefix_specs      one of 4 prefixes of 0.6 m  8                      prefix-caching
                           + uniform 8-32 unique
    short_stream_specs     uniform 16-48               output_len, a share    overload, cancel-soak
                                                       cancelled mid-stream
    tenant_stream_specs    uniform 16-48               output_len             tenants

serving/bench_routing.py sends text (every router reads text), made of words that are one
token each in the model's vocabulary (``WordText``): ``word_shared_prefix_prompts`` (one of
``num_prefixes`` prefixes + a suffix of its own), ``word_prompts`` (nothing shared) and, for
its multi-turn conversations, ``WordText`` itself (multinode/cluster_check's 16-word prompts
too). ``patterned_ids`` gives request ``i`` a prompt with no draw at all, for the benches of
per-request overhead (serving/bench_frontend, offline/bench_dispatch).

serving/bench_router_decision.py simulates replicas and routers without a model:
``ROUTER_SIM_SHAPES`` are its chat sessions (``SessionShape``: a system prompt of the
session's own, then turns; turn k's prompt is everything before it, so a session's next
turn finds its history in the cache of the replica that served the last one).

Not here: fixed texts stay with the bench that reads them (serving/bench_spec's grounded and
open prompts, offline/bench_kv_quant's English prompts), and the kernel checks' random
tensors (gpu_check.py, kernel_checks/) are inputs to one kernel, not requests.
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


def random_ids(rng: random.Random, k: int, vocab_size: int, first_id: int = FIRST_ID) -> list[int]:
    """``k`` token ids drawn uniformly from ``[first_id, vocab_size)`` with ``rng``."""
    return [rng.randrange(first_id, vocab_size) for _ in range(k)]


def patterned_ids(i: int, length: int, stop: int, first_id: int) -> list[int]:
    """Request ``i``'s prompt with no random draw (cheap enough for a timed loop, the same
    on every run): ``first_id + (7 i + j) mod (stop - first_id)`` for ``j < length``, so
    ids lie in ``[first_id, stop)`` and neighbouring requests differ."""
    return [first_id + (7 * i + j) % (stop - first_id) for j in range(length)]


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
        return random_ids(self.rng, k, self.vocab_size)

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


# ---------------------------------------------------------------- the benches with no HTTP server
def _lognormal_exponential_pairs(n: int, seed: int, *, vocab_size: int, first_id: int, prompt_mean: float,
                                 sigma: float, prompt_range: tuple[int, int], output_mean: float,
                                 output_range: tuple[int, int], max_total: int | None = None
                                 ) -> list[tuple[list[int], int]]:
    """Prompts ~ lognormal with mean ``prompt_mean`` (mu = ln mean - sigma^2 / 2), truncated
    and clipped to ``prompt_range``; outputs ~ 1 + exponential (mean ``output_mean``),
    truncated and clipped to ``output_range`` and, with ``max_total``, to ``max_total -
    prompt``. Draw order per request: prompt length, output length, prompt ids."""
    rng = random.Random(seed)
    mu = math.log(prompt_mean) - sigma ** 2 / 2
    pairs = []
    for _ in range(n):
        p = max(prompt_range[0], min(int(rng.lognormvariate(mu, sigma)), prompt_range[1]))
        cap = output_range[1] if max_total is None else min(output_range[1], max_total - p)
        o = max(output_range[0], min(int(rng.expovariate(1 / output_mean)) + 1, cap))
        pairs.append((random_ids(rng, p, vocab_size, first_id), o))
    return pairs


def offline_chat_pairs(n: int, max_model_len: int, vocab_size: int, seed: int = 0, prompt_mean: float = 200,
                       output_mean: float = 180) -> list[tuple[list[int], int]]:
    """The offline throughput benches' chat-like workload (offline/bench_offline.py,
    peers/bench_vs_vllm.py): (prompt token ids, output length) pairs. Prompts ~ lognormal
    (sigma 0.6, mean ``prompt_mean``), 4 to ``max_model_len // 2`` tokens; outputs ~ 1 +
    exponential (mean ``output_mean``), 2 to 1,024 tokens and so that the pair fits
    ``max_model_len``; ids uniform in ``[3, vocab_size)``."""
    return _lognormal_exponential_pairs(n, seed, vocab_size=vocab_size, first_id=3, prompt_mean=prompt_mean,
                                        sigma=0.6, prompt_range=(4, max_model_len // 2), output_mean=output_mean,
                                        output_range=(2, 1024), max_total=max_model_len)


def scheduler_chat_pairs(n: int, seed: int, max_tokens: int, vocab_size: int = 32000) -> list[tuple[list[int], int]]:
    """The Scheduler simulations' chat workload (offline/bench_scheduler.py, bench_thrash.py,
    bench_kv_dtype.py): (prompt token ids, output length) pairs. Prompts ~ lognormal (sigma
    0.8, mean 200), 1 to 2,000 tokens; outputs ~ 1 + exponential (mean 180), 1 to
    ``max_tokens``; ids uniform in ``[0, vocab_size)`` (no model reads them)."""
    return _lognormal_exponential_pairs(n, seed, vocab_size=vocab_size, first_id=0, prompt_mean=200, sigma=0.8,
                                        prompt_range=(1, 2000), output_mean=180, output_range=(1, max_tokens))


def long_context_pairs(n: int, seed: int, vocab_size: int = 32000) -> list[tuple[list[int], int]]:
    """Long contexts (offline/bench_kv_dtype.py ``--workload long``): (prompt token ids, 256)
    pairs, prompts uniform 1,500-2,500 tokens, ids uniform in ``[0, vocab_size)``."""
    rng = random.Random(seed)
    return [(random_ids(rng, rng.randint(1500, 2500), vocab_size, 0), 256) for _ in range(n)]


def fixed_length_prompts(num: int, length: int, vocab_size: int, seed: int = 0,
                         first_id: int = FIRST_ID) -> list[list[int]]:
    """``num`` prompts of exactly ``length`` token ids, uniform in ``[first_id, vocab_size)``
    (the shape of ``vllm bench serve``'s random dataset)."""
    rng = random.Random(seed)
    return [random_ids(rng, length, vocab_size, first_id) for _ in range(num)]


def fixed_length_specs(num: int, prompt_len: int, output_len: int, vocab_size: int,
                       seed: int = 0) -> list[RequestSpec]:
    """``fixed_length_prompts`` as requests ``r0``, ``r1``, ... of exactly ``output_len``
    tokens (``ignore_eos``): ``vllm bench serve``'s random dataset, as token ids."""
    return [RequestSpec(f"r{i}", ids, prompt_len, output_len)
            for i, ids in enumerate(fixed_length_prompts(num, prompt_len, vocab_size, seed))]


# ---------------------------------------------------------------- the scenarios of compare
def kv_pressure_specs(num: int, max_model_len: int, vocab_size: int, seed: int) -> list[RequestSpec]:
    """paged-kv: clients ask for everything that fits (``max_tokens = max_model_len -
    prompt``, prompts uniform ``m/8`` to ``m/4``) but stop reading after a drawn length
    (``stop_after``, uniform ``m/8`` to ``m/4``): contiguous allocation must reserve the
    whole ``max_model_len`` up front, paged allocation only what the sequence has reached."""
    rng, m = random.Random(seed), max_model_len
    specs = []
    for i in range(num):
        p = rng.randint(m // 8, m // 4)
        specs.append(RequestSpec(f"kv-{i}", random_ids(rng, p, vocab_size), p, m - p,
                                 stop_after=rng.randint(m // 8, m // 4), kind="kv"))
    return specs


def decode_and_doc_specs(num_decode: int, num_docs: int, decode_len: int, max_model_len: int, vocab_size: int,
                         seed: int) -> list[RequestSpec]:
    """chunked-prefill: ``num_decode`` decoders (``dec-i``: 16-token prompts, ``decode_len``
    outputs, kind ``decode``) then ``num_docs`` long documents (``doc-j``: prompts uniform
    80% of ``max_model_len`` to ``max_model_len - 8``, 4 outputs, kind ``long-doc``)."""
    rng, m = random.Random(seed), max_model_len
    specs = [RequestSpec(f"dec-{i}", random_ids(rng, 16, vocab_size), 16, decode_len, kind="decode")
             for i in range(num_decode)]
    for j in range(num_docs):
        p = rng.randint(int(0.8 * m), m - 8)
        specs.append(RequestSpec(f"doc-{j}", random_ids(rng, p, vocab_size), p, 4, kind="long-doc"))
    return specs


def long_prefix_specs(num: int, max_model_len: int, vocab_size: int, seed: int) -> list[RequestSpec]:
    """prefix-caching: each prompt one of 4 prefixes of 60% of ``max_model_len`` (drawn up
    front) + 8-32 unique tokens; 8 outputs; kind ``shared-prefix``."""
    rng, m = random.Random(seed), max_model_len
    prefixes = [random_ids(rng, int(0.6 * m), vocab_size) for _ in range(4)]
    specs = []
    for i in range(num):
        ids = rng.choice(prefixes) + random_ids(rng, rng.randint(8, 32), vocab_size)
        specs.append(RequestSpec(f"sp-{i}", ids, len(ids), 8, kind="shared-prefix"))
    return specs


def short_stream_specs(num: int, vocab_size: int, seed: int, name: str, output_len: int,
                       cancel_frac: float = 0.0) -> list[RequestSpec]:
    """overload and cancel-soak: ``{name}-i`` streams of 16-48 prompt tokens and
    ``output_len`` outputs; a ``cancel_frac`` share (kind ``cancel``, the others ``stream``)
    is closed by the client after uniform 2 to ``output_len / 2`` tokens."""
    rng = random.Random(seed)
    specs = []
    for i in range(num):
        p = rng.randint(16, 48)
        cancel = rng.randint(2, output_len // 2) if rng.random() < cancel_frac else None
        specs.append(RequestSpec(f"{name}-{i}", random_ids(rng, p, vocab_size), p, output_len,
                                 cancel_after=cancel, kind="cancel" if cancel else "stream"))
    return specs


def tenant_stream_specs(num: int, vocab_size: int, seed: int, tenant: str, output_len: int) -> list[RequestSpec]:
    """tenants: ``{tenant}-i`` streams of 16-48 prompt tokens and ``output_len`` outputs, sent
    as ``tenant`` (kind ``tenant`` too). No cancellations, and no draw for them: not
    ``short_stream_specs`` with ``cancel_frac=0``, whose ids differ for the same seed."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        p = rng.randint(16, 48)
        out.append(RequestSpec(f"{tenant}-{i}", random_ids(rng, p, vocab_size), p, output_len,
                               kind=tenant, tenant=tenant))
    return out


# ---------------------------------------------------------------- text of one-token words
class WordText:
    """Seeded text of words drawn uniformly, with replacement, from ``words``: with words
    that are one token each after a space (serving/bench_routing.py takes them from the
    model's vocabulary), ``text(n)`` is about ``n`` tokens."""

    def __init__(self, words: list[str], seed: int) -> None:
        self.words, self.rng = words, random.Random(seed)

    def __call__(self, n: int) -> str:
        return " ".join(self.rng.choice(self.words) for _ in range(n))


def word_shared_prefix_prompts(words: list[str], seed: int, num_requests: int, num_prefixes: int, prefix_len: int,
                               suffix_len: int, zipf_s: float = 0.0) -> tuple[list[str], list[int]]:
    """bench_routing's shared_prefix: ``num_prefixes`` prefixes of ``prefix_len`` words;
    each request one of them, a space and ``suffix_len`` words of its own. The prefix is
    drawn uniformly, or with ``zipf_s`` > 0 the i-th (from 0) with weight 1 / (i + 1)^s:
    a few hot prefixes and a long tail, as system prompts and documents are in real traffic.
    Returns the prompts and each one's prefix index."""
    text = WordText(words, seed)
    prefixes = [text(prefix_len) for _ in range(num_prefixes)]
    rng = random.Random(seed + 1)
    if zipf_s > 0:
        picks = rng.choices(range(num_prefixes), weights=[(i + 1) ** -zipf_s for i in range(num_prefixes)],
                            k=num_requests)
    else:
        picks = [rng.randrange(num_prefixes) for _ in range(num_requests)]
    return [prefixes[i] + " " + text(suffix_len) for i in picks], picks


def word_prompts(words: list[str], seed: int, num: int, length: int) -> list[str]:
    """bench_routing's random: ``num`` prompts of ``length`` words, nothing shared."""
    text = WordText(words, seed)
    return [text(length) for _ in range(num)]


# ---------------------------------------------------------------- sessions of the router simulation
@dataclass(frozen=True)
class SessionShape:
    """serving/bench_router_decision's chat sessions: ``sessions_per_replica`` x the
    replicas, each of ``turns`` turns; a turn sends ``user_len`` new tokens after the
    history (its own ``system_len``-token system prompt, the turns before, their outputs)
    and asks for ``output_len``. The lengths are the issue-56 run's (384-token prefixes,
    96-token suffixes, 32 tokens out)."""

    sessions_per_replica: float
    turns: int
    system_len: int = 384
    user_len: int = 96
    output_len: int = 32
    pinned_start: bool = False  # every session's first turn on one replica (a burst placed on stale counts)

    def prompt_lens(self) -> list[int]:
        """Turn k's prompt length, k = 0 .. turns - 1."""
        return [self.system_len + self.user_len + k * (self.output_len + self.user_len) for k in range(self.turns)]


ROUTER_SIM_SHAPES = {
    "few_sessions": SessionShape(3, 8),  # issue 56: 6 long sessions on 2 replicas
    "few_sessions_pinned": SessionShape(3, 8, pinned_start=True),  # ...all begun on one: the skew
    "many_sessions": SessionShape(32, 4),
}
