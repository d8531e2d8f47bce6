"""The KV router's policy: which engine replica should take a prompt. Serve's side of it
(the RequestRouter, the replicas' event subscriptions) is in routing.py.

    the prompt's token ids ─▶ chained block hashes (as the replica's prefix cache names them)
    each replica's view (cluster/wire/kv_events.py) ─▶ leading blocks it holds
    cost(replica) = miss_weight x prompt tokens it would still prefill
                  + prefill tokens already waiting there     (its last KV event message)
                  + decode_tokens x requests in flight there  (Serve's queue-length cache)

A token to prefill weighs more than a token waiting (``miss_weight``): a miss costs its
prefill now and, later, the blocks it evicts there for a prefix that another replica
holds already; waiting tokens only delay. Without it, the second request of a new prefix,
sent while the first still waited on its replica, went to the other replica (as many
tokens to prefill there as waited here) and the prefix was cached twice.

A prompt that no replica holds any block of (a new prefix) goes to the replica with the
fewest requests in flight, then the fewest prefixes that made it their home lately
(``owned``: distinct first blocks routed there in the last minute), then by cost: load
first (a prompt seen once needs nothing else), and among equals the prefixes spread over
the replicas' caches, as
Ray Serve LLM's router sends an unmatched prompt to its smallest tenant. By cost alone a
burst of new prefixes followed whichever replica was idle at that moment, and one replica
became the home of more prefixes than its cache holds.

The cheapest replica comes first, the rest after it in cost order (Serve tries them in
turn when one is full); among equals, the one whose cache holds fewer blocks (a new
prefix goes where it evicts least, as Ray Serve LLM's router sends an unmatched prompt to
its smallest tenant), then chance (idle replicas with empty caches take turns). The prefix term keeps a prefix where its blocks are, the waiting
term keeps a burst of new prefixes from piling onto one replica, and the in-flight term
stands for the decode work each running request adds to every step. When the replicas' in-flight counts
grow apart by more than ``balance_abs`` requests and by a factor over ``balance_rel`` (SGLang's
cache-aware router's guard), cost is ignored and the least loaded replica comes first: a
hot prefix must not pin its traffic to one replica while another idles.

Block 0's salt is the replica's: the request's cache_salt and, when tenants' caches are
isolated, its tenant (scheduler/kv_cache_utils.hash_cache_salt), so a prompt never matches
another tenant's blocks here either.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from pagedserve.scheduler.fair_queue import DEFAULT_TENANT
from pagedserve.scheduler.kv_cache_utils import ROOT_HASH, hash_block_tokens, hash_cache_salt

BY_PREFIX, BY_LOAD = "prefix", "load"


@dataclass(frozen=True)
class KVRoutingPolicy:
    block_size: int = 16
    isolate_tenants: bool = True  # the replicas' isolate_tenant_prefix_cache
    miss_weight: float = 2.0  # a prompt token to prefill, against one waiting there
    decode_tokens: int = 16  # what one request in flight weighs, in prompt tokens to prefill
    balance_abs: int = 8  # in-flight requests apart before load alone decides...
    balance_rel: float = 2.0  # ...and this many times the least loaded replica's count

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

    if all(x.matched_blocks == 0 for x in loads.values()):  # a new prefix: the emptiest home
        return sorted(loads, key=lambda k: (loads[k].in_flight, loads[k].owned, cost(k))), BY_LOAD
    order = sorted(loads, key=cost)
    best = loads[order[0]].matched_blocks
    # Decided by the prefix when the winner holds more of it than some other replica.
    by = BY_PREFIX if any(loads[k].matched_blocks < best for k in order[1:]) else BY_LOAD
    return order, by
