"""Prompt lookup (n-gram) drafting for speculative decoding, and how many drafts pay.

A decoding request whose last n tokens occurred earlier in its own tokens (prompt or
output) proposes the tokens that followed one of those occurrences; one forward pass then
checks them all (worker/model_runner.py), and every draft token the model agrees with is a
token gained for free:

    tokens:   ... the quick brown fox jumps over ... | the quick brown   (last n = 3)
                  └─ earlier "the quick brown" ─┘ └ proposed: "fox jumps over"

Which occurrence, where the n tokens occurred more than once (a common pair of tokens, a
phrase the text repeats): the one whose tokens before it match the suffix's own for the
longest stretch (up to _CONTEXT_CAP), since the request is most likely copying that
passage; on a tie, the one with the longer continuation (up to the draft's length: in a
loop the latest occurrence ends right before the suffix and could propose one token), then
the latest. vLLM's proposer takes the first occurrence, which is the same choice where the
n tokens occur once. The search is an index, not a scan: per request and per n, a dict from
the hash of each n-gram to the positions where it ended, extended by the tokens appended
since the previous proposal. A step costs O(new tokens x number of n) dict operations plus
the comparison of the last _MAX_OCCURRENCES occurrences' contexts, whatever the prompt
length; the first proposal indexes the prompt once. A hash collision only makes a wrong
draft, which verification rejects like any other.

How many drafts pay. A draft token is not free: it runs through the model. A step costs
about t0 + c x (tokens in it): t0 reads the weights, c is the compute of one more token
(large on a CPU, small on a GPU until big batches). ``StepCost`` fits t0 and c to the steps
the engine times, and keeps each small step size's own measured time too: on a CPU the
cost is a staircase, not a line (a second row rides free on the weights' stream, a few
more cost one step up), and the line alone would draw the cut in the wrong place. ``select``
ranks the step's draft tokens by their probability of acceptance, most likely first, and
verifies the prefix of that ranking with the most expected tokens per second of step
(measured time where the size was seen, the line elsewhere). Nearly every draft pays at
batch 1, only likely ones in a big batch, so the probabilities must tell likely drafts
from unlikely ones.

The probability that a draft's token i is accepted. Two things tell most, together the
draft's kind: the length n of the suffix that matched (a long match is likely to sit inside a
passage being copied, a short one may be a common pair of tokens followed by something else),
and whether the request's last verified draft was accepted whole (a request in the middle of
copying a passage goes on copying it; a long match right after a rejection is often where the
output left the passage). ``AcceptanceModel`` keeps, per kind, the rate at which draft token
i is accepted once the ones before it were (shared by all requests: decayed counts), and per
request and kind the rate of its first tokens, drawn toward the shared one while the request
has few drafts of its own. A draft's tokens are then accepted with the cumulative products of
these rates.

Pauses: a request whose smoothed per-token acceptance falls below ACCEPTANCE_FLOOR pauses
drafting for a number of steps that doubles with each pause, then tries again; so do the
requests of a step none of whose drafts pays (the step could then be planned ahead). A
draft cut to nothing beside others that pay costs no pause: the step goes in turn anyway,
and the request's next draft may pay.
With ``pause_when_idle`` (set when the engine may plan ahead) one that finds nothing to
propose for a while pauses too: a request that does not draft leaves the engine free to
plan a step ahead (cluster/engine/llm_engine.py).

Stepping in turn has a price of its own when the engine could plan ahead: the host's work
between two steps (planning, output processing, streaming, the plan's and the result's
trips) no longer overlaps the running step, and the worker sits idle meanwhile.
``DraftingGate`` weighs it, over the steps taken in turn to draft: the time the accepted
drafts saved (a pipelined step's time per token, from ``StepCost``) less their rows'
compute and the worker's idle time the engine measures. When that comes out below zero over
a few steps, every request stops drafting for a while (doubling, as the pauses above),
the engine plans ahead again, then drafting is tried anew. A workload whose drafts are
rarely right then runs as without speculation.
"""

