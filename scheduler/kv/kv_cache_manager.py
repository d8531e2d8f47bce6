"""Per-request block tables on top of the block pool: allocation on demand, prefix hits,
caching of full blocks, and freeing.

Slots of one request with block_size 4 (c: K/V computed, n: scheduled now, .: empty):

    block table [7, 2, 9]      b7: c c c c | b2: c c n n | b9: n . . .
    num_computed_tokens = 6, num_new_tokens = 3 -> needs cdiv(9, 4) = 3 blocks

"paged" takes a block only when a token needs its slot, so a sequence wastes at most
block_size - 1 slots. "contiguous" (the pre-vLLM baseline) reserves
cdiv(prompt + max_tokens, block_size) blocks at admission and never shares them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagedserve.scheduler.kv.block_pool import BlockPool, KVCacheBlock
from pagedserve.scheduler.config import CacheConfig
from pagedserve.scheduler.kv.kv_cache_utils import ROOT_NODE_ID, cdiv, extend_block_hashes, request_salt
from pagedserve.scheduler.request import Request


class KVCacheManager:
    def __init__(self, cache_config: CacheConfig, max_model_len: int) -> None:
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.contiguous = cache_config.kv_allocation == "contiguous"
        # Sharing reserved regions makes no sense for the contiguous baseline.
        self.enable_caching = cache_config.enable_prefix_caching and not self.contiguous
        self.block_pool = BlockPool(cache_config.num_blocks, self.enable_caching)
        self.num_blocks = cache_config.num_blocks
        self.watermark_blocks = math.ceil(cache_config.watermark * cache_config.num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # What the scheduler's fits-the-last-block test reads: here the table itself (a
        # hybrid cache's, kv/hybrid.py, is its full group's table).
        self.req_to_logical_blocks = self.req_to_blocks
        # Same tables as plain ids, kept in step so a plan never rebuilds them.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # Trie node ids of each request's cached full blocks, in order; its length is
        # the number of the request's blocks already offered to the prefix cache.
        self.req_to_node_ids: dict[str, list[int]] = {}

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.free_block_queue.num_free_blocks

    def get_block_ids(self, req_id: str) -> list[int]:
        return list(self.req_to_block_ids.get(req_id, ()))

    def max_tokens_per_request(self, max_chunk: int) -> int:
        """The longest sequence the whole pool holds alone."""
        return self.num_blocks * self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of ``request``'s tokens, as blocks and a token count.

        Never covers the last token: it must be computed to produce logits. Takes no
        reference; ``allocate_slots`` does, if the request is admitted."""
        # Prompt logprobs need logits at every prompt position: a hit would skip them
        # (vLLM skips the cache for such requests too). Its blocks are still cached after.
        # So does MEAN or CLS pooling, which needs positions a hit skips (pooling_params.py).
        pooling = request.pooling_params
        if (not self.enable_caching or request.sampling_params.prompt_logprobs is not None
                or (pooling is not None and not pooling.reads_prefix_cache)):
            return [], 0
        bs = self.block_size
        tokens = request.all_token_ids
        max_hit_blocks = (len(tokens) - 1) // bs
        cached = self.block_pool.cached_block_hash_to_block
        hits: list[KVCacheBlock] = []
        parent = ROOT_NODE_ID
        extra = request_salt(request)
        for i in range(max_hit_blocks):
            block = cached.get((parent, tuple(tokens[i * bs:(i + 1) * bs]), extra))
            if block is None:
                break
            hits.append(block)
            parent = block.node_id
            extra = None
        return hits, len(hits) * bs

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        check_watermark: bool = False,
        reserve_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (and the
        prefix hit ``new_computed_blocks``, taken over here). Returns the newly taken
        blocks (maybe []), or None if the pool is short: nothing changes then.

        ``check_watermark``: admission of a new request must leave ``watermark_blocks``
        free so that running requests can still grow next step without preempting.
        ``reserve_blocks``: further blocks to leave free (reserved for other tenants)."""
        req_id = request.req_id
        blocks = self.req_to_blocks.get(req_id)
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if blocks is not None and not new_computed_blocks:
            # Hot path: a decode step that still fits its last block.
            num_new_blocks = -(-num_tokens // self.block_size) - len(blocks)
            if num_new_blocks <= 0:
                return []
        else:
            if blocks is None and self.contiguous:
                max_tokens = request.max_tokens
                if max_tokens is None:
                    max_tokens = self.max_model_len - request.num_prompt_tokens
                num_tokens = max(num_tokens, request.num_prompt_tokens + max_tokens)
            num_held = (len(blocks) if blocks is not None else 0) + len(new_computed_blocks)
            num_new_blocks = max(0, cdiv(num_tokens, self.block_size) - num_held)
        # Hit blocks that sit in the free queue leave it when we take them.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        num_free = self.block_pool.free_block_queue.num_free_blocks
        if check_watermark:
            num_free -= self.watermark_blocks
        num_free -= reserve_blocks
        if num_new_blocks + num_revived > num_free:
            return None
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
            self.req_to_block_ids[req_id] = []
            self.req_to_node_ids[req_id] = []
        block_ids = self.req_to_block_ids[req_id]
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            block_ids.extend(b.block_id for b in new_computed_blocks)
            self.req_to_node_ids[req_id].extend(b.node_id for b in new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        blocks.extend(new_blocks)
        block_ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    def cache_full_blocks(self, request: Request) -> None:
        """Offer the request's full blocks whose K/V is computed to the prefix cache.
        Call after the step that computed them (the worker has written their K/V)."""
        if not self.enable_caching:
            return
        node_ids = self.req_to_node_ids.get(request.req_id)
        if node_ids is not None:
            cache_new_full_blocks(self.block_pool, self.block_size, request, node_ids,
                                  self.req_to_blocks[request.req_id])

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first (see block_pool)."""
        req_id = request.req_id
        blocks = self.req_to_blocks.pop(req_id, None)
        self.req_to_block_ids.pop(req_id, None)
        self.req_to_node_ids.pop(req_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))


