"""Chained block hashing for the prefix cache.

A full block's identity is its whole prefix, not just its own tokens:

    block 0: hash(ROOT_HASH,  tokens[0:16],  salt)   salt: cache_salt, tenant, LoRA adapter; block 0 only
    block 1: hash(h0,         tokens[16:32], None)
    block 2: hash(h1,         tokens[32:48], None)

Two kinds of value come out of this module:

- ``block_hashes`` (ints): the content hashes above, from Python's builtin ``hash`` of
  tuples of ints. Deterministic across processes (``PYTHONHASHSEED`` only randomizes
  str/bytes hashing; the salt string is folded through sha256 once), cheap, and fine as
  a name for a prefix (metrics, KV events, routing). NOT safe as the only dict key:
  int/tuple hashing is easy to invert, so a tenant could craft two prefixes with equal
  hashes and read another tenant's K/V (a wrong hit silently corrupts output).
- ``BlockKey`` = (parent node id, the block's token ids, extra): the prefix-cache dict
  key. Each cached prefix gets a node id from a counter that never repeats, so a key
  names exactly one token sequence from the root: the cache is a trie whose edges
  compare the real tokens. Dict probing may meet equal ``hash()`` values; tuple
  equality then compares the tokens, so a collision costs a probe, never a wrong hit.
"""

from __future__ import annotations

import hashlib

from pagedserve.scheduler.lora import lora_salt

# Parent id of a prompt's first block in the trie (real node ids start at 1).
ROOT_NODE_ID = 0


def _sha256_int(data: bytes) -> int:
    # 63 bits so it stays a small positive int on every platform.
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") >> 1


# The parent hash of block 0; a constant so hashes agree across processes.
ROOT_HASH: int = _sha256_int(b"pagedserve/prefix-cache/root")

BlockKey = tuple  # (parent_node_id: int, token_ids: tuple[int, ...], extra: int | None)


def hash_cache_salt(cache_salt: str | None, tenant: str | None = None, lora: str | None = None) -> int | None:
    """The salt of block 0 as an int (sha256, so it does not depend on ``PYTHONHASHSEED``):
    the request's own ``cache_salt`` and, with per-tenant isolation, its tenant. The two
    are length-prefixed, so no choice of salt string can reproduce another tenant's key.
    ``lora`` (scheduler/lora.lora_salt): the request's adapter, wrapped around the rest, so
    K/V computed under one adapter is never a hit for another or for the base model."""
    if lora is not None:
        inner = hash_cache_salt(cache_salt, tenant)
        name = lora.encode("utf-8")
        return _sha256_int(b"\x00lora\x00%d:%s%d" % (len(name), name, -1 if inner is None else inner))
    if cache_salt is None and tenant is None:
        return None
    if tenant is None:
        return _sha256_int(cache_salt.encode("utf-8"))
    t, c = tenant.encode("utf-8"), (cache_salt or "").encode("utf-8")
    return _sha256_int(b"\x00tenant\x00%d:%s%d:%s%d" % (len(t), t, len(c), c, cache_salt is None))


def request_salt(request) -> int | None:
    return hash_cache_salt(request.cache_salt, request.cache_tenant, lora_salt(request.lora_request))


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...], extra: int | None) -> int:
    return hash((parent_hash, token_ids, extra))


def extend_block_hashes(request, block_size: int, num_blocks: int | None = None) -> list[int]:
    """Append the content hashes of ``request``'s newly full blocks (up to ``num_blocks``
    blocks, default: every full block) to ``request.block_hashes``; return the list."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    limit = len(tokens) // block_size
    if num_blocks is not None and num_blocks < limit:
        limit = num_blocks
    i = len(hashes)
    if i >= limit:
        return hashes
    parent = hashes[-1] if hashes else ROOT_HASH
    while i < limit:
        extra = request_salt(request) if i == 0 else None
        parent = hash_block_tokens(parent, tuple(tokens[i * block_size:(i + 1) * block_size]), extra)
        hashes.append(parent)
        i += 1
    return hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
