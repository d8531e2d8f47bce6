"""The batched sampler: logits [B, V] -> one token per row, on the logits' device.

Order of operations (vLLM V1 / Hugging Face):

    raw logits ──▶ logprobs (log_softmax of the raw logits, vLLM's default "raw" mode)
        │
        ▼ logit_bias (+= per (row, token)), greedy rows too
        ▼ structured outputs: tokens the row's grammar forbids -> -inf (bitmask rows only)
        ▼ penalties (repetition on prompt+output tokens; presence/frequency on output counts)
        ▼ min_tokens: stop tokens -> -inf while a row is below its min_tokens
        ├──▶ greedy rows: argmax
        ▼ random rows: / temperature ▶ top-k ▶ top-p ▶ softmax ▶ min-p ▶ inverse CDF

Every filter keeps at least one token for every value it accepts (top-k keeps k >= 1,
top-p always keeps the most likely token, min-p <= 1 keeps the maximum), and the logits
it filters are finite or -inf (sampling_metadata.py clamps a temperature or a repetition
penalty that would divide by zero or infinity in float32). So every row has a token of
positive probability and its sampled id lies in [0, V); ``Sampler`` checks that once per
step and raises ``SamplerError`` for a row that breaks it (the model runner then fails
that request alone), so a bad id never reaches the next step's embedding.

Inverse-CDF sampling draws one uniform number per row: token = the first index whose
cumulative probability reaches u x total. A seeded row draws its number from its own
generator, exactly one per step, so its token depends on its logits and (seed, step)
only, never on the other rows (every op is row-wise). The alternative, the exponential
race argmax(probs / q) with q ~ Exp(1) per vocab entry, gives the same guarantee but
draws V random numbers per row, and is much slower on CPU (random generation dominates).

Speculative decoding: a row may carry a draft token d, the token a draft proposes for the
position this row samples. A greedy row samples its argmax as always (the draft is
accepted when the two are equal). A random row keeps the target distribution p exactly by
rejection sampling against the draft's distribution q; a prompt-lookup draft is one token
with certainty (q = 1 at d), so the rule is: accept d with probability p(d), else sample
from p with d removed (the residual max(p - q, 0), renormalised). Then
P(d) = p(d) and P(x) = (1 - p(d)) p(x) / (1 - p(d)) = p(x) for every other x. Such a row
draws two numbers (the test, then the residual's inverse CDF).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.scheduler.outputs import Logprobs
from pagedserve.worker.sampling_metadata import SamplingMetadata, make_generator

__all__ = ["Sampler", "SamplerError", "SamplerOutput", "SamplingMetadata", "make_generator"]


class SamplerError(RuntimeError):
    """A row sampled an id outside the vocabulary: a bug in the sampler, caught here."""


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64, on the logits' device
    # None when no row asked; else one entry per row (None for rows that did not ask).
    logprobs: list[Logprobs | None] | None = None


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Noise for unseeded random rows: this generator if given (the engine's seed),
        # else torch's default generator for the logits' device.
        self.generator = generator

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata,
                 draft_token_ids: torch.Tensor | None = None) -> SamplerOutput:
        """``draft_token_ids``: [B] int64, the draft token each row verifies, -1 for a
        row without one (see the module docstring); None: no row has one."""
        assert logits.dim() == 2 and logits.shape[0] == md.num_rows, (
            f"logits {tuple(logits.shape)} do not match {md.num_rows} sampling rows")
        logprobs = compute_logprobs(logits, md) if md.logprob_rows else None
        # The caller's logits are never written to: the first modifying op copies.
        owned = False
        if md.logit_bias_rows is not None or md.grammar_rows is not None:
            logits, owned = _own_copy(logits), True
            if md.logit_bias_rows is not None:
                logits.index_put_((md.logit_bias_rows, md.logit_bias_cols), md.logit_bias_values,
                                  accumulate=True)
            if md.grammar_rows is not None:
                apply_token_bitmask_(logits, md.grammar_rows, md.grammar_bitmask)
        if md.needs_penalties:
            if md.penalty_rows is None:
                logits = apply_penalties(logits.float(), md)
            else:
                if not owned:
                    logits = _own_copy(logits)
                logits[md.penalty_rows] = apply_penalties(logits[md.penalty_rows], md)
            owned = True
        if md.min_tokens_rows is not None:
            if not owned:
                logits = _own_copy(logits)
            logits[md.min_tokens_rows, md.min_tokens_cols] = float("-inf")
        if md.all_greedy:
            sampled = logits.argmax(dim=-1)
        elif md.all_random:
            sampled = self._sample_random(logits, md, draft_token_ids)
        else:
            sampled = logits.argmax(dim=-1)
            drafts = draft_token_ids[md.random_rows] if draft_token_ids is not None else None
            sampled[md.random_rows] = self._sample_random(logits[md.random_rows], md, drafts)
        _check_range(sampled, md.vocab_size)
        if logprobs is not None:
            logprobs = _gather_logprobs(logprobs, sampled, md)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata,
                       drafts: torch.Tensor | None = None) -> torch.Tensor:
        """[R, V] logits of the random rows -> [R] tokens; ``drafts`` [R] (-1: none)
        switches rows that have one to rejection sampling."""
        logits = logits.float() / md.temperature.unsqueeze(1)  # new tensor: in-place below is safe
        candidates = None
        if md.top_k is not None:
            candidates = apply_top_k(logits, md.top_k, md.max_top_k)
        if md.top_p is not None:
            apply_top_p(logits, md, candidates if md.top_p_within_top_k else None)
        probs = logits.softmax(dim=-1)
        if md.min_p is not None:
            apply_min_p(probs, md.min_p)
        u = torch.empty(probs.shape[0], 1 if drafts is None else 2, dtype=torch.float32, device=probs.device)
        if len(md.generators) < probs.shape[0]:
            u.uniform_(generator=self.generator)
        for j, gen in md.generators.items():
            u[j].uniform_(generator=gen)
        if drafts is None:
            return sample_inverse_cdf(probs, u)
        has_draft = drafts >= 0
        d = drafts.clamp(min=0).unsqueeze(1)
        p_d = probs.gather(1, d).masked_fill_(~has_draft.unsqueeze(1), 0.0)
        # min_p leaves probs unnormalised: the test compares against the row's total.
        accept = (u[:, 1:] * probs.sum(dim=-1, keepdim=True) < p_d).squeeze(1)
        residual = probs.scatter_add(1, d, p_d.neg()).clamp_(min=0.0)  # rows without a draft: + 0
        return torch.where(accept, d.squeeze(1), sample_inverse_cdf(residual, u[:, :1]))


def _check_range(sampled: torch.Tensor, vocab_size: int) -> None:
    """Raises SamplerError if a sampled id is outside [0, vocab_size). One reduction and
    one host sync per step; the ids cross to the host right after anyway."""
    if sampled.numel() and not bool(((sampled >= 0) & (sampled < vocab_size)).all()):
        bad = sorted({t for t in sampled.tolist() if not 0 <= t < vocab_size})
        raise SamplerError(f"sampled token id {bad[0]} outside the vocabulary [0, {vocab_size}) "
                           "(a row with no token of positive probability)")


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (>= 0, need not sum to 1), u [R, 1] in [0, 1) -> [R] int64.

    x = (1 - u) x total lies in (0, total]; the first index with cdf >= x always has
    probs > 0: a zero-probability token repeats its predecessor's cdf, so the search
    stops before it, and x > 0 skips leading zeros. x <= total = cdf[-1] keeps the
    index < V."""
    cdf = probs.cumsum(dim=-1)
    x = (1.0 - u) * cdf[:, -1:]
    return torch.searchsorted(cdf, x, right=False).squeeze(1)


