"""The KV router's policy: which engine replica should take a prompt. Serve's side of it
(the RequestRouter, the replicas' event subscriptions) is in routing.py.

    the prompt's token ids ─▶ chained block hashes (as the replica's prefix cache names them)
    each replica's view (cluster/wire/kv_events.py) ─▶ leading blocks it holds
    in-flight counts apart past the balance guard ─▶ least loaded first            (BY_LOAD)
    at least cache_threshold of the prompt cached somewhere ─▶ most blocks first  (BY_PREFIX)
    less of it cached somewhere ─▶ by cost
    none of it cached anywhere (a new prefix) ─▶ fewest in flight, then home to the fewest
                                                 prefixes (BY_LOAD)
    cost(replica) = miss_weight x prompt tokens it would still prefill
                  + prefill tokens already waiting there    (its last KV event message)
                  + decode_tokens x requests in flight there (Serve's queue-length cache)
    ties: the emptier cache, then chance

Affinity first, as SGLang's cache-aware router does (its cache threshold and balance
guard): a prompt mostly cached on one replica goes there unless the replicas' in-flight
counts grow apart by more than ``balance_abs`` requests and by a factor over
``balance_rel``. Weighing the holder's queue against the other replica's prefill instead
sent a prefix's requests to the other replica whenever the holder was busy: the prefix was
then cached twice, evicting others, and under load most prefixes lived on both replicas.

A new prefix goes by load, then to the replica that became home to the fewest prefixes
lately (``owned``: distinct first blocks routed there in the last minute), as Ray Serve
LLM's router sends an unmatched prompt to its smallest tenant: a burst of new prefixes
spreads over both caches instead of following whichever replica was idle. Serve tries the
replicas in the order given when the first is full.

Block 0's salt is the replica's: the request's cache_salt and, when tenants' caches are
isolated, its tenant (scheduler/kv_cache_utils.hash_cache_salt), so a prompt never matches
another tenant's blocks here either.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from pagedserve.scheduler.fair_queue import DEFAULT_TENANT
from pagedserve.scheduler.kv.kv_cache_utils import ROOT_HASH, hash_block_tokens, hash_cache_salt

BY_PREFIX, BY_LOAD = "prefix", "load"


@dataclass(frozen=True)
class KVRoutingPolicy:
    block_size: int = 16
    isolate_tenants: bool = True  # the replicas' isolate_tenant_prefix_cache
    miss_weight: float = 2.0  # a prompt token to prefill, against one waiting there
    decode_tokens: int = 16  # what one request in flight weighs, in prompt tokens to prefill
    balance_abs: int = 8  # in-flight requests apart before load alone decides...
    balance_rel: float = 2.0  # ...and this many times the least loaded replica's count
    cache_threshold: float = 0.5  # of the prompt cached somewhere: affinity decides (SGLang's default)

    def block_hashes(self, token_ids: list[int], cache_salt: str | None, tenant: str | None) -> list[int]:
        """The content hashes of the prompt's full blocks, as the replica computes them
        (scheduler/kv_cache_utils.extend_block_hashes)."""
        cache_tenant = tenant if self.isolate_tenants and tenant not in (None, DEFAULT_TENANT) else None
        extra = hash_cache_salt(cache_salt, cache_tenant)
        out, parent, bs = [], ROOT_HASH, self.block_size
        for i in range(len(token_ids) // bs):
            parent = hash_block_tokens(parent, tuple(token_ids[i * bs:(i + 1) * bs]), extra if i == 0 else None)
            out.append(parent)
        return out


@dataclass(frozen=True)
class ReplicaLoad:
    matched_blocks: int  # the prompt's leading blocks this replica holds
    waiting_tokens: int  # prefill tokens waiting there
    in_flight: int  # requests routed there and not yet ended
    cached_blocks: int = 0  # blocks its prefix cache holds
    owned: int = 0  # prefixes that made it their home lately (distinct first blocks routed there)


def rank(policy: KVRoutingPolicy, prompt_len: int, loads: dict,
         tiebreak: Callable[[], float] = random.random) -> tuple[list, str]:
    """(replica keys, best first; BY_PREFIX or BY_LOAD: what decided the first).
    ``loads``: key -> ReplicaLoad, at least one."""
    flights = [x.in_flight for x in loads.values()]
    low, high = min(flights), max(flights)
    if high - low > policy.balance_abs and high > policy.balance_rel * low:
        order = sorted(loads, key=lambda k: (loads[k].in_flight, loads[k].waiting_tokens, loads[k].cached_blocks,
                                             tiebreak()))
        return order, BY_LOAD

    def cost(k):
        x = loads[k]
        fresh = max(0, prompt_len - x.matched_blocks * policy.block_size)
        return (policy.miss_weight * fresh + x.waiting_tokens + policy.decode_tokens * x.in_flight,
                x.cached_blocks, tiebreak())

    best = max(x.matched_blocks for x in loads.values())
    if best * policy.block_size >= policy.cache_threshold * prompt_len:
        # Most of the prompt is cached somewhere: the replica holding the most of it, by
        # cost among equals. Load decides only past the balance guard above.
        order = sorted(loads, key=lambda k: (-loads[k].matched_blocks, cost(k)))
        by = BY_PREFIX if any(loads[k].matched_blocks < best for k in order[1:]) else BY_LOAD
        return order, by
    if best:
        # Some of it cached (a conversation whose tail was evicted, a short shared head):
        # cost, where those blocks still count for their prefill.
        order = sorted(loads, key=cost)
        by = BY_PREFIX if loads[order[0]].matched_blocks == best and any(
            loads[k].matched_blocks < best for k in order[1:]) else BY_LOAD
        return order, by
    # A new prefix: load first, then the replica home to the fewest prefixes lately, then cost.
    return sorted(loads, key=lambda k: (loads[k].in_flight, loads[k].owned, cost(k))), BY_LOAD
