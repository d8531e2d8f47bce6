"""The prefix cache's changes as events, so a router can see which prefixes a replica holds
(vLLM's KV events: BlockStored, BlockRemoved, AllBlocksCleared).

    BlockPool.cache_block          ─▶ STORED  block_hash   a full block is indexed
    BlockPool._evict               ─▶ REMOVED block_hash   its block was taken for new use
    BlockPool.reset_prefix_cache   ─▶ CLEARED              every prefix forgotten

The hashes are the chained content hashes of kv_cache_utils (salt and tenant folded into
block 0), so a router that hashes a prompt the same way names the same blocks. The
replica takes one batch per step (:meth:`KVEventLog.take`) and publishes it. A subscriber
that joins late or sees a gap in ``seq`` starts over from :meth:`KVEventLog.snapshot`:
every hash cached now, with the ``seq`` of the last batch it includes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STORED, REMOVED = 1, 0


@dataclass(slots=True)
class KVEventBatch:
    seq: int  # 1, 2, 3...: one per batch taken
    cleared: bool = False  # applied first: the prefixes cached before this batch are gone
    # (STORED | REMOVED, block_hash) in the order they happened: a prefix can be evicted
    # and stored again within one step.
    events: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class KVSnapshot:
    seq: int  # the last batch this snapshot includes
    block_hashes: list[int]


class KVEventLog:
    """What BlockPool appends to between two :meth:`take` calls."""

    def __init__(self) -> None:
        self.seq = 0
        self._events: list[tuple[int, int]] = []
        self._cleared = False

    def stored(self, block_hash: int) -> None:
        self._events.append((STORED, block_hash))

    def removed(self, block_hash: int) -> None:
        self._events.append((REMOVED, block_hash))

    def cleared(self) -> None:
        self._events.clear()
        self._cleared = True

    def take(self) -> KVEventBatch | None:
        """The batch since the last take, or None when nothing changed."""
        if not self._events and not self._cleared:
            return None
        self.seq += 1
        batch = KVEventBatch(self.seq, self._cleared, self._events)
        self._events, self._cleared = [], False
        return batch

    def snapshot(self, block_pool) -> KVSnapshot:
        """Every hash ``block_pool`` caches now. Take the pending batch first: the snapshot
        is current to ``self.seq``, and later batches apply on top of it."""
        hashes = [b.block_hash for b in block_pool.cached_block_hash_to_block.values()]
        return KVSnapshot(self.seq, hashes)


class KVView:
    """One replica's cached prefixes as a subscriber sees them: a snapshot, then batches.
    ``apply`` returns False on a gap (a lost batch): the caller fetches a new snapshot."""

    def __init__(self) -> None:
        self.seq = -1  # no snapshot yet: every batch is a gap
        self.hashes: set[int] = set()

    def reset(self, snapshot: KVSnapshot) -> None:
        self.seq = snapshot.seq
        self.hashes = set(snapshot.block_hashes)

    def apply(self, batch: KVEventBatch) -> bool:
        if batch.seq <= self.seq:
            return True  # already in the snapshot
        if self.seq < 0 or batch.seq != self.seq + 1:
            return False
        if batch.cleared:
            self.hashes.clear()
        for kind, block_hash in batch.events:
            if kind == STORED:
                self.hashes.add(block_hash)
            else:
                self.hashes.discard(block_hash)
        self.seq = batch.seq
        return True

    def matched_blocks(self, block_hashes: list[int]) -> int:
        """How many of a prompt's leading blocks this replica holds: a lookup stops at the
        first miss, as the replica's own (kv_cache_manager.get_computed_blocks) does."""
        n = 0
        for h in block_hashes:
            if h not in self.hashes:
                break
            n += 1
        return n


def waiting_prefill(sched) -> int:
    """The prefill tokens the waiting queue still needs, net of what the prefix cache holds
    for each prompt now: the backlog a replica publishes beside its events for the front's KV router.
    Gross, a queue of prompts that share a cached prefix looked like a long backlog and
    sent the next request of that prefix to a replica that had to prefill all of it."""
    kv = sched.kv_cache_manager
    total = 0
    for r in sched.waiting:
        todo = r.num_tokens - r.num_computed_tokens
        if r.num_computed_tokens == 0:
            todo -= kv.get_computed_blocks(r)[1]
        total += todo
    return total


def running_prefill(sched) -> tuple[int, int]:
    """(prompt tokens the running requests still need to prefill, running requests past
    their prefill): the rest of the load a replica publishes for the front's KV router.
    A chunked prefill runs with part of its prompt computed (a request resumed after a
    preemption, with its outputs too); a decoding one has one token to compute, its last
    sample (none, or fewer, under async scheduling)."""
    tokens = decoding = 0
    for r in sched.running:
        todo = r.num_tokens - r.num_computed_tokens
        if todo > 1:
            tokens += todo
        else:
            decoding += 1
    return tokens, decoding
