"""The KV router's policy (cluster/front/router/kv_routing.py) on real scheduler state: the block
hashes it computes from a prompt are the ones the replica's prefix cache stores (salts and
tenant isolation included), so a view fed by the replica's KV events matches exactly what
the replica would reuse; the cost model (predicted TTFT) ranks an idle holder first and a
busy one after an idle cold replica, distrusts stale stats, spreads the few-long-sessions
skew of issue 56, and another tenant's identical prompt matches nothing."""

from __future__ import annotations

import json

import pytest

from _sched_helpers import make_scheduler, step
from pagedserve.cluster.front.router.kv_routing import (BY_LOAD, BY_PREFIX, KVRoutingPolicy, ReplicaLoad,
                                                         predicted_ttft, rank)
from pagedserve.scheduler import Request, SamplingParams
from pagedserve.scheduler.kv.kv_events import KVEventLog, KVView

BS = 4


def replica(isolate=True):
    """A scheduler whose prefix cache reports to a view, as a replica's does to a router."""
    sched = make_scheduler(num_blocks=32, block_size=BS, budget=256, max_model_len=128)
    sched.scheduler_config.isolate_tenant_prefix_cache = isolate
    sched.kv_cache_manager.block_pool.kv_events = KVEventLog()
    return sched


def serve(sched, rid, prompt, salt=None, tenant=None, lora=None) -> Request:
    req = Request(rid, list(prompt), SamplingParams(max_tokens=1), cache_salt=salt, tenant=tenant, lora_request=lora)
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


def test_the_router_names_an_adapters_blocks_as_the_replica_does_and_never_across_adapters():
    from pagedserve.scheduler.lora import LoRARequest

    sched = replica()
    sql, chat = LoRARequest.named("sql", "/a/sql"), LoRARequest.named("chat", "/a/chat")
    prompt = list(range(1, 23))
    req = serve(sched, "a", prompt, lora=sql)
    policy = KVRoutingPolicy(block_size=BS)
    view = view_of(sched)
    assert policy.block_hashes(prompt, None, None, sql) == req.block_hashes[:5]
    assert view.matched_blocks(policy.block_hashes(prompt, None, None, sql)) == 5
    for other in (chat, None):  # another adapter, or the base model: no hit
        assert view.matched_blocks(policy.block_hashes(prompt, None, None, other)) == 0


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
    loads = {"holder": ReplicaLoad(view.matched_blocks(policy.block_hashes(prompt, None, "globex")), 1),
             "idle": ReplicaLoad(0, 0)}
    assert rank(policy, len(prompt), loads) == (["idle", "holder"], BY_LOAD)


RATE = 2000.0  # prefill tokens/s: a measured-looking CPU figure
STEP = 0.03  # decode step seconds


def fresh(matched=0, in_flight=0, waiting=0, running_prefill=0, requests=None, decoding=0, cached=0,
          rate=RATE, step=STEP, age=0.1):
    """A replica whose stats arrived ``age`` seconds ago."""
    return ReplicaLoad(matched, in_flight, cached, age, waiting, running_prefill,
                       in_flight if requests is None else requests, decoding, 2048, rate, step)


def test_a_busy_holder_loses_to_an_idle_cold_replica_when_its_queue_costs_more_than_the_miss():
    policy = KVRoutingPolicy(block_size=16)
    # 512-token prompt, 30 blocks (480 tokens) cached on "a": the miss on "b" is 512 tokens,
    # 0.256 s at 2,000 tok/s.
    b = fresh()
    assert rank(policy, 512, {"a": fresh(30, 2, waiting=300, requests=2), "b": b}) == (["a", "b"], BY_PREFIX)
    # a queue of 600 prefill tokens there (0.3 s) costs more than the miss: the cold replica
    assert rank(policy, 512, {"a": fresh(30, 3, waiting=300, running_prefill=300, requests=3), "b": b}) \
        == (["b", "a"], BY_LOAD)
    # ...and so does a queue that is not in its stats yet: requests routed there since
    # (the front's in-flight count ahead of the requests its stats show), each a prompt's
    # worth where their own fresh tokens are not known
    assert rank(policy, 512, {"a": fresh(30, 2, requests=1), "b": b})[0] == ["a", "b"]
    assert rank(policy, 512, {"a": fresh(30, 3, requests=1), "b": b})[0] == ["b", "a"]
    # Decode load: 20 decoding requests at 0.3 s a step (the step its prefill rides), against none
    assert rank(policy, 512, {"a": fresh(30, 20, decoding=20, step=0.3), "b": b})[0] == ["b", "a"]
    assert rank(policy, 512, {"a": fresh(30, 20, decoding=20, step=0.1), "b": b})[0] == ["a", "b"]
    # A slower replica's queue weighs more: the same 300 tokens at 800 tok/s
    assert rank(policy, 512, {"a": fresh(30, 1, waiting=300, rate=800), "b": b})[0] == ["b", "a"]


