"""StepTimer: how long the steps the engine waited for took, for the draft proposer's cost
model (scheduler/ngram_proposer.py: StepCost fits step time to tokens, DraftingGate weighs
the host's time between steps against what drafting saves).

    sent at t0 ──▶ worker runs ──▶ result at t1        step time: t1 - t0 (or the worker's own
                                                       execute_s where the host worked meanwhile)
    previous end ───── idle ─────▶ t0'                 host time: what the worker waited for
                                                       the host (planning, outputs, the trips)

Only steps taken in turn are timed (sync stepping, or drafts waited for): a pipelined step
overlaps the host's work by design, so its wait says nothing about either. ``reset()`` marks
a break (an idle engine, a pipelined step): the next gap is not the host's work.
"""

from __future__ import annotations


class StepTimer:
    def __init__(self, scheduler) -> None:
        self._scheduler = scheduler  # its record_step_time / record_host_time feed the proposer
        self.last_end: float | None = None  # when the last step timed in turn ended
        self.sent_in_turn: float | None = None  # when the step in flight was sent in turn; else None

    def reset(self) -> None:
        self.last_end = None

    def in_turn(self, plan, result, t1: float, t0: float, overlapped: bool = False) -> None:
        """A step taken in turn, sent at t0, waited for until t1: its time for the cost model,
        and how long the worker sat idle since the last one ended (the host's work, the
        plan's and the result's trips), what planning ahead overlaps with the step, up to the
        step's own length (beyond it the engine had nothing to run). Where the host processed
        outputs meanwhile (``overlapped``), t1 - t0 may hold some of that work: the worker's
        own time stands for the step."""
        step_s = (result.execute_s or t1 - t0) if overlapped else t1 - t0
        self._scheduler.record_step_time(plan.total_num_scheduled_tokens, step_s)
        if self.last_end is not None:
            busy = result.execute_s or t1 - t0
            self._scheduler.record_host_time(min(max(t1 - self.last_end - busy, 0.0), busy))
        self.last_end = t1
