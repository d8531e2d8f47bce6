"""Per-step sampling metadata: the batch's SamplingParams turned into tensors, once.

The model runner keeps per-request state (token ids, generator) and calls
``SamplingMetadata.build`` every step for the rows that sample. ``build`` runs for up
to ``max_num_seqs`` rows per step, so it only materialises what some row uses:

    all rows greedy, no penalties, no min_tokens, no logprobs
        -> no tensors at all; the sampler does one argmax
    some row random        -> temperature [R] (+ top_k / top_p / min_p if any row sets them)
    some row penalised     -> output_counts [Q, V] for those Q rows (+ prompt_mask for repetition)
    some row below min_tokens -> (row, token) index pairs set to -inf
    some row sets logit_bias  -> (row, token, bias) triples, added in one index_put_
    some row is constrained   -> its rows and their packed allowed-token bitmask [G, W]

Rows that do not use a feature get its neutral value (top_k = V, min_p = 0, penalties
0 / 0 / 1), so each filter runs batched over the rows without branches; top-p, whose
sort is the one costly step, runs only on the rows that set it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from pagedserve.scheduler.sampling_params import _GREEDY_EPS, SamplingParams

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# Logits stay finite when divided by this (|logit| + 100 of bias, / 1e-5 of temperature).
_MIN_REPETITION_PENALTY = 1e-20


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator of a seeded request. The runner creates it once, when
    the request first appears, and keeps it for the request's life: each step draws a
    fixed amount of noise from it, so the sample depends only on (seed, step)."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # The random path works on the R non-greedy rows only; fields below marked [R] are
    # indexed by position among them. ``random_rows`` [R] int64 maps back to the batch
    # (None when all rows are random).
    random_rows: torch.Tensor | None = None
    temperature: torch.Tensor | None = None  # [R] float32
    # [R] int64 (V where a row does not filter), None when no random row uses top-k.
    top_k: torch.Tensor | None = None
    max_top_k: int = 0  # largest k < V in the batch (topk() needs a Python int)
    # top-p only touches the rows that set it (a full sort per row is the costly part):
    # top_p_rows [P] int64 into [R], top_p [P] float32.
    top_p_rows: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    # True when every top-p row also has a top-k: top-p then runs on the top-k candidates
    # instead of a sort of the whole vocabulary.
    top_p_within_top_k: bool = False
    min_p: torch.Tensor | None = None  # [R] float32
    # position in [R] -> its own generator (seeded requests on the random path only).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Penalties on the Q penalised rows only, None when no row is penalised.
    # ``penalty_rows`` [Q] int64 maps back to the batch (None when Q = B).
    penalty_rows: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None  # [Q, 1]
    frequency_penalty: torch.Tensor | None = None  # [Q, 1]
    repetition_penalty: torch.Tensor | None = None  # [Q, 1]
    output_counts: torch.Tensor | None = None  # [Q, V] float32
    prompt_mask: torch.Tensor | None = None  # [Q, V] bool, None when no repetition penalty
    # min_tokens: logits[min_tokens_rows, min_tokens_cols] = -inf (stop tokens not yet allowed).
    min_tokens_rows: torch.Tensor | None = None
    min_tokens_cols: torch.Tensor | None = None
    # logit_bias: logits[logit_bias_rows, logit_bias_cols] += logit_bias_values.
    logit_bias_rows: torch.Tensor | None = None
    logit_bias_cols: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None  # float32
    # Structured outputs: the constrained rows, and allowed tokens packed 32 to an int32
    # word as xgrammar fills them, one row per batch row [B, ceil(V / 32)] (-1, all
    # allowed, on the other rows: xgrammar's kernel indexes logits and mask alike).
    grammar_rows: list[int] | None = None
    grammar_bitmask: torch.Tensor | None = None
    # Logprobs: rows that asked, their N, and the largest N (top-N computed once).
    logprob_rows: list[int] = field(default_factory=list)
    num_logprobs: list[int] = field(default_factory=list)
    max_num_logprobs: int = -1
    # row -> the token ids whose logprobs it asked for instead of the top N (logprob_token_ids)
    logprob_token_ids: dict[int, list[int]] = field(default_factory=dict)

    @property
    def needs_penalties(self) -> bool:
        return self.output_counts is not None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        stop_token_ids: list[set[int]],
        vocab_size: int,
        device: torch.device | str,
        grammar_bitmask: list[np.ndarray | None] | None = None,
    ) -> "SamplingMetadata":
        """``grammar_bitmask``: per row, its packed allowed-token words (int32 [W]) or None
        for an unconstrained row; None when no row is constrained."""
        n = len(params)
        greedy = [p.temperature < _GREEDY_EPS for p in params]
        num_greedy = sum(greedy)
        md = cls(num_rows=n, vocab_size=vocab_size,
                 all_greedy=num_greedy == n, all_random=num_greedy == 0)

        # One pass for the features any row (greedy or not) may use.
        pen_rows: list[int] = []
        mt_rows: list[int] = []
        mt_cols: list[int] = []
        lb_rows: list[int] = []
        lb_cols: list[int] = []
        lb_vals: list[float] = []
        g_rows = [] if grammar_bitmask is None else [i for i, m in enumerate(grammar_bitmask)
                                                     if m is not None]
        for i, p in enumerate(params):
            if p.logprobs is not None:
                md.logprob_rows.append(i)
                md.num_logprobs.append(0 if p.logprob_token_ids else p.logprobs)
                if p.logprob_token_ids:
                    md.logprob_token_ids[i] = list(p.logprob_token_ids)
            if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                    or p.repetition_penalty != 1.0):
                pen_rows.append(i)
            if p.logit_bias:
                for t, b in p.logit_bias.items():
                    if t < vocab_size:  # ids were checked against the vocabulary on entry
                        lb_rows.append(i)
                        lb_cols.append(t)
                        lb_vals.append(b)
            # A constrained row's grammar decides when it may end: masking its stop tokens
            # too could leave no allowed token at all (a finished grammar allows only EOS).
            if (p.min_tokens and len(output_token_ids[i]) < p.min_tokens
                    and p.structured_outputs is None):
                for t in stop_token_ids[i]:
                    if 0 <= t < vocab_size:
                        mt_rows.append(i)
                        mt_cols.append(t)
        if md.num_logprobs:
            md.max_num_logprobs = max(md.num_logprobs)
        if mt_rows:
            md.min_tokens_rows = torch.tensor(mt_rows, dtype=torch.int64, device=device)
            md.min_tokens_cols = torch.tensor(mt_cols, dtype=torch.int64, device=device)
        if lb_rows:
            md.logit_bias_rows = torch.tensor(lb_rows, dtype=torch.int64, device=device)
            md.logit_bias_cols = torch.tensor(lb_cols, dtype=torch.int64, device=device)
            md.logit_bias_values = torch.tensor(lb_vals, dtype=torch.float32, device=device)
        if g_rows:
            words = np.full((n, len(grammar_bitmask[g_rows[0]])), -1, dtype=np.int32)
            for i in g_rows:
                words[i] = grammar_bitmask[i]
            md.grammar_rows = g_rows
            md.grammar_bitmask = torch.from_numpy(words).to(device)
        if pen_rows:
            _build_penalties(md, params, pen_rows, prompt_token_ids, output_token_ids, device)
        if not md.all_greedy:
            _build_random(md, params, greedy, generators, device)
        return md


def _build_random(md: SamplingMetadata, params: list[SamplingParams], greedy: list[bool],
                  generators: list[torch.Generator | None], device) -> None:
    """Tensors for the random rows only (indices ``random_rows``): greedy rows never
    pay for noise, sorting or softmax."""
    v = md.vocab_size
    rows = [i for i, g in enumerate(greedy) if not g]
    # A temperature past float32's range would be inf there, and -inf / inf is NaN.
    temps = [min(params[i].temperature, _FLOAT32_MAX) for i in rows]
    ks = [params[i].top_k if 0 < params[i].top_k < v else v for i in rows]
    ps = [params[i].top_p for i in rows]
    mps = [params[i].min_p for i in rows]
    md.generators = {j: generators[i] for j, i in enumerate(rows) if generators[i] is not None}
    md.temperature = torch.tensor(temps, dtype=torch.float32, device=device)
    if not md.all_random:
        md.random_rows = torch.tensor(rows, dtype=torch.int64, device=device)
    used_ks = [k for k in ks if k < v]
    if used_ks:
        md.top_k = torch.tensor(ks, dtype=torch.int64, device=device)
        md.max_top_k = max(used_ks)
    p_rows = [j for j, p in enumerate(ps) if p < 1.0]
    if p_rows:
        md.top_p_rows = torch.tensor(p_rows, dtype=torch.int64, device=device)
        md.top_p = torch.tensor([ps[j] for j in p_rows], dtype=torch.float32, device=device)
        md.top_p_within_top_k = all(ks[j] < v for j in p_rows)
    if max(mps) > 0.0:
        md.min_p = torch.tensor(mps, dtype=torch.float32, device=device)


def _build_penalties(md: SamplingMetadata, params: list[SamplingParams], pen_rows: list[int],
                     prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                     device) -> None:
    """Tensors for the penalised rows only (indices ``penalty_rows``): their cost is
    O(their tokens + their rows x V), whatever the batch size."""
    n, v = len(pen_rows), md.vocab_size
    ps = [params[i] for i in pen_rows]
    if n < md.num_rows:
        md.penalty_rows = torch.tensor(pen_rows, dtype=torch.int64, device=device)
    md.presence_penalty = torch.tensor([p.presence_penalty for p in ps], device=device).unsqueeze(1)
    md.frequency_penalty = torch.tensor([p.frequency_penalty for p in ps], device=device).unsqueeze(1)
    # A penalty that float32 flushes to 0 (any value accepted is > 0) would divide a
    # logit by 0: below _MIN_REPETITION_PENALTY it acts as that (a seen positive logit is
    # then past every unseen one anyway), so the logits stay finite.
    md.repetition_penalty = torch.tensor([max(p.repetition_penalty, _MIN_REPETITION_PENALTY)
                                          for p in ps], device=device).unsqueeze(1)
    md.output_counts = _token_histogram(n, v, [output_token_ids[i] for i in pen_rows], device)
    rep = [j for j, p in enumerate(ps) if p.repetition_penalty != 1.0]
    if rep:
        prompts = [prompt_token_ids[i] if j in rep else [] for j, i in enumerate(pen_rows)]
        md.prompt_mask = _token_histogram(n, v, prompts, device) > 0


def _token_histogram(n: int, v: int, token_ids: list[list[int]], device) -> torch.Tensor:
    """[n, v] float32: how often each token occurs in ``token_ids[j]``. Ids past the
    model's vocabulary (tokenizer-only added tokens) land in a dropped pad column."""
    lens = [len(t) for t in token_ids]
    # np.fromiter: much faster than torch.tensor(list) on the ~10^4 ids of a big batch.
    flat = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=sum(lens))
    cols = torch.from_numpy(flat).to(device)
    rows = torch.repeat_interleave(torch.arange(n, device=device),
                                   torch.tensor(lens, dtype=torch.int64, device=device))
    counts = torch.zeros(n, v + 1, dtype=torch.float32, device=device)
    counts.view(-1).index_add_(0, rows * (v + 1) + cols.clamp_(0, v),
                               torch.ones_like(cols, dtype=torch.float32))
    return counts[:, :v]
