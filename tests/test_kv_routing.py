"""The KV router's policy (cluster/front/router/kv_routing.py) on real scheduler state: the block
hashes it computes from a prompt are the ones the replica's prefix cache stores (salts and
tenant isolation included), so a view fed by the replica's KV events matches exactly what
the replica would reuse; the cost ranks the holder first, load overrides it past the
balance guard, and another tenant's identical prompt matches nothing."""

from __future__ import annotations

import pytest

from _sched_helpers import make_scheduler, step
from pagedserve.cluster.front.router.kv_routing import BY_LOAD, BY_PREFIX, KVRoutingPolicy, ReplicaLoad, rank
from pagedserve.scheduler import Request, SamplingParams
from pagedserve.scheduler.kv.kv_events import KVEventLog, KVView

BS = 4


def replica(isolate=True):
    """A scheduler whose prefix cache reports to a view, as a replica's does to a router."""
    sched = make_scheduler(num_blocks=32, block_size=BS, budget=256, max_model_len=128)
    sched.scheduler_config.isolate_tenant_prefix_cache = isolate
    sched.kv_cache_manager.block_pool.kv_events = KVEventLog()
    return sched


def serve(sched, rid, prompt, salt=None, tenant=None) -> Request:
    req = Request(rid, list(prompt), SamplingParams(max_tokens=1), cache_salt=salt, tenant=tenant)
    sched.add_request(req)
    while rid in sched.requests and not sched.requests[rid].is_finished:
        step(sched)
    return req


def view_of(sched) -> KVView:
    view = KVView()
    view.reset(sched.kv_cache_manager.block_pool.kv_events.snapshot(sched.kv_cache_manager.block_pool))
    return view


@pytest.mark.parametrize("salt,tenant,isolate", [(None, None, True), ("s1", None, True), (None, "acme", True),
                                                 ("s1", "acme", True), (None, "acme", False),
                                                 (None, "default", True)])
def test_the_router_names_blocks_as_the_replica_caches_them(salt, tenant, isolate):
    sched = replica(isolate)
    prompt = list(range(1, 23))  # 5 full blocks and 2 tokens
    req = serve(sched, "a", prompt, salt, tenant)
    policy = KVRoutingPolicy(block_size=BS, isolate_tenants=isolate)
    hashes = policy.block_hashes(prompt, salt, tenant)
    assert hashes == req.block_hashes[:5]
    assert view_of(sched).matched_blocks(hashes) == 5


def test_another_tenant_never_matches_a_tenants_prefix():
    sched = replica(isolate=True)
    prompt = list(range(1, 40))
    serve(sched, "a", prompt, tenant="acme")
    view, policy = view_of(sched), KVRoutingPolicy(block_size=BS, isolate_tenants=True)
    assert view.matched_blocks(policy.block_hashes(prompt, None, "acme")) == 9
    for other in ("globex", "default", None):
        assert view.matched_blocks(policy.block_hashes(prompt, None, other)) == 0, other
    # A cache_salt cannot reproduce another tenant's blocks either.
    assert view.matched_blocks(policy.block_hashes(prompt, "acme", None)) == 0
    # Ranked: the tenant's replica is not preferred for another tenant's same prompt.
    loads = {"holder": ReplicaLoad(view.matched_blocks(policy.block_hashes(prompt, None, "globex")), 0, 1),
             "idle": ReplicaLoad(0, 0, 0)}
    assert rank(policy, len(prompt), loads) == (["idle", "holder"], BY_LOAD)


def test_the_holder_wins_until_load_outweighs_its_prefix():
    policy = KVRoutingPolicy(block_size=16, decode_tokens=64, balance_abs=4, balance_rel=1.5)
    # 512-token prompt, 30 blocks cached on "a": 480 tokens saved.
    a, b = ReplicaLoad(30, 0, 2), ReplicaLoad(0, 0, 0)
    assert rank(policy, 512, {"a": a, "b": b}) == (["a", "b"], BY_PREFIX)
    # A busy holder keeps its prefix (affinity first): its queue does not send the prefix
    # to be cached a second time elsewhere...
    assert rank(policy, 512, {"a": ReplicaLoad(30, 2000, 4), "b": b}) == (["a", "b"], BY_PREFIX)
    # ...and between two holders of the same blocks, cost decides.
    assert rank(policy, 512, {"a": ReplicaLoad(30, 2000, 2), "b": ReplicaLoad(30, 0, 2)})[0] == ["b", "a"]
    # Under the cache threshold (a quarter of the prompt cached, a conversation whose tail
    # was evicted): cost, where the cached quarter still counts...
    assert rank(policy, 512, {"a": ReplicaLoad(8, 0, 3), "b": ReplicaLoad(0, 0, 1)}) == (["a", "b"], BY_PREFIX)
    # ...against a queue there
    assert rank(policy, 512, {"a": ReplicaLoad(8, 900, 3), "b": ReplicaLoad(0, 0, 1)}) == (["b", "a"], BY_LOAD)
    # Past the balance guard (5 apart, and more than 1.5x), load alone decides.
    assert rank(policy, 512, {"a": ReplicaLoad(30, 0, 6), "b": ReplicaLoad(0, 0, 1)}) == (["b", "a"], BY_LOAD)
    # No replica holds anything: the least loaded, and it was load that decided.
    assert rank(policy, 512, {"a": ReplicaLoad(0, 0, 3), "b": ReplicaLoad(0, 10, 1)}) == (["b", "a"], BY_LOAD)