def _own_copy(logits: torch.Tensor) -> torch.Tensor:
    """A float32 tensor the sampler may write to (one copy, not two, for bf16 logits)."""
    return logits.clone() if logits.dtype == torch.float32 else logits.float()


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, W] int32 packed words -> [G, vocab_size] bool (True: allowed). Bit b of word w
    is token 32 w + b; tokens past 32 W (logits wider than the grammar's vocabulary) are
    not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [G, 32 W]
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(bits.shape[0], vocab_size - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def apply_token_bitmask_torch_(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """The plain-torch version of ``apply_token_bitmask_`` (no xgrammar needed)."""
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    allowed = unpack_bitmask(bitmask.index_select(0, idx), logits.shape[1])
    logits[idx] = logits[idx].masked_fill_(~allowed, float("-inf"))


def apply_token_bitmask_(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: logits[r, t] = -inf for each r in ``rows`` wherever bit t of bitmask[r]
    ([B, W] int32, one row per logits row) is clear; other rows are untouched.
    xgrammar's kernel (C++ on CPU, CUDA/Triton on GPU) when installed: much faster than
    unpacking the bits with torch ops."""
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        apply_token_bitmask_torch_(logits, rows, bitmask)
        return
    width = 32 * bitmask.shape[1]
    apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(width, logits.shape[1]), indices=rows)
    if logits.shape[1] > width:  # logits wider than the grammar's vocabulary: never allowed
        logits[torch.tensor(rows, device=logits.device), width:] = float("-inf")


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Returns a new tensor. Repetition (CTRL / HF / vLLM): a seen token's logit is
    divided by the penalty when positive, multiplied when negative, so penalty > 1 always
    makes it less likely. Presence/frequency (OpenAI) subtract from output tokens only."""
    counts = md.output_counts  # [Q, V], Q = the penalised rows given in ``logits``
    if md.prompt_mask is not None:
        seen = md.prompt_mask | (counts > 0)
        rep = torch.where(seen, md.repetition_penalty, 1.0)
        logits = torch.where(logits > 0, logits / rep, logits * rep)
    else:
        logits = logits.clone()
    logits -= md.frequency_penalty * counts
    logits -= md.presence_penalty * (counts > 0).float()
    return logits


def apply_top_k(logits: torch.Tensor, k: torch.Tensor,
                max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks (in place) all but each row's k largest logits to -inf; k = V on rows that
    do not filter. A partial topk(max_k) beats a full sort. Ties at the k-th value are
    kept (as in vLLM). Returns the candidates (values sorted descending, -inf past each
    row's k; their vocab ids) for ``apply_top_p``."""
    vals, idx = logits.topk(max_k, dim=-1)
    # Rows with k > max_k are the unfiltered ones (k = V): their threshold is -inf.
    kth = vals.gather(1, (k.clamp(max=max_k) - 1).unsqueeze(1))
    kth.masked_fill_((k > max_k).unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))
    return vals.masked_fill_(vals < kth, float("-inf")), idx


def apply_top_p(logits: torch.Tensor, md: SamplingMetadata,
                candidates: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Nucleus filter (in place) on the rows that set top_p: keep the most likely
    tokens until their mass reaches p, i.e. drop a token when the mass of the tokens
    ranked above it is already >= p (the largest one always stays). Same set as vLLM's
    ascending rule "drop while cumsum <= 1 - p"."""
    rows = md.top_p_rows
    if candidates is not None:
        # Every top-p row has a top-k, so all but its candidates are -inf: no full sort.
        vals, idx = candidates[0][rows], candidates[1][rows]
        out = torch.full((rows.numel(), logits.shape[1]), float("-inf"), device=logits.device)
    else:
        vals, idx = logits[rows].sort(dim=-1, descending=True)
        out = torch.empty_like(vals)
    probs = vals.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    drop = mass_above >= md.top_p.unsqueeze(1)
    # The most likely token always stays, whatever p: a p that float32 flushes to 0 (a
    # denormal such as 1e-309) would otherwise drop every token (mass_above 0 >= 0).
    drop[:, 0] = False
    vals.masked_fill_(drop, float("-inf"))
    logits[rows] = out.scatter_(1, idx, vals)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zeroes (in place) tokens whose probability is below min_p x the row's top
    probability. No renormalisation needed: the inverse CDF scales by the row's total."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill_(probs < threshold, 0.0)


def compute_logprobs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    rows = md.logprob_rows
    raw = logits if len(rows) == md.num_rows else logits[rows]
    return raw.float().log_softmax(dim=-1)  # [R, V]


def _gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor,
                     md: SamplingMetadata) -> list[Logprobs | None]:
    """Per asking row: [sampled, top-1 .. top-N] ids and logprobs, and the sampled
    token's 1-based rank (1 + how many tokens are strictly more likely)."""
    rows = md.logprob_rows
    tok = sampled if len(rows) == md.num_rows else sampled[rows]
    tok_lp = logprobs.gather(1, tok.unsqueeze(1))  # [R, 1]
    ranks = (logprobs > tok_lp).sum(dim=-1) + 1
    n = min(md.max_num_logprobs, logprobs.shape[1])
    if n > 0:
        top_lp, top_ids = logprobs.topk(n, dim=-1)
        ids = torch.cat([tok.unsqueeze(1), top_ids], dim=1)
        lps = torch.cat([tok_lp, top_lp], dim=1)
    else:
        ids, lps = tok.unsqueeze(1), tok_lp
    # One device->host copy per tensor, then plain lists.
    ids_l, lps_l, ranks_l = ids.tolist(), lps.tolist(), ranks.tolist()
    out: list[Logprobs | None] = [None] * md.num_rows
    for j, (row, num) in enumerate(zip(rows, md.num_logprobs)):
        asked = md.logprob_token_ids.get(row)
        if asked is not None:  # the sampled token, then these ids (vLLM's logprob_token_ids)
            picked = logprobs[j, torch.tensor(asked, device=logprobs.device)].tolist()
            out[row] = Logprobs(token_ids=[ids_l[j][0], *asked], logprobs=[lps_l[j][0], *picked],
                                sampled_rank=ranks_l[j])
            continue
        out[row] = Logprobs(token_ids=ids_l[j][: 1 + num], logprobs=lps_l[j][: 1 + num],
                            sampled_rank=ranks_l[j])
    return out
