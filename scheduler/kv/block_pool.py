"""The pool of KV cache blocks: ref counts, an LRU free queue and the prefix-cache index.

A block is in exactly one of three states:

    in use        ref_cnt >= 1, not in the free queue (held by 1+ block tables)
    free, cached  ref_cnt == 0, in the free queue, still indexed by its BlockKey:
                  a later request with the same prefix can take it back (a hit)
    free, empty   ref_cnt == 0, in the free queue, no key

Allocation takes the block at the head of the free queue (the least recently freed),
dropping its cache entry: the prefix it held is evicted only when it is the oldest
free block. Callers free a sequence's blocks tail first, so within one sequence the
last block is evicted first and the shared-prefix blocks survive longest:

    free(seq [b3 b7 b2])  ->  free queue: ... b2 b7 b3      (head ... tail)
                                          ^ evicted before b7, then b3
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedserve.scheduler.kv.kv_cache_utils import BlockKey
from pagedserve.scheduler.kv.kv_events import KVEventLog


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "block_key", "node_id",
                 "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is in the prefix cache: the content hash of its prefix
        # (see kv_cache_utils), the dict key, and its node id in the prefix trie.
        self.block_hash: int | None = None
        self.block_key: BlockKey | None = None
        self.node_id = 0
        # Links of the doubly linked free queue (None while the block is in use).
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_key is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (head: evicted next).

    A deque cannot remove from the middle in O(1), which a prefix hit on a free
    cached block needs; this list links the blocks themselves, between two sentinels.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail (O(n); for tests and debugging)."""
        out = []
        block = self._head.next_free_block
        while block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # The prefix cache: BlockKey -> the one block holding that prefix. A block whose
        # key is already present (two requests computed the same prefix at once) stays
        # uncached; only the first copy is indexed.
        self.cached_block_hash_to_block: dict[BlockKey, KVCacheBlock] = {}
        self._next_node_id = 1  # 0 is the trie root (kv_cache_utils.ROOT_NODE_ID)
        # Set by a replica whose prefixes a router follows (kv_events.py); None: no events.
        self.kv_events: KVEventLog | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue (ref_cnt becomes 1),
        evicting whatever prefix they cached. Raises if there are not enough: callers
        check ``num_free_blocks`` first (capacity failure is their ``None``)."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks, only "
                             f"{self.free_block_queue.num_free_blocks} left")
        queue = self.free_block_queue
        out = []
        for _ in range(num_blocks):
            block = queue.popleft()
            if block.block_key is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if self.cached_block_hash_to_block.get(block.block_key) is block:
            del self.cached_block_hash_to_block[block.block_key]
            if self.kv_events is not None and block.block_hash is not None:
                self.kv_events.removed(block.block_hash)
        # Children keyed under this node id become unreachable; node ids are never
        # reused, so they can only miss, never match a different prefix.
        block.block_key = None
        block.block_hash = None
        block.node_id = 0

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue's tail
        in the given order (so pass a sequence's blocks tail first)."""
        queue = self.free_block_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue.append(block)
            elif block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} freed more often than taken")

    def get_cached_block(self, key: BlockKey) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(key)

    def cache_block(self, block: KVCacheBlock, key: BlockKey, block_hash: int) -> int:
        """Index a full, computed block under ``key``; return the trie node id of its
        prefix (the existing one when another block already holds that prefix)."""
        if block.block_key is not None:  # already cached (e.g. it came from a hit)
            return block.node_id
        existing = self.cached_block_hash_to_block.get(key)
        if existing is not None:
            return existing.node_id
        block.block_key = key
        block.block_hash = block_hash
        block.node_id = self._next_node_id
        self._next_node_id += 1
        self.cached_block_hash_to_block[key] = block
        if self.kv_events is not None:
            self.kv_events.stored(block_hash)
        return block.node_id

    def cache_block_quietly(self, block: KVCacheBlock, key: tuple) -> None:
        """Index a full, computed block under ``key`` with no hash and no KV event: a
        hybrid cache's other groups (kv/hybrid.py), whose prefixes group 0's blocks name."""
        if block.block_key is None and key not in self.cached_block_hash_to_block:
            block.block_key = key
            self.cached_block_hash_to_block[key] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only allowed when no block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_key = None
            block.block_hash = None
            block.node_id = 0
        self.cached_block_hash_to_block.clear()
        if self.kv_events is not None:
            self.kv_events.cleared()
        return True
