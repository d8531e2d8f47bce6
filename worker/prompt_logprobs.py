"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): the logprob of each
prompt token given the tokens before it, plus the top-N, from the same forward pass
that prefills the prompt.

The hidden state at position p predicts the token at p + 1, so a chunk that computes
positions [c, c+s) of a prompt of P tokens yields the logprobs of tokens c+1 .. e-1,
e = min(c+s, P):

    positions:   c   c+1  ...  e-1 | e ... (outputs, or the next chunk)
    hidden row:  h_c h_c+1 ... h_e-1
    predicts:    t_c+1 ...     t_e          (only targets < P are prompt tokens)

Chunks tile the prompt, so the pieces tile positions 1..P-1 exactly once (a request
that asks never takes prefix-cache hits, see KVCacheManager.get_computed_blocks; after
a preemption it recomputes and sends the same positions again, which the engine
overwrites by position). Values are "raw" logprobs, log_softmax of the unprocessed
logits, as for sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.scheduler.outputs import Logprobs, PromptLogprobs

# Rows of [rows, vocab] fp32 logits computed at once: bounds memory for a long prompt
# (512 x 128k vocab x 4 B = 256 MiB) while keeping the matmul large.
_MAX_ROWS = 512


@dataclass(slots=True)
class PromptLogprobsRows:
    """One request's share of a step: hidden rows [row, row + count) predict its prompt
    tokens at positions start .. start + count - 1."""

    req_id: str
    row: int
    start: int
    count: int
    num_logprobs: int
    target_ids: list[int]  # the prompt tokens at those positions


def rows_for(req_id: str, prompt_ids: list[int], num_logprobs: int | None, first_row: int,
             start: int, end: int) -> PromptLogprobsRows | None:
    """The share of a request scheduled for positions [start, end) at hidden row
    ``first_row``; None if it did not ask or the chunk predicts no prompt token."""
    if num_logprobs is None:
        return None
    stop = min(end, len(prompt_ids) - 1)  # last hidden position whose target is a prompt token, +1
    if stop <= start:
        return None
    return PromptLogprobsRows(req_id, first_row, start + 1, stop - start, num_logprobs,
                              prompt_ids[start + 1:stop + 1])


def compute_prompt_logprobs(hidden: torch.Tensor, compute_logits,
                            shares: list[PromptLogprobsRows]) -> dict[str, PromptLogprobs]:
    out: dict[str, PromptLogprobs] = {}
    for sh in shares:
        pieces: list[Logprobs] = []
        for off in range(0, sh.count, _MAX_ROWS):
            n = min(_MAX_ROWS, sh.count - off)
            logits = compute_logits(hidden[sh.row + off: sh.row + off + n])
            lp = logits.float().log_softmax(dim=-1)  # [n, V]
            tgt = torch.tensor(sh.target_ids[off:off + n], dtype=torch.int64, device=lp.device)
            tgt_lp = lp.gather(1, tgt.unsqueeze(1))  # [n, 1]
            ranks = ((lp > tgt_lp).sum(dim=-1) + 1).tolist()
            k = min(sh.num_logprobs, lp.shape[1])
            if k > 0:
                top_lp, top_ids = lp.topk(k, dim=-1)
                ids = torch.cat([tgt.unsqueeze(1), top_ids], dim=1).tolist()
                vals = torch.cat([tgt_lp, top_lp], dim=1).tolist()
            else:
                ids, vals = tgt.unsqueeze(1).tolist(), tgt_lp.tolist()
            pieces.extend(Logprobs(token_ids=i, logprobs=v, sampled_rank=r)
                          for i, v, r in zip(ids, vals, ranks))
        out[sh.req_id] = PromptLogprobs(start=sh.start, logprobs=pieces)
    return out
