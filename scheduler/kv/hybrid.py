"""Block tables per KV cache group, for models with sliding-window and full layers (vLLM V1's
hybrid KV cache manager; the groups: kv_groups.py).

Every group keeps one table per request, all of the same logical length (block i of every
group covers tokens [16 i, 16 i + 16)), drawn from one shared pool. A sliding group's rows
read only their window, so once the earliest token a step computes is past a block's last
key by the window, that block is freed (its slot in the table becomes NULL_BLOCK):

    window 24, block 16, 70 tokens computed, next token at position 70 reads keys 47..70
    group 0 full      [b3  b9  b4  b12 b7]
    group 1 sliding   [ -   -   b6  b2  b8]      blocks 0, 1 end before 47: freed

so at long context a sliding group holds about ceil(window / 16) + 1 blocks per request,
and the pool serves the full groups' growth.

The plan carries one id list per request, interleaved by group ([g0 b0, g1 b0, ..., g0 b1,
...]; the worker splits it, worker/step_buffers.py): new blocks arrive for every group at
once (a new logical block), and a freed block is only dropped here: the worker keeps its
stale id, which no kernel reads (they start at the window, kernels/__init__.py).

Prefix caching: group 0 keeps kv_cache_manager's trie of full blocks; every other group
caches its block i under (group, the trie node of block i), so a key names one token prefix
exactly, as the trie's do. A hit of h blocks needs all h in the full groups and, in each
sliding group, only the blocks the window of token 16 h reaches: the others come back as
NULL_BLOCK. The longest h for which every group has its blocks is the hit.

Group 0 is a full group where the model has one. Where every layer slides (Mistral's
window: one sliding group) group 0's own blocks key the trie, so a hit walks every block
of the prefix and needs each still cached, though it takes only the window's; a block freed
before its result came back (a plan ran ahead) ends what that request puts in the trie.

Same interface as KVCacheManager (scheduler.py calls either); ``req_to_logical_blocks``
is each request's logical table (its length what the scheduler's fits-the-last-block test
reads), ``req_to_blocks`` the count of real blocks it holds (what tenant ledgers add up).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagedserve.scheduler.config import CacheConfig
from pagedserve.scheduler.kv.block_pool import BlockPool, KVCacheBlock
from pagedserve.scheduler.kv.kv_cache_utils import ROOT_NODE_ID, cdiv, request_salt
from pagedserve.scheduler.kv.kv_cache_manager import cache_new_full_blocks
from pagedserve.scheduler.kv.kv_groups import KVCacheGroups
from pagedserve.scheduler.request import Request

# A table entry with no block: a sliding group's block before the window (freed, or never
# taken on a prefix hit). Never in the pool; the worker is sent id 0 for it and reads it never.
NULL_BLOCK = KVCacheBlock(0)


class _Held:
    """How many real blocks a request holds (``len``), for scheduler/tenancy.py's ledger."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def __len__(self) -> int:
        return self.n


class HybridHit(list):
    """A prefix hit: the real blocks (a list, as the scheduler and tenant policy count
    them) and ``per_group``, each group's table of the hit (NULL_BLOCK where not needed)."""

    per_group: list[list[KVCacheBlock]]
    node_ids: list[int]  # the trie nodes of the hit's h blocks