def test_no_shared_prefix_spreads_requests_evenly():
    """Random prompts: each request goes to the replica with the least work, so two replicas
    take turns as requests arrive and end."""
    policy = KVRoutingPolicy(block_size=16)
    flights = {"a": 0, "b": 0}
    counts = {"a": 0, "b": 0}
    for i in range(100):
        loads = {k: ReplicaLoad(0, 0, n) for k, n in flights.items()}
        best = rank(policy, 200, loads)[0][0]
        counts[best] += 1
        flights[best] += 1
        if i % 3 == 2:  # requests end now and then
            for k in flights:
                flights[k] = max(0, flights[k] - 1)
    assert max(counts.values()) <= 60


def test_among_equals_a_new_prefix_goes_to_the_emptier_cache():
    policy = KVRoutingPolicy(block_size=16)
    loads = {"full": ReplicaLoad(0, 0, 0, cached_blocks=200), "empty": ReplicaLoad(0, 0, 0, cached_blocks=3)}
    assert rank(policy, 300, loads)[0] == ["empty", "full"]


def test_a_replica_reports_its_waiting_prefill_net_of_its_cache():
    """The backlog a replica publishes counts only what its waiting prompts must still
    prefill: prompts whose prefix it holds weigh little, so they do not push the next
    request of that prefix to a replica without it."""
    from pagedserve.scheduler.kv.kv_events import waiting_prefill

    sched = replica()
    prefix = list(range(1, 33))  # 8 blocks of 4
    serve(sched, "a", prefix + [90, 91])
    for i in range(3):
        sched.add_request(Request(f"w{i}", prefix + [100 + i] * 6, SamplingParams(max_tokens=1)))
    sched.add_request(Request("cold", list(range(200, 220)), SamplingParams(max_tokens=1)))
    # each of the three: 38 tokens, 32 cached -> 6; the cold one: all 20
    assert waiting_prefill(sched) == 3 * 6 + 20


def test_a_new_prefix_goes_to_the_replica_that_is_home_to_fewer():
    policy = KVRoutingPolicy(block_size=16)
    loads = {"crowded": ReplicaLoad(0, 0, 2, owned=5), "roomy": ReplicaLoad(0, 300, 2, owned=2)}
    assert rank(policy, 544, loads) == (["roomy", "crowded"], BY_LOAD)
    # load first: a prompt seen once needs nothing else
    loads["roomy"] = ReplicaLoad(0, 300, 3, owned=2)
    assert rank(policy, 544, loads) == (["crowded", "roomy"], BY_LOAD)
    # held somewhere: the holder, whatever the homes
    loads["crowded"] = ReplicaLoad(32, 0, 1, owned=5)
    assert rank(policy, 544, loads) == (["crowded", "roomy"], BY_PREFIX)


def test_sent_blocks_count_while_in_flight_then_for_a_grace_period():
    """A prompt sent to a replica counts as there before its events say so: while its
    request is in flight there (it may wait in a queue for seconds before its prefill
    stores the blocks), then for SENT_TTL_S; a request routed elsewhere than first scored
    moves its marks; a replica that goes takes its marks with it."""
    from pagedserve.cluster.front.router.routing import SENT_TTL_S, _SentBlocks

    sent = _SentBlocks()
    sent.send("r1", "a", [11, 12])
    sent.send("r2", "a", [11, 13])
    now = 100.0
    assert sent.view("a", now)(11) and sent.view("a", now)(12) and not sent.view("b", now)(11)
    sent.done("r1", now)
    later = now + SENT_TTL_S / 2
    assert sent.view("a", later)(12)  # finished: still counted until its event can have come
    assert not sent.view("a", now + 2 * SENT_TTL_S)(12)
    assert sent.view("a", now + 2 * SENT_TTL_S)(11)  # r2 is still in flight with it
    sent.send("r2", "b", [11, 13])  # routed elsewhere than scored
    assert sent.view("b", now)(13) and not sent.view("a", now + 2 * SENT_TTL_S)(13)
    sent.forget("b")
    assert not sent.view("b", now)(13)
    sent.done("never-sent", now)  # a completion the router never marked: ignored