from __future__ import annotations

import time

from pagedserve.scheduler.config import SpeculativeConfig

# Smoothed per-token acceptance below which a request pauses drafting, whatever the cost
# (the cost model decides above it: at batch 1 a draft costs so little that rarely-right
# ones still pay, and a higher floor would pause requests that gain from drafting).
ACCEPTANCE_FLOOR = 0.1
_EWMA_WEIGHT = 0.3
_PRIOR_ALPHA = 0.7  # a new request's acceptance estimate, before any verification
_PRIOR_WEIGHT = 2.0  # pseudo-drafts behind a prior rate: what a few verdicts outweigh
_SHARED_DECAY = 0.995  # per verdict: the shared rates follow the last few hundred drafts
_REQUEST_DECAY = 0.9  # per draft: a request's own rate follows its last ten or so drafts
_GATE_WEIGHT = 0.2  # EWMA weight of one step in turn in the gate's net gain
_GATE_MIN_STEPS = 8  # steps in turn the gate sees before it may close
_MAX_OCCURRENCES = 16  # the latest occurrences of a suffix whose contexts are compared
_CONTEXT_CAP = 32  # tokens before an occurrence compared with those before the suffix
_TABLE_MAX_TOKENS = 64  # step sizes (tokens) whose own measured time StepCost keeps
_TABLE_WEIGHT = 0.2  # EWMA weight of one step in its size's measured time
_TABLE_MIN_STEPS = 3  # steps of a size seen before its measured time replaces the line's
# Proposals that found no match in a row before a request pauses (with pause_when_idle).
MAX_EMPTY_PROPOSALS = 8
_FIRST_PAUSE_STEPS = 8
_MAX_PAUSE_STEPS = 256


class StepCost:
    """Step time ~ t0 + c x tokens, fitted by least squares with exponential forgetting to
    the steps the engine reports, and per step size up to _TABLE_MAX_TOKENS the size's own
    measured time (EWMA); until it has seen two sizes, a prior c / t0."""

    PRIOR_C_OVER_T0 = 0.05
    _DECAY = 0.98

    def __init__(self) -> None:
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self._table: dict[int, list[float]] = {}  # tokens -> [steps seen, EWMA seconds]

    def record(self, num_tokens: int, seconds: float) -> None:
        d = self._DECAY
        self._w = d * self._w + 1.0
        self._n = d * self._n + num_tokens
        self._t = d * self._t + seconds
        self._nn = d * self._nn + num_tokens * num_tokens
        self._nt = d * self._nt + num_tokens * seconds
        if num_tokens <= _TABLE_MAX_TOKENS:
            cell = self._table.get(num_tokens)
            if cell is None:
                self._table[num_tokens] = [1.0, seconds]
            else:
                cell[0] += 1.0
                cell[1] += _TABLE_WEIGHT * (seconds - cell[1])

    def fit(self) -> tuple[float, float] | None:
        """(t0, c) in seconds, or None before two step sizes were seen (all steps the same
        size: no slope to see yet)."""
        w = self._w
        if w < 2.0:
            return None
        mean_n, mean_t = self._n / w, self._t / w
        var = self._nn / w - mean_n * mean_n
        if var < 0.25:
            return None
        c = (self._nt / w - mean_n * mean_t) / var
        return mean_t - c * mean_n, c

    def step_time(self):
        """A function: tokens -> the expected time of a step of that many tokens, in
        seconds once the line is fitted (a size's own measured time where it was seen
        often enough), before that (or on a fit that says nothing) in units of t0 from
        the prior."""
        fit = self.fit()
        if fit is None or (fit[0] <= 0.0 and fit[1] <= 0.0):
            x = self.PRIOR_C_OVER_T0
            return lambda n: 1.0 + x * n
        t0, c = fit[0], max(fit[1], 0.0)
        table = self._table

        def time(n: int) -> float:
            cell = table.get(n)
            if cell is not None and cell[0] >= _TABLE_MIN_STEPS:
                return cell[1]
            return max(t0 + c * n, 1e-9)
        return time

    def select(self, probs: dict[str, list[float]], num_base_tokens: int) -> dict[str, int]:
        """How many tokens of each draft to verify (see the module docstring), for a step
        of ``num_base_tokens`` decoding requests, given the probability that each draft's
        first 1, 2, ... tokens are all accepted (non-increasing): req_id -> a count, 0 for
        none."""
        tokens = max(num_base_tokens, 1)
        time = self.step_time()
        candidates = sorted(((p, r) for r, ps in probs.items() for p in ps), reverse=True)
        gain = float(tokens)  # expected tokens of the step with the first i candidates
        best, best_rate = 0, gain / time(tokens)
        for i, (p, _) in enumerate(candidates, 1):
            if p <= 0.0:
                break
            gain += p
            rate = gain / time(tokens + i)
            if rate > best_rate:
                best, best_rate = i, rate
        keep = dict.fromkeys(probs, 0)
        for _, r in candidates[:best]:
            keep[r] += 1
        return keep