class HybridKVCacheManager:
    def __init__(self, cache_config: CacheConfig, max_model_len: int, groups: KVCacheGroups) -> None:
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.contiguous = False  # kv_groups.kv_cache_groups gives no groups to the contiguous baseline
        self.enable_caching = cache_config.enable_prefix_caching
        self.block_pool = BlockPool(cache_config.num_blocks, self.enable_caching)
        self.num_blocks = cache_config.num_blocks
        self.watermark_blocks = math.ceil(cache_config.watermark * cache_config.num_blocks)
        self.groups = groups
        self.num_groups = groups.num_groups
        self.windows = groups.windows
        self.req_tables: dict[str, list[list[KVCacheBlock]]] = {}  # per group, per logical block
        self.req_to_logical_blocks: dict[str, list[KVCacheBlock]] = {}  # group 0's table
        self.req_to_blocks: dict[str, _Held] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}  # interleaved by group (the plan's)
        self.req_to_node_ids: dict[str, list[int]] = {}  # trie nodes of group 0's cached blocks
        self._freed_upto: dict[str, int] = {}  # sliding groups' blocks before this are NULL

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.free_block_queue.num_free_blocks

    def get_block_ids(self, req_id: str) -> list[int]:
        return list(self.req_to_block_ids.get(req_id, ()))

    def max_tokens_per_request(self, max_chunk: int) -> int:
        """The longest sequence the whole pool holds alone (decoding in chunks of up to
        ``max_chunk`` tokens): past it a request would preempt itself forever."""
        lo, hi = 0, self.max_model_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.groups.blocks_per_request(mid, self.block_size, max_chunk) <= self.num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _first_needed(self, group: int, num_computed: int) -> int:
        """The first logical block group ``group`` still needs once ``num_computed`` tokens
        are computed: the block of the next token's earliest key (0 for a full group)."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    # ---- prefix hits --------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix every group can serve (see the module doc). Never
        covers the last token; takes no reference (``allocate_slots`` does)."""
        pooling = getattr(request, "pooling_params", None)
        if (not self.enable_caching or request.sampling_params.prompt_logprobs is not None
                or (pooling is not None and not pooling.reads_prefix_cache)):
            return [], 0
        bs = self.block_size
        tokens = request.all_token_ids
        cached = self.block_pool.cached_block_hash_to_block
        full: list[KVCacheBlock] = []
        parent = ROOT_NODE_ID
        extra = request_salt(request)
        for i in range((len(tokens) - 1) // bs):
            block = cached.get((parent, tuple(tokens[i * bs:(i + 1) * bs]), extra))
            if block is None:
                break
            full.append(block)
            parent = block.node_id
            extra = None
        nodes = [b.node_id for b in full]
        h = len(full)
        while h > 0:  # the longest h whose needed blocks every other group has
            first = self._first_needed(0, h * bs)
            per_group = [[NULL_BLOCK] * first + full[first:h]]
            for g in range(1, self.num_groups):
                first = self._first_needed(g, h * bs)
                blocks = [cached.get((g, nodes[i])) for i in range(first, h)]
                if None in blocks:
                    break
                per_group.append([NULL_BLOCK] * first + blocks)
            else:
                hit = HybridHit(b for blocks in per_group for b in blocks if b is not NULL_BLOCK)
                hit.per_group = per_group
                hit.node_ids = nodes[:h]
                return hit, h * bs
            h -= 1
        return [], 0

    # ---- allocation -----------------------------------------------------------------------
    def _free_outside_windows(self, req_id: str, num_computed: int) -> None:
        """Free the sliding groups' blocks no row from ``num_computed`` on reads."""
        table = self.req_tables[req_id]
        start = self._freed_upto[req_id]
        end = min(self._first_needed(g, num_computed) for g in range(self.num_groups) if self.windows[g])
        end = min(end, len(table[0]))
        if end <= start:
            return
        ids, held, freed = self.req_to_block_ids[req_id], self.req_to_blocks[req_id], []
        G = self.num_groups
        for g in range(G):
            if self.windows[g] is None:
                continue
            row = table[g]
            for i in range(start, min(self._first_needed(g, num_computed), len(row))):
                block = row[i]
                if block is not NULL_BLOCK:
                    freed.append(block)
                    row[i] = NULL_BLOCK
                    ids[i * G + g] = 0
        held.n -= len(freed)
        self._freed_upto[req_id] = end
        self.block_pool.free_blocks(freed)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        check_watermark: bool = False,
        reserve_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """As KVCacheManager.allocate_slots: the new blocks (in the plan's interleaved order),
        or None when the pool is short (then only blocks past every window were freed).
        Blocks the sliding groups no longer reach are freed first and may be taken again."""
        req_id = request.req_id
        bs, G = self.block_size, self.num_groups
        table = self.req_tables.get(req_id)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        if table is not None:
            self._free_outside_windows(req_id, num_computed)
            held_logical = len(table[0])
        else:
            held_logical = num_new_computed_tokens // bs
        num_new_logical = max(0, cdiv(num_computed + num_new_tokens, bs) - held_logical)
        if num_new_logical == 0 and not new_computed_blocks:
            return []
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        num_free = self.block_pool.free_block_queue.num_free_blocks - reserve_blocks
        if check_watermark:
            num_free -= self.watermark_blocks
        if num_new_logical * G + num_revived > num_free:
            return None
        if table is None:
            per_group = getattr(new_computed_blocks, "per_group", None) or [[] for _ in range(G)]
            table = self.req_tables[req_id] = [list(blocks) for blocks in per_group]
            self.req_to_logical_blocks[req_id] = table[0]
            self.req_to_blocks[req_id] = held = _Held()
            self.req_to_block_ids[req_id] = [table[g][i].block_id for i in range(len(table[0])) for g in range(G)]
            self.req_to_node_ids[req_id] = list(getattr(new_computed_blocks, "node_ids", ()))
            self._freed_upto[req_id] = min((self._first_needed(g, num_computed) for g in range(G)
                                            if self.windows[g]), default=0)
            if new_computed_blocks:
                self.block_pool.touch(new_computed_blocks)
                held.n += len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_logical * G) if num_new_logical else []
        ids = self.req_to_block_ids[req_id]
        for j, block in enumerate(new_blocks):
            table[j % G].append(block)
            ids.append(block.block_id)
        self.req_to_blocks[req_id].n += len(new_blocks)
        return new_blocks

    # ---- the prefix cache -------------------------------------------------------------------
    def cache_full_blocks(self, request: Request) -> None:
        """Offer the request's newly full, computed blocks to the prefix cache: group 0's to
        the trie, the other groups' under (group, that block's trie node)."""
        if not self.enable_caching:
            return
        node_ids = self.req_to_node_ids.get(request.req_id)
        if node_ids is None:
            return
        table = self.req_tables[request.req_id]
        pool = self.block_pool

        def other_groups(i: int, node: int) -> None:
            for g in range(1, self.num_groups):
                block = table[g][i]
                if block is not NULL_BLOCK:  # freed already (a plan ran ahead of this result)
                    pool.cache_block_quietly(block, (g, node))

        # A sliding group 0 may have freed a block not yet cached: the trie ends before it.
        first_null = next((i for i in range(len(node_ids), len(table[0])) if table[0][i] is NULL_BLOCK), None)
        cache_new_full_blocks(pool, self.block_size, request, node_ids, table[0], other_groups, first_null)

    def free(self, request: Request) -> None:
        """Return every group's blocks, tail first (see block_pool)."""
        req_id = request.req_id
        table = self.req_tables.pop(req_id, None)
        for d in (self.req_to_logical_blocks, self.req_to_blocks, self.req_to_block_ids, self.req_to_node_ids,
                  self._freed_upto):
            d.pop(req_id, None)
        if table:
            G = self.num_groups
            blocks = (table[g][i] for i in range(len(table[0]) - 1, -1, -1) for g in range(G))
            self.block_pool.free_blocks([b for b in blocks if b is not NULL_BLOCK])

    # ---- what the tests and kv-size read --------------------------------------------------
    def held_blocks(self, req_id: str) -> list[int]:
        """Real blocks ``req_id`` holds in each group."""
        return [sum(b is not NULL_BLOCK for b in row) for row in self.req_tables.get(req_id, ())]