def test_requests_not_in_the_stats_yet_weigh_their_own_fresh_tokens():
    """A holder that was just sent three turns of its sessions, each a cache hit of 64
    fresh tokens, is not three whole prompts busy: it keeps the fourth (the issue-56 skew,
    read from a trace, where unseen hits weighed 635 tokens each and sessions moved)."""
    policy = KVRoutingPolicy(block_size=16)
    b = fresh()
    holder = ReplicaLoad(36, 3, 0, 0.1, 0, 0, 0, 0, 2048, RATE, STEP, fresh_in_flight=(64, 64, 64))
    assert rank(policy, 640, {"a": holder, "b": b})[0] == ["a", "b"]
    # unknown fresh tokens: each weighs this prompt, as before
    unknown = ReplicaLoad(36, 3, 0, 0.1, 0, 0, 0, 0, 2048, RATE, STEP)
    assert rank(policy, 640, {"a": unknown, "b": b})[0] == ["b", "a"]
    # only the newest beyond the stats' count are unseen: one of three here, a miss of 600
    one_unseen = ReplicaLoad(36, 3, 0, 0.1, 0, 0, 2, 0, 2048, RATE, STEP, fresh_in_flight=(600, 64, 64))
    two_unseen = ReplicaLoad(36, 3, 0, 0.1, 0, 0, 1, 0, 2048, RATE, STEP, fresh_in_flight=(64, 64, 600))
    assert predicted_ttft(policy, 640, one_unseen, (RATE, STEP)) == pytest.approx((600 + 64) / RATE)
    assert predicted_ttft(policy, 640, two_unseen, (RATE, STEP)) == pytest.approx((64 + 64 + 64) / RATE)
    # stale stats: every request in flight weighs its fresh tokens
    stale = ReplicaLoad(36, 3, 0, 9.0, 0, 0, 0, 0, 2048, RATE, STEP, fresh_in_flight=(10, 20, 30))
    assert predicted_ttft(policy, 640, stale, (RATE, STEP)) == pytest.approx((60 + 64) / RATE + STEP)


def test_the_front_counts_its_own_requests_in_flight_with_their_fresh_tokens():
    from pagedserve.cluster.front.router.routing import _InFlight

    f = _InFlight()
    f.add("r1", "A", 100)
    f.add("r2", "A", 5)
    f.add("r3", "B", 7)
    assert f.fresh("A") == (5, 100) and f.fresh("B") == (7,) and f.fresh("C") == ()
    f.add("r1", "B", 30)  # routed again (a retry elsewhere): moves
    assert f.fresh("A") == (5,) and f.fresh("B") == (30, 7)
    f.remove("r2")
    f.remove("never")
    assert f.fresh("A") == () and f.replicas() >= {"B"}
    f.forget("B")
    assert f.fresh("B") == () and "B" not in f.replicas()
    f.add("r3", "A", 1)  # its old record went with B
    assert f.fresh("A") == (1,)