class AcceptanceModel:
    """The probability that each token of a draft is accepted (see the module docstring):
    per kind of draft (the match length n; whether the request's last verified draft was
    accepted whole), the shared rate of draft token i given the tokens before it (decayed
    counts), and per request the rate of its first tokens, shrunk toward the shared one."""

    def __init__(self, ns: range, k: int) -> None:
        prior = (_PRIOR_WEIGHT * _PRIOR_ALPHA, _PRIOR_WEIGHT)  # (accepted, verified)
        self._shared = {(n, whole): [list(prior) for _ in range(k)] for n in ns for whole in (False, True)}

    def probs(self, own: dict[tuple[int, bool], list[float]], kind: tuple[int, bool], length: int) -> list[float]:
        """P(the first 1, 2, ... ``length`` tokens are all accepted) for a draft of this
        kind (n, last draft accepted whole); ``own``: the request's first-token counts per kind."""
        shared = self._shared[kind]
        hits, trials = own.get(kind, (0.0, 0.0))
        first_hits, first_trials = shared[0]
        p = (hits + _PRIOR_WEIGHT * first_hits / first_trials) / (trials + _PRIOR_WEIGHT)
        out = [p]
        for i in range(1, length):
            h, t = shared[i]
            p *= h / t
            out.append(p)
        return out

    def record(self, own: dict[tuple[int, bool], list[float]], kind: tuple[int, bool], num_draft: int,
               num_accepted: int) -> None:
        """Token i of the draft was verified when all before it were accepted."""
        shared = self._shared[kind]
        for i in range(min(num_accepted + 1, num_draft)):
            cell = shared[i]
            cell[0] = _SHARED_DECAY * cell[0] + (i < num_accepted)
            cell[1] = _SHARED_DECAY * cell[1] + 1.0
        cell = own.setdefault(kind, [0.0, 0.0])
        cell[0] = _REQUEST_DECAY * cell[0] + (num_accepted > 0)
        cell[1] = _REQUEST_DECAY * cell[1] + 1.0


class Backoff:
    """A pause that doubles each time it is taken (_FIRST_PAUSE_STEPS, twice that, ... up to
    _MAX_PAUSE_STEPS) and is short again once what it paused pays."""

    __slots__ = ("until", "steps")

    def __init__(self) -> None:
        self.until = -1  # step id from which the pause is over
        self.steps = _FIRST_PAUSE_STEPS  # the next pause's length

    def pause(self, step_id: int) -> None:
        self.until = step_id + self.steps
        self.steps = min(2 * self.steps, _MAX_PAUSE_STEPS)

    def reset(self) -> None:
        self.steps = _FIRST_PAUSE_STEPS

    def over(self, step_id: int) -> bool:
        return step_id >= self.until


