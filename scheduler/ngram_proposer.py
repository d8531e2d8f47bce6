"""Prompt lookup (n-gram) drafting for speculative decoding, and when to stop drafting.

A decoding request whose last n tokens occurred earlier in its own tokens (prompt or
output) proposes the tokens that followed its first occurrence; one forward pass then checks
them all (worker/model_runner.py), and every draft token the model agrees with is a token
gained for free:

    tokens:   ... the quick brown fox jumps over ... | the quick brown   (last n = 3)
                  └─ earlier "the quick brown" ─┘ └ proposed: "fox jumps over"

The first occurrence, as vLLM's proposer: it has the longest continuation, which matters
in a loop (a repeated phrase's latest occurrence ends right before the suffix and could
propose one token). The search is an index, not a scan: per request and per n, a dict
from the hash of each n-gram to the position where it first ended, extended by the tokens appended since the
previous proposal. A step costs O(new tokens x number of n) dict operations, whatever the
prompt length; the first proposal indexes the prompt once. A hash collision only makes a
wrong draft, which verification rejects like any other.

Adaptive: a request whose drafts keep being rejected pauses drafting for a number of steps
that doubles with each pause (a wrong draft costs compute: its tokens run through the
model), and so does one that finds nothing to propose for a while (a request that does
not draft leaves the engine free to plan ahead, cluster/engine/llm_engine.py).
"""

from __future__ import annotations

import time

from pagedserve.scheduler.config import SpeculativeConfig

# Acceptance rate (accepted / proposed, smoothed) below which a request pauses drafting.
ACCEPTANCE_FLOOR = 0.25
_EWMA_WEIGHT = 0.3
# Proposals that found no match in a row before a request pauses drafting.
MAX_EMPTY_PROPOSALS = 8
_FIRST_PAUSE_STEPS = 8
_MAX_PAUSE_STEPS = 256


class _RequestIndex:
    __slots__ = ("maps", "num_indexed", "acceptance", "num_empty", "paused_until", "pause_steps")

    def __init__(self, ns: range) -> None:
        self.maps = {n: {} for n in ns}  # n -> {hash of n tokens: where they first end}
        self.num_indexed = 0  # n-grams ending at positions < this are in the maps
        self.acceptance = 1.0  # smoothed accepted / proposed
        self.num_empty = 0  # proposals in a row that found no match
        self.paused_until = -1  # step id from which it drafts again
        self.pause_steps = _FIRST_PAUSE_STEPS

    def pause(self, step_id: int) -> None:
        self.paused_until = step_id + self.pause_steps
        self.pause_steps = min(2 * self.pause_steps, _MAX_PAUSE_STEPS)
        self.acceptance = 2 * ACCEPTANCE_FLOOR  # a fresh chance after the pause, not a blank cheque
        self.num_empty = 0


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.ns = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)  # longest first
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
        return index is None or step_id >= index.paused_until

    def propose(self, req_id: str, tokens: list[int], max_k: int, step_id: int) -> list[int]:
        """Up to ``max_k`` tokens that followed the first earlier occurrence of the
        longest suffix of ``tokens`` (between prompt_lookup_min and _max tokens long);
        [] if none occurred."""
        t0 = time.perf_counter()
        index = self._index.get(req_id)
        if index is None:
            index = self._index[req_id] = _RequestIndex(self.ns)
        num_tokens = len(tokens)
        # Index every n-gram that ends before the last token: the suffix itself must
        # match an earlier occurrence, never itself.
        for n, table in index.maps.items():
            for end in range(max(index.num_indexed, n - 1), num_tokens - 1):
                table.setdefault(hash(tuple(tokens[end - n + 1:end + 1])), end)
        index.num_indexed = max(index.num_indexed, num_tokens - 1)
        draft: list[int] = []
        for n, table in index.maps.items():
            if num_tokens < n:
                continue
            end = table.get(hash(tuple(tokens[num_tokens - n:])))
            if end is not None:
                draft = tokens[end + 1:end + 1 + max_k]
                break
        if draft:
            index.num_empty = 0
        else:
            index.num_empty += 1
            if index.num_empty >= MAX_EMPTY_PROPOSALS:
                index.pause(step_id)
        self.num_proposals += 1
        self.propose_time_s += time.perf_counter() - t0
        return draft

    def record(self, req_id: str, num_draft: int, num_accepted: int, step_id: int) -> None:
        """The verification of a draft of ``num_draft`` tokens accepted the first
        ``num_accepted``."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted):
            per_pos[i] += 1
        index = self._index.get(req_id)
        if index is None:
            return
        index.acceptance += _EWMA_WEIGHT * (num_accepted / num_draft - index.acceptance)
        if index.acceptance < ACCEPTANCE_FLOOR:
            index.pause(step_id)
        elif num_accepted:
            index.pause_steps = _FIRST_PAUSE_STEPS

    def free(self, req_id: str) -> None:
        self._index.pop(req_id, None)