def test_an_idle_holder_wins_and_between_holders_the_cheaper_one():
    policy = KVRoutingPolicy(block_size=16)
    assert rank(policy, 512, {"a": fresh(30), "b": fresh()}) == (["a", "b"], BY_PREFIX)
    # a partial hit still counts for its tokens (a conversation whose tail was evicted)
    assert rank(policy, 512, {"a": fresh(8), "b": fresh()}) == (["a", "b"], BY_PREFIX)
    # two holders of the same blocks: cost decides, and with nobody holding less it was load
    assert rank(policy, 512, {"a": fresh(30, 2, waiting=900), "b": fresh(30)}) == (["b", "a"], BY_LOAD)
    # within tie_rel of each other: the best hit first
    loads = {"a": fresh(2, waiting=60), "b": fresh(0)}  # 540 tokens against 512: 5% apart
    assert rank(policy, 512, loads) == (["a", "b"], BY_PREFIX)
    assert rank(KVRoutingPolicy(tie_rel=0.0), 512, loads)[0] == ["b", "a"]


def test_stale_stats_fall_back_to_the_fleets_median_rates_and_the_in_flight_count():
    policy = KVRoutingPolicy(block_size=16, stale_s=2.0)
    # "a" last said it was idle and very fast, 5 s ago; it has 6 requests in flight since.
    stale = fresh(0, 6, requests=0, rate=1e9, age=5.0)
    busy_b = fresh(0, 1, waiting=1000, requests=1)  # 1,000 tokens queued: 0.5 s + its miss
    assert rank(policy, 512, {"a": stale, "b": busy_b})[0] == ["b", "a"]
    # Trusted, the same figures would send it to "a" (its rate makes anything free)
    assert rank(policy, 512, {"a": fresh(0, 0, rate=1e9), "b": busy_b})[0] == ["a", "b"]
    # Its rates are not trusted for the fleet's median either: fleet = "b" and "c"
    from pagedserve.cluster.front.router.kv_routing import fleet_rates

    loads = [stale, fresh(rate=1000, step=0.02), fresh(rate=3000, step=0.04)]
    assert fleet_rates(policy, loads) == (2000.0, 0.03, policy.default_lora_load_s)
    # No stats at all (a replica never heard from) and nobody measured: the defaults
    assert fleet_rates(policy, [ReplicaLoad(0, 3)]) == (policy.default_prefill_tok_s, policy.default_decode_step_s,
                                                        policy.default_lora_load_s)
    # Never heard from: in-flight counts decide, as the stale fallback
    assert rank(policy, 512, {"a": ReplicaLoad(0, 3), "b": ReplicaLoad(0, 1)}) == (["b", "a"], BY_LOAD)