def cache_new_full_blocks(pool: BlockPool, block_size: int, request: Request, node_ids: list[int],
                          blocks: Sequence[KVCacheBlock], also=None, limit: int | None = None) -> None:
    """Put ``request``'s full blocks whose K/V is computed and that the trie does not hold
    yet (those past ``node_ids``, its trie nodes so far) into the prefix cache, keyed by
    their tokens under their parent block's node (the first salted); ``node_ids`` grows.
    ``also(i, node)``: called after block i is cached as ``node`` (the hybrid manager's
    other groups). ``limit``: cache none from block ``limit`` on."""
    bs = block_size
    tokens = request.all_token_ids
    num_full = min(request.num_computed_tokens, len(tokens)) // bs
    if limit is not None:
        num_full = min(num_full, limit)
    start = len(node_ids)
    if start >= num_full:
        return
    hashes = extend_block_hashes(request, bs, num_full)
    parent = node_ids[-1] if node_ids else ROOT_NODE_ID
    for i in range(start, num_full):
        extra = request_salt(request) if i == 0 else None
        parent = pool.cache_block(blocks[i], (parent, tuple(tokens[i * bs:(i + 1) * bs]), extra), hashes[i])
        node_ids.append(parent)
        if also is not None:
            also(i, parent)


def make_kv_cache_manager(cache_config: CacheConfig, max_model_len: int):
    """KVCacheManager, or for a model with sliding-window and full layers (cache_config's
    kv_groups) the hybrid manager, kv/hybrid.py, which gives each group its own tables."""
    if cache_config.kv_groups is None:
        return KVCacheManager(cache_config, max_model_len)
    from pagedserve.scheduler.kv.hybrid import HybridKVCacheManager

    return HybridKVCacheManager(cache_config, max_model_len, cache_config.kv_groups)
