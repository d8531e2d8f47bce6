"""Reserved capacity, preemption victims and "why is my request waiting", for the scheduler.

A request belongs to two classes: its tenant and ``"priority:N"``. A reservation
(config.Reservation) on a class holds KV blocks and batch slots back from every other
class. While a class uses less than its reservation:

    - admission of anyone else leaves the unused part free (reason "reserved" otherwise);
    - its own waiting head is admitted first, preempting others' running requests if the
      pool is full ("a request of a reserved class is admitted at once");
    - its running requests are not preemption victims for others.

Why-waiting reasons, for each waiting request after a schedule():

    no_blocks     the KV pool could not hold its next chunk (or this step preempted)
    no_budget     the step's token budget was used up
    max_seqs      max_num_seqs requests are running
    reserved      it would fit, but only into capacity reserved for another class
    tenant_share  its tenant got more than its fair share; another tenant goes first
    queue_order   it waits behind earlier requests of its own tenant
    static_batch  scheduling_policy "static" and a batch is still running
    lora_slots    its LoRA adapter is not running and max_loras others are (scheduler/lora.py)
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler.config import Reservation
from pagedserve.scheduler.request import Request

WHY_REASONS = ("no_blocks", "no_budget", "max_seqs", "reserved", "tenant_share", "queue_order", "static_batch",
               "lora_slots")


def classes_of(req: Request) -> tuple[str, str]:
    return req.tenant, f"priority:{req.priority}"


@dataclass(slots=True)
class Usage:
    blocks: int = 0
    seqs: int = 0


class Ledger:
    """Blocks and slots in use per reserved class, for one schedule() (kept in step with
    admissions and preemptions made during it)."""

    def __init__(self, reservations: dict[str, Reservation], running: list[Request],
                 blocks_of: dict[str, list]) -> None:
        self.reservations = reservations
        self.used = {k: Usage() for k in reservations}
        for req in running:
            self.add(req, len(blocks_of.get(req.req_id, ())))

    def add(self, req: Request, num_blocks: int, seqs: int = 1) -> None:
        for k in classes_of(req):
            u = self.used.get(k)
            if u is not None:
                u.blocks += num_blocks
                u.seqs += seqs

    def unused(self, key: str) -> Usage:
        r, u = self.reservations[key], self.used[key]
        return Usage(max(0, r.blocks - u.blocks), max(0, r.seqs - u.seqs))

    def held_for_others(self, req: Request) -> Usage:
        """Unused reserved capacity of the classes ``req`` does not belong to."""
        mine = classes_of(req)
        out = Usage()
        for k in self.reservations:
            if k not in mine:
                free = self.unused(k)
                out.blocks += free.blocks
                out.seqs += free.seqs
        return out

    def within_reservation(self, req: Request) -> bool:
        """Does ``req`` run on its class's reserved capacity (so others may not preempt it)?"""
        for k in classes_of(req):
            r, u = self.reservations.get(k), self.used.get(k)
            if r is None or not (r.blocks or r.seqs):
                continue
            if (r.blocks == 0 or u.blocks <= r.blocks) and (r.seqs == 0 or u.seqs <= r.seqs):
                return True
        return False

    def reserved_keys_waiting(self) -> list[str]:
        return [k for k in self.reservations if self.unused(k).blocks or self.unused(k).seqs]


def victim_key(req: Request, step_id: int, protect_steps: int, priority_policy: bool,
               ledger: Ledger | None):
    """Larger = preempted first: the lower class (priority policy), not on reserved
    capacity, not resumed within ``protect_steps`` (hysteresis), cheapest to recompute
    (fewest computed tokens), then the most recent arrival."""
    protected = ledger is not None and ledger.within_reservation(req)
    fresh = req.resumed_step >= 0 and step_id - req.resumed_step < protect_steps
    return (req.priority if priority_policy else 0, not protected, not fresh,
            -req.num_computed_tokens, req.arrival_time)
