"""The KV router's policy: which engine replica should take a prompt. Serve's side of it
(the RequestRouter, the replicas' event subscriptions) is in routing.py.

    the prompt's token ids ─▶ chained block hashes (as the replica's prefix cache names them)
    each replica's view (cluster/wire/kv_events.py) ─▶ leading blocks it holds (matched)
    each replica's stats (the same wire)            ─▶ predicted TTFT there  ─▶ the minimum

A cost model per replica, in seconds (Dynamo's KV router weighs the same two loads):

    queued   = waiting prefill + running prefill            (its last stats message)
             + the unseen requests' fresh tokens unseen: the newest of this front's requests
                                                 in flight there, as many as its count
                                                 exceeds the requests its stats show
    fresh    = miss_weight x the prompt's tokens it does not hold
    ttft     = (queued + fresh) / its prefill rate                 (tokens/s, measured)
             + decode_step_s x steps the prefill spans, if it has decoding requests
               steps = ceil((queued + fresh) / (its token budget - its decoding requests))
             + its adapter read time, if the prompt names a LoRA adapter that is neither on
               its workers' host nor on its way there (a request with it in flight there)

The decode term is the inter-token latency the prefill competes with: every step that
carries a chunk of it also carries one token of each decoding request, and the prefill
rate is measured net of that (cluster/replica/step_rates.py). Stats older than
``stale_s`` (or none yet) are not trusted: that replica is costed with the fleet's
median rates and the fresh tokens of every request in flight there. A request's fresh
tokens are the part of its prompt its replica did not hold when it was routed (this
prompt's whole length where they are not known): a queue of cache hits is short.

    ties (within tie_rel of the minimum): the best hit, then fewer in flight, then the
                                          emptier cache, then chance
    decision  BY_PREFIX: the first choice holds the most of the prompt and another less
              BY_LOAD:   anything else (no hit anywhere, or load outweighed the hit)

The tie band is there because two idle replicas' predictions differ by little more than
the noise in their measured rates: without it every new prefix would go to whichever was
measured fastest; with it they spread by requests in flight and by cache fill.

The balance guard and the cache threshold of the first KV router (SGLang's rules) are
gone: a holder whose queue costs more than the miss elsewhere loses by its own cost, and
an idle holder wins by it. Serve tries the replicas in the order given when the first is
full.

Block 0's salt is the replica's: the request's cache_salt, its LoRA adapter and, when
tenants' caches are isolated, its tenant (scheduler/kv_cache_utils.hash_cache_salt), so a
prompt never matches another tenant's or another adapter's blocks here either.

A replica publishes the adapters on its workers' host and its measured read time (the
worker times each read from disk, worker/lora/host_cache.py); one that has not read any
yet is costed at the fleet's median, or ``default_lora_load_s``. Not costed: a replica
whose ``max_loras`` slots are all taken by other running adapters (the request waits for
one there; the waiting and running tokens only partly show it).
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

from pagedserve.scheduler.fair_queue import DEFAULT_TENANT
from pagedserve.scheduler.kv.kv_cache_utils import ROOT_HASH, hash_block_tokens, hash_cache_salt
from pagedserve.scheduler.lora import LoRARequest, lora_salt

BY_PREFIX, BY_LOAD = "prefix", "load"
# A file to append every decision to, one JSON line each (the loads, the predicted TTFTs,
# the order): what to read when a workload routes worse than expected. Off when unset.
TRACE_ENV = "PAGEDSERVE_ROUTER_TRACE"


@dataclass(frozen=True)
class KVRoutingPolicy:
    block_size: int = 16
    isolate_tenants: bool = True  # the replicas' isolate_tenant_prefix_cache
    miss_weight: float = 1.0  # a prompt token to prefill, against one queued there (>1: keep prefixes home)
    stale_s: float = 2.0  # stats older than this are not trusted (replicas send them at least every second)
    tie_rel: float = 0.1  # predicted TTFTs within this fraction of the minimum are ties
    # Until some replica has measured its rates (a fresh fleet): only their ratio matters.
    default_prefill_tok_s: float = 2000.0
    default_decode_step_s: float = 0.02
    default_lora_load_s: float = 0.1  # an adapter's read, until some replica has measured one

    def block_hashes(self, token_ids: list[int], cache_salt: str | None, tenant: str | None,
                     lora: LoRARequest | None = None) -> list[int]:
        """The content hashes of the prompt's full blocks, as the replica computes them
        (scheduler/kv_cache_utils.extend_block_hashes): salted by its tenant and its LoRA
        adapter as there, so a prompt under one adapter never matches another's blocks."""
        cache_tenant = tenant if self.isolate_tenants and tenant not in (None, DEFAULT_TENANT) else None
        extra = hash_cache_salt(cache_salt, cache_tenant, lora_salt(lora))
        out, parent, bs = [], ROOT_HASH, self.block_size
        for i in range(len(token_ids) // bs):
            parent = hash_block_tokens(parent, tuple(token_ids[i * bs:(i + 1) * bs]), extra if i == 0 else None)
            out.append(parent)
        return out


@dataclass(slots=True)
class ReplicaLoad:
    """One replica as the router sees it for one prompt. The stats fields are its last
    stats message's (cluster/wire/kv_events.ReplicaStats); rates of 0 are not measured yet."""

    matched_blocks: int  # the prompt's leading blocks this replica holds (or is being sent)
    in_flight: int  # this front's requests routed there and not yet ended, and those on their way
    cached_blocks: int = 0  # blocks its prefix cache holds
    stats_age_s: float | None = None  # since its last stats message; None: never heard
    waiting_tokens: int = 0  # prefill tokens its waiting queue still needs
    running_prefill_tokens: int = 0  # prefill tokens its running requests still need
    num_requests: int = 0  # waiting + running there
    num_decoding: int = 0  # running requests past their prefill
    num_batched_tokens: int = 0  # its per-step token budget (0: unknown)
    prefill_tok_s: float = 0.0
    decode_step_s: float = 0.0
    # the fresh (uncached) prompt tokens of requests in flight there, newest first (as many
    # as are known, at most in_flight)
    fresh_in_flight: tuple[int, ...] = ()
    has_adapter: bool = True  # the prompt's LoRA adapter is there or on its way (or it names none)
    lora_load_s: float = 0.0  # its measured adapter read (0.0: none read yet)


def matched_blocks(block_hashes: list[int], held, sent: Callable[[int], bool] | None = None) -> int:
    """How many of the prompt's leading blocks a replica holds (``held``: a set) or is
    being sent; a lookup stops at the first miss, as the replica's own does."""
    n = 0
    for h in block_hashes:
        if h not in held and (sent is None or not sent(h)):
            break
        n += 1
    return n


def replica_load(matched: int, in_flight: int, cached_blocks: int, stats, stats_age_s: float | None,
                 fresh_in_flight: tuple[int, ...] = (), adapter: int | None = None,
                 adapter_on_way: bool = False) -> ReplicaLoad:
    """A ReplicaLoad from a replica's last stats message (``stats_age_s`` None: none yet).
    ``adapter``: the prompt's lora_int_id (None: the base model); ``adapter_on_way``: a
    request with it is in flight there."""
    if stats is None or stats_age_s is None:
        return ReplicaLoad(matched, in_flight, cached_blocks, fresh_in_flight=fresh_in_flight,
                           has_adapter=adapter is None or adapter_on_way)
    return ReplicaLoad(matched, in_flight, cached_blocks, stats_age_s, stats.waiting_prefill_tokens,
                       stats.running_prefill_tokens, stats.num_waiting_reqs + stats.num_running_reqs,
                       stats.num_decoding_reqs, stats.num_batched_tokens, stats.prefill_tok_s, stats.decode_step_s,
                       fresh_in_flight, adapter is None or adapter_on_way or adapter in stats.lora_adapters,
                       stats.lora_load_s)


def _newest_fresh(x: ReplicaLoad, n: int, prompt_len: int) -> int:
    """The fresh tokens of the ``n`` newest requests in flight there (this prompt's length
    for each one not known)."""
    known = x.fresh_in_flight[:n]
    return sum(known) + (n - len(known)) * prompt_len


def _trusted(policy: KVRoutingPolicy, x: ReplicaLoad) -> bool:
    return x.stats_age_s is not None and x.stats_age_s <= policy.stale_s


def fleet_rates(policy: KVRoutingPolicy, loads) -> tuple[float, float, float]:
    """(prefill tokens/s, decode step seconds, adapter read seconds): the median of the
    replicas that have measured them and whose stats are trusted, else the policy's
    defaults."""
    trusted = [x for x in loads if _trusted(policy, x)]
    prefill = [x.prefill_tok_s for x in trusted if x.prefill_tok_s > 0]
    decode = [x.decode_step_s for x in trusted if x.decode_step_s > 0]
    lora = [x.lora_load_s for x in trusted if x.lora_load_s > 0]
    return (statistics.median(prefill) if prefill else policy.default_prefill_tok_s,
            statistics.median(decode) if decode else policy.default_decode_step_s,
            statistics.median(lora) if lora else policy.default_lora_load_s)


def predicted_ttft(policy: KVRoutingPolicy, prompt_len: int, x: ReplicaLoad,
                   fleet: tuple[float, float, float]) -> float:
    """Seconds to this prompt's first token on the replica ``x`` describes (module doc)."""
    fresh = policy.miss_weight * max(0, prompt_len - x.matched_blocks * policy.block_size)
    if _trusted(policy, x):
        unseen = max(0, x.in_flight - x.num_requests)  # routed there, not in its stats yet
        queued = x.waiting_tokens + x.running_prefill_tokens + _newest_fresh(x, unseen, prompt_len)
        rate = x.prefill_tok_s or fleet[0]
        step_s = x.decode_step_s or fleet[1]
        decoding = x.num_decoding
    else:
        queued = _newest_fresh(x, x.in_flight, prompt_len)
        rate, step_s = fleet[:2]
        decoding = x.in_flight
    work = queued + fresh
    ttft = work / rate
    if decoding:
        per_step = x.num_batched_tokens - decoding if x.num_batched_tokens else 0
        steps = math.ceil(work / per_step) if per_step > 0 else 1
        ttft += step_s * max(1, steps)
    if not x.has_adapter:
        ttft += (x.lora_load_s if _trusted(policy, x) and x.lora_load_s > 0 else fleet[2])
    return ttft


def rank(policy: KVRoutingPolicy, prompt_len: int, loads: dict,
         tiebreak: Callable[[], float] = random.random) -> tuple[list, str]:
    """(replica keys, best first; BY_PREFIX or BY_LOAD: what decided the first).
    ``loads``: key -> ReplicaLoad, at least one."""
    fleet = fleet_rates(policy, loads.values())
    cost = {k: predicted_ttft(policy, prompt_len, x, fleet) for k, x in loads.items()}
    order = sorted(cost, key=cost.__getitem__)
    bound = cost[order[0]] * (1 + policy.tie_rel)
    num_tied = 1
    while num_tied < len(order) and cost[order[num_tied]] <= bound:
        num_tied += 1
    tied = sorted(order[:num_tied], key=lambda k: (-loads[k].matched_blocks, loads[k].in_flight,
                                                   loads[k].cached_blocks, tiebreak()))
    order[:num_tied] = tied
    best = max(x.matched_blocks for x in loads.values())
    first = loads[order[0]].matched_blocks
    by = BY_PREFIX if first == best > 0 and any(loads[k].matched_blocks < best for k in order[1:]) else BY_LOAD
    return order, by


def tracing() -> bool:
    return bool(os.environ.get(TRACE_ENV))


def trace(record: dict) -> None:
    """Append one JSON line to the trace file (``TRACE_ENV``), stamped with the time."""
    with open(os.environ[TRACE_ENV], "a") as f:
        f.write(json.dumps({"t": time.time(), **record}) + "\n")


def decision_record(policy: KVRoutingPolicy, prompt_len: int, loads: dict, order: list, by: str,
                    name: Callable = str) -> dict:
    """A decision as the trace keeps it: each replica's load and predicted TTFT, the order."""
    fleet = fleet_rates(policy, loads.values())
    return {"prompt_len": prompt_len, "by": by, "order": [name(k) for k in order],
            "replicas": {name(k): {**asdict(x), "ttft_s": round(predicted_ttft(policy, prompt_len, x, fleet), 4)}
                         for k, x in loads.items()}}