class DraftingGate:
    """Whether stepping in turn to draft pays, where the engine could plan ahead instead
    (see the module docstring). The scheduler notes each step it plans in turn to draft
    and the drafts it verified; the engine, how long the worker sat idle before such a
    step."""

    def __init__(self, cost: StepCost) -> None:
        self.cost = cost
        self.host_s = 0.0  # EWMA: the worker's idle time between two steps taken in turn
        self.net_s = 0.0  # EWMA: seconds a step in turn gained by drafting (< 0: lost)
        self.num_steps = 0  # steps in turn seen since the gate last opened
        self.backoff = Backoff()  # how long it stays closed
        self._pending: tuple[int, int] | None = None  # (decoding requests, draft rows) of the last step
        self._accepted = 0

    def record_host_time(self, seconds: float) -> None:
        """The worker's idle time before a step taken in turn (the engine measures it)."""
        self.host_s += _GATE_WEIGHT * (seconds - self.host_s) if self.host_s else seconds

    def open(self, step_id: int) -> bool:
        self._settle(step_id)
        return self.backoff.over(step_id)

    def note_step(self, step_id: int, num_decoding: int, num_rows: int) -> None:
        """A step planned in turn to draft: its decoding requests, the draft rows it verifies."""
        self._settle(step_id)
        self._pending = (num_decoding, num_rows)
        self._accepted = 0

    def note_accepted(self, num_accepted: int) -> None:
        self._accepted += num_accepted

    def _settle(self, step_id: int) -> None:
        """Fold the last step in turn (its verdicts are in) into the net gain; close the
        gate for a while if drafting lost time over the last few such steps."""
        pending, self._pending = self._pending, None
        fit = self.cost.fit()
        if pending is None or fit is None:
            return
        num_decoding, num_rows = pending
        t0, c = fit
        per_token = t0 / max(num_decoding, 1) + c  # a pipelined step's time per token
        net = self._accepted * per_token - c * num_rows - self.host_s
        self.net_s += _GATE_WEIGHT * (net - self.net_s)
        self.num_steps += 1
        if self.num_steps < _GATE_MIN_STEPS:
            return
        if self.net_s < 0.0:
            self.backoff.pause(step_id)
            self.net_s, self.num_steps = 0.0, 0
        else:
            self.backoff.reset()


def _best_occurrence(tokens: list[int], ends: list[int], n: int, max_k: int) -> int:
    """Of the occurrences of the last n tokens that end at ``ends``, the one to draft from
    (module docstring): the longest matching context before it, then the longer
    continuation, then the latest."""
    num_tokens = len(tokens)
    suffix_start = num_tokens - n

    def rank(end: int) -> tuple[int, int, int]:
        start = end - n + 1
        m = 0
        while m < _CONTEXT_CAP and m < start and tokens[start - 1 - m] == tokens[suffix_start - 1 - m]:
            m += 1
        return m, min(num_tokens - 1 - end, max_k), end

    return max(ends, key=rank)