def test_a_replica_without_the_prompts_adapter_pays_its_read_unless_one_is_on_its_way():
    """Issue 56 item 4: a LoRA prompt. "a" has the adapter on its workers' host, "b" does not
    (and reads one in 0.3 s): "a" wins though both are idle and equally fast; "a" busier by
    more than the read loses to "b"; an adapter on its way to "b" (a request with it in
    flight there) costs nothing; a base-model prompt pays no read anywhere."""
    from pagedserve.cluster.front.router.kv_routing import replica_load
    from pagedserve.cluster.wire.kv_events import ReplicaStats

    policy = KVRoutingPolicy(block_size=16)
    sql = 7

    def load(adapters, waiting=0, on_way=False, adapter=sql, lora_load_s=0.3):
        stats = ReplicaStats(waiting_prefill_tokens=waiting, num_waiting_reqs=int(waiting > 0), prefill_tok_s=RATE,
                             decode_step_s=STEP, lora_load_s=lora_load_s, lora_adapters=adapters)
        return replica_load(0, int(waiting > 0), 0, stats, 0.1, (), adapter, on_way)

    assert rank(policy, 256, {"a": load((sql,)), "b": load(())})[0] == ["a", "b"]
    assert predicted_ttft(policy, 256, load(()), (RATE, STEP, 1.0)) == pytest.approx(256 / RATE + 0.3)
    # "a" holds 0.5 s of queued prefill, more than "b"'s read
    assert rank(policy, 256, {"a": load((sql,), waiting=int(RATE) // 2), "b": load(())})[0] == ["b", "a"]
    # 0.2 s of queue is cheaper than a 0.3 s read
    assert rank(policy, 256, {"a": load((sql,), waiting=int(RATE) // 5), "b": load(())})[0] == ["a", "b"]
    assert not load(()).has_adapter and load((), on_way=True).has_adapter
    assert rank(policy, 256, {"a": load((sql,), waiting=int(RATE) // 5), "b": load((), on_way=True)})[0] == ["b", "a"]
    # A replica that has read none yet: the fleet's median read time, else the default
    unmeasured = load((), lora_load_s=0.0)
    assert predicted_ttft(policy, 256, unmeasured, (RATE, STEP, 0.25)) == pytest.approx(256 / RATE + 0.25)
    # The base model: nothing to read
    assert load((), adapter=None).has_adapter


def test_the_front_counts_adapters_in_flight_per_replica():
    """routing._InFlight: an adapter is on its way to a replica while a request with it is
    in flight there, and no longer once the last one completes or the replica is gone."""
    from pagedserve.cluster.front.router.routing import _InFlight

    flight = _InFlight()
    flight.add("r1", "a", 100, adapter=7)
    flight.add("r2", "a", 50, adapter=7)
    flight.add("r3", "b", 10)
    assert flight.has_adapter("a", 7) and not flight.has_adapter("b", 7) and not flight.has_adapter("a", 8)
    flight.remove("r1")
    assert flight.has_adapter("a", 7)
    flight.remove("r2")
    assert not flight.has_adapter("a", 7) and flight.fresh("b") == (10,)
    flight.add("r4", "a", 1, adapter=7)
    flight.add("r4", "b", 1, adapter=7)  # routed again elsewhere: moves
    assert not flight.has_adapter("a", 7) and flight.has_adapter("b", 7)
    flight.forget("b")
    assert not flight.has_adapter("b", 7) and flight.fresh("b") == ()


def test_no_shared_prefix_spreads_requests_evenly():
    """Random prompts: each request goes to the replica with the least work (its decoding
    requests make its steps longer; predictions within tie_rel go to fewer in flight), so two
    replicas take turns as requests arrive and end."""
    policy = KVRoutingPolicy(block_size=16)
    flights = {"a": 0, "b": 0}
    counts = {"a": 0, "b": 0}
    for i in range(100):
        loads = {k: fresh(0, n, decoding=n, step=0.02 + 0.005 * n) for k, n in flights.items()}
        best = rank(policy, 200, loads)[0][0]
        assert flights[best] == min(flights.values()), (i, flights)
        counts[best] += 1
        flights[best] += 1
        if i % 3 == 2:  # requests end now and then
            for k in flights:
                flights[k] = max(0, flights[k] - 1)
    assert max(counts.values()) <= 55


def test_among_equals_a_new_prefix_goes_to_the_emptier_cache():
    policy = KVRoutingPolicy(block_size=16)
    loads = {"full": fresh(cached=200), "empty": fresh(cached=3, rate=RATE * 1.05)}  # rates within tie_rel
    assert rank(policy, 300, loads)[0] == ["empty", "full"]


def test_the_few_long_sessions_skew_is_spread_by_the_model():
    """Issue 56's losing shape: 6 long sessions on 2 replicas, all begun on one. Pinning
    alone (the most blocks held first) keeps every session there; the cost model moves
    sessions to the idle replica once the holder's queue costs more than the miss, and
    beats Serve's power of two choices on mean TTFT. The replicas measure their own rates
    from the simulated steps (StepRates), as real ones do."""
    from pagedserve.loadtest.serving.bench_router_decision import StepModel, simulate
    from pagedserve.loadtest.workloads import ROUTER_SIM_SHAPES

    model = StepModel(prefill_tok_s=1500.0, decode_step_s=0.02, decode_per_req_s=0.006)
    shape = ROUTER_SIM_SHAPES["few_sessions_pinned"]
    runs = {r: [simulate(r, 2, shape, model, seed=s) for s in range(3)] for r in ("kv", "pow2", "affinity")}
    mean = {r: sum(x["ttft_mean_s"] for x in v) / len(v) for r, v in runs.items()}
    share = {r: max(x["max_replica_share"] for x in v) for r, v in runs.items()}
    assert share["affinity"] == 1.0  # the skew: pinned, every request on one replica
    assert share["kv"] <= 0.7, share
    assert mean["kv"] < 0.85 * mean["affinity"], mean
    assert mean["kv"] <= mean["pow2"], mean


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


def test_a_replica_measures_its_prefill_rate_net_of_decodes_and_reports_its_running_prefill():
    """What a replica publishes besides its waiting prefill (cluster/replica/step_rates.py,
    scheduler/kv/kv_events.running_prefill), on a real scheduler: budget 16 a step."""
    from pagedserve.cluster.replica.step_rates import MIN_DECODE_STEPS, StepRates, step_mix
    from pagedserve.scheduler.kv.kv_events import running_prefill

    sched = make_scheduler(num_blocks=64, block_size=BS, budget=16, max_model_len=128)
    sched.add_request(Request("d", list(range(1, 7)), SamplingParams(max_tokens=50)))
    plan, _ = step(sched)
    assert step_mix(plan, sched) == (6, 0) and running_prefill(sched) == (0, 1)
    sched.add_request(Request("p", list(range(100, 130)), SamplingParams(max_tokens=50)))
    plan, _ = step(sched)  # d decodes; p prefills 15 of its 30
    assert step_mix(plan, sched) == (15, 1) and running_prefill(sched) == (15, 1)
    plan, _ = step(sched)
    assert step_mix(plan, sched) == (15, 1) and running_prefill(sched) == (0, 2)
    plan, _ = step(sched)
    assert step_mix(plan, sched) == (0, 2)

    rates = StepRates()
    assert (rates.prefill_tok_s, rates.decode_step_s) == (None, None)
    rates.add(0.01, 20, 0)  # two short prompts: too little to go by (the fleet's figures stand in)
    rates.add(0.01, 20, 0)
    assert rates.prefill_tok_s is None
    rates = StepRates()
    rates.add(0.5, 1000, 0)  # a prefill alone: all of its time
    rates.add(0.5, 1000, 0)
    assert rates.prefill_tok_s == 2000.0
    for _ in range(MIN_DECODE_STEPS):  # decodes alone: the decode step
        assert rates.decode_step_s is None
        rates.add(0.02, 0, 4)
    assert rates.decode_step_s == pytest.approx(0.02)
    rates.add(0.27, 500, 4)  # a mixed step: 0.25 s of prefill, net of the 0.02 s of decodes
    tokens, seconds = 0.8 * 1000 + 0.2 * 500, 0.8 * 0.5 + 0.2 * 0.25  # a ratio of averages
    assert rates.prefill_tok_s == pytest.approx(tokens / seconds)
    rates.add(0.01, 100, 4)  # shorter than its decodes were: a quarter of it counts as prefill
    assert rates.prefill_tok_s == pytest.approx((0.8 * tokens + 0.2 * 100) / (0.8 * seconds + 0.2 * 0.0025))
    rates.add(0.04, 0, 4)
    assert rates.decode_step_s == pytest.approx(0.8 * 0.02 + 0.2 * 0.04)


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


def test_the_trace_keeps_each_decision_with_its_predictions(tmp_path, monkeypatch):
    from pagedserve.cluster.front.router import kv_routing

    policy = KVRoutingPolicy(block_size=16)
    loads = {"a": fresh(30, 2, waiting=300, requests=2), "b": fresh()}
    order, by = rank(policy, 512, loads)
    assert not kv_routing.tracing()
    monkeypatch.setenv(kv_routing.TRACE_ENV, str(tmp_path / "trace.jsonl"))
    assert kv_routing.tracing()
    kv_routing.trace({"request": "r1", **kv_routing.decision_record(policy, 512, loads, order, by)})
    kv_routing.trace({"routed": "r1", "to": "a"})
    lines = [json.loads(x) for x in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [x.get("request") or x.get("routed") for x in lines] == ["r1", "r1"]
    d = lines[0]
    assert d["order"] == ["a", "b"] and d["by"] == BY_PREFIX and d["prompt_len"] == 512
    assert d["replicas"]["b"]["ttft_s"] == pytest.approx(512 / RATE, abs=1e-4)
    assert d["replicas"]["a"]["matched_blocks"] == 30 and d["replicas"]["a"]["ttft_s"] < d["replicas"]["b"]["ttft_s"]