class _RequestIndex:
    __slots__ = ("maps", "num_indexed", "alpha", "num_empty", "backoff", "whole", "draft_kind", "own")

    def __init__(self, ns: range) -> None:
        self.maps = {n: {} for n in ns}  # n -> {hash of n tokens: [where they end, ascending]}
        self.num_indexed = 0  # n-grams ending at positions < this are in the maps
        self.alpha = _PRIOR_ALPHA  # smoothed probability that a draft token is accepted
        self.num_empty = 0  # proposals in a row that found no match
        self.backoff = Backoff()  # its drafting pauses
        self.whole = False  # whether its last verified draft was accepted whole
        self.draft_kind = (0, False)  # its last draft's (match length, whole before it)
        # kind -> its first draft tokens' decayed [accepted, verified]
        self.own: dict[tuple[int, bool], list[float]] = {}

    def pause(self, step_id: int) -> None:
        self.backoff.pause(step_id)
        self.alpha = max(self.alpha, 0.5)  # a fresh chance after the pause, not a blank cheque
        self.num_empty = 0


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.ns = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)  # longest first
        self.cost = StepCost()
        self.acceptance = AcceptanceModel(self.ns, self.k)
        self.gate = DraftingGate(self.cost)
        self.pause_when_idle = False  # the engine sets it when it may plan a step ahead
        self._index: dict[str, _RequestIndex] = {}
        # Counters under vLLM's names (SchedulerStats): drafts proposed, their tokens, the
        # tokens accepted, and per draft position how often it was accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.k
        self.num_proposals = 0  # propose() calls (with or without a draft)
        self.propose_time_s = 0.0  # time spent in propose(): the drafting cost of the steps

    def active(self, req_id: str, step_id: int) -> bool:
        """Whether the request drafts at this step (not paused)."""
        index = self._index.get(req_id)
        return index is None or index.backoff.over(step_id)

    def propose(self, req_id: str, tokens: list[int], max_k: int, step_id: int) -> list[int]:
        """Up to ``max_k`` tokens that followed an earlier occurrence (the module docstring
        says which) of the longest suffix of ``tokens`` between prompt_lookup_min and _max
        tokens long; [] if none occurred."""
        t0 = time.perf_counter()
        index = self._index.get(req_id)
        if index is None:
            index = self._index[req_id] = _RequestIndex(self.ns)
        num_tokens = len(tokens)
        # Index every n-gram that ends before the last token: the suffix itself must
        # match an earlier occurrence, never itself.
        for n, table in index.maps.items():
            for end in range(max(index.num_indexed, n - 1), num_tokens - 1):
                table.setdefault(hash(tuple(tokens[end - n + 1:end + 1])), []).append(end)
        index.num_indexed = max(index.num_indexed, num_tokens - 1)
        draft: list[int] = []
        for n, table in index.maps.items():
            if num_tokens < n:
                continue
            ends = table.get(hash(tuple(tokens[num_tokens - n:])))
            if ends:
                end = ends[-1] if len(ends) == 1 else _best_occurrence(tokens, ends[-_MAX_OCCURRENCES:], n, max_k)
                draft = tokens[end + 1:end + 1 + max_k]
                index.draft_kind = (n, index.whole)
                break
        if draft:
            index.num_empty = 0
        else:
            index.num_empty += 1
            if self.pause_when_idle and index.num_empty >= MAX_EMPTY_PROPOSALS:
                index.pause(step_id)
        self.num_proposals += 1
        self.propose_time_s += time.perf_counter() - t0
        return draft

    def select(self, drafts: dict[str, list[int]], num_base_tokens: int, step_id: int) -> None:
        """Cut each draft (in place; emptied if nothing of it pays) to the tokens worth
        verifying in a step of ``num_base_tokens`` decoding requests; if nothing of any
        draft pays, the requests pause."""
        probs = {}
        for r, d in drafts.items():
            index = self._index[r]
            probs[r] = self.acceptance.probs(index.own, index.draft_kind, len(d))
        keep = self.cost.select(probs, num_base_tokens)
        for r, n in keep.items():
            del drafts[r][n:]
        if not any(keep.values()):
            for r in keep:
                self._index[r].pause(step_id)

    def record(self, req_id: str, num_draft: int, num_accepted: int, step_id: int) -> None:
        """The verification of a draft of ``num_draft`` tokens accepted the first
        ``num_accepted``: a run of successes, then one failure unless all were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted):
            per_pos[i] += 1
        self.gate.note_accepted(num_accepted)
        index = self._index.get(req_id)
        if index is None:
            return
        self.acceptance.record(index.own, index.draft_kind, num_draft, num_accepted)
        index.whole = num_accepted == num_draft
        trials = num_accepted + (num_accepted < num_draft)
        index.alpha += _EWMA_WEIGHT * (num_accepted / trials - index.alpha)
        if index.alpha < ACCEPTANCE_FLOOR:
            index.pause(step_id)
        elif num_accepted:
            index.backoff.reset()

    def free(self, req_id: str) -> None:
        self._index.pop(req_id, None)
