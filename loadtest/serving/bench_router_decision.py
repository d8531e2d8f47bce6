"""The KV router on its own, without Serve or a model (issue 56): the cost of one routing decision at 2 to 1,000 replicas, and a simulation of 2, 4 and 8 replicas.

(a) decision  One decision as KVPrefixRouter.choose_replicas makes it: hash the prompt's
              blocks (KVRoutingPolicy.block_hashes), match them against each replica's
              KVView (``--blocks`` hashes each; ``--holders`` of them also hold the
              prompt's first half) and the blocks sent there (routing._SentBlocks, a few
              requests in flight on each), build each replica's ReplicaLoad from its stats
              (cluster/wire/kv_events.ReplicaStats), rank. Microseconds of process CPU time
              per decision, at 2, 8, 64 and 1,000 replicas' worth of hash tables. Not in
              it: Serve's own work, and the router's poll of each replica's socket
              (``poll_us``: one empty poll of a real subscriber, to multiply by the replicas).
(b) simulate  N replicas serve closed-loop chat sessions (workloads.ROUTER_SIM_SHAPES;
              ``--concurrency`` clients per replica take turns from the sessions whose last
              turn has ended). A replica is a scheduler model: a token budget per step,
              decodes first, then chunked prefill, FIFO admission up to max_num_seqs, an
              LRU prefix cache of ``--cache-blocks``. A step with P prompt tokens and D
              decoding requests takes

                  decode_step_s + (D - 1) x decode_per_req_s (if D > 0) + P / prefill_tok_s

              Each replica measures its rates from its own steps (cluster/replica/
              step_rates.StepRates) and publishes them with its load at each step end, as a
              real one does (an idle one's heartbeat keeps them fresh). Routers: kv
              (kv_routing.rank on those stats), pow2 (Serve's default: two at random, the
              one with fewer in flight), affinity (the most blocks held, then fewer in
              flight: pinning alone, what the first KV router did below its balance guard).
              Reported per router: predicted mean and p99 TTFT, the prefix hit rate, the
              busiest replica's share of the requests, output tok/s.

The step model's rates are flags (their defaults the default model's, measured as below on
a 2-core CPU), or with ``--measure`` the engine's own on this machine: the default model in
process, after a warm-up one prompt of 512 tokens and 32 decodes, then 8 of them; every
step timed and fed to StepRates (the prefill rate), the decode-only steps at batch 1 and at
batch 8 giving decode_step_s and decode_per_req_s.

    python -m pagedserve.loadtest.serving.bench_router_decision [--replicas 2 8 64 1000] [--blocks 16384]
        [--sim-replicas 2 4 8] [--shapes few_sessions many_sessions] [--measure]
        [--prefill-tok-s R --decode-step-s S --decode-per-req-s S] [--no-decision | --no-sim]

The last line printed is one JSON object: ``{"cpu", "decision": {"2": {"us", "poll_us"}, ...},
"rates": {...}, "simulation": {shape: {"2": {"kv": {...}, "pow2": {...}, ...}, ...}}}``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from pagedserve.cluster.front.router.kv_routing import KVRoutingPolicy, matched_blocks, rank, replica_load
from pagedserve.cluster.replica.step_rates import StepRates, step_mix
from pagedserve.cluster.wire.kv_events import ReplicaStats
from pagedserve.loadtest.workloads import ROUTER_SIM_SHAPES, SessionShape

SIM_ROUTERS = ("kv", "pow2", "affinity")
HEARTBEAT_S = 1.0  # an idle replica's stats message (engine_replica's heartbeat)


# ---------------------------------------------------------------- (a) one decision
def decision_cost(num_replicas: int, blocks: int, holders: int = 2, prompt_len: int = 1024,
                  min_seconds: float = 0.5, seed: int = 0) -> dict:
    """CPU microseconds per decision (the median of 5 rounds), and one empty poll's."""
    from pagedserve.cluster.front.router.routing import _SentBlocks
    from pagedserve.scheduler.kv.kv_events import KVView

    rng = random.Random(seed)
    policy = KVRoutingPolicy()
    ids = [rng.randrange(5, 32000) for _ in range(prompt_len)]
    prefix = policy.block_hashes(ids, None, None)[: prompt_len // policy.block_size // 2]
    views, stats, sent, in_flight = [], [], _SentBlocks(), []
    for i in range(num_replicas):
        view = KVView()
        view.hashes = {rng.getrandbits(63) for _ in range(blocks)}
        if i < holders:
            view.hashes.update(prefix)
        views.append(view)
        for j in range(4):  # requests in flight there, each with its blocks marked as sent
            sent.send(f"{i}-{j}", str(i), [rng.getrandbits(63) for _ in range(32)])
        stats.append(ReplicaStats(rng.randrange(0, 4000), rng.randrange(0, 2000), rng.randrange(0, 8),
                                  rng.randrange(1, 16), rng.randrange(0, 16), 2048,
                                  rng.uniform(2000, 8000), rng.uniform(0.01, 0.05)))
        in_flight.append(rng.randrange(0, 24))

    def decide() -> None:
        now = time.monotonic()
        hashes = policy.block_hashes(ids, None, None)
        loads = {}
        for i, view in enumerate(views):
            matched = matched_blocks(hashes, view.hashes, sent.view(str(i), now))
            loads[i] = replica_load(matched, in_flight[i], len(view.hashes), stats[i], 0.1)
        rank(policy, prompt_len, loads)

    decide()
    rounds = []
    for _ in range(5):
        n, t0 = 0, time.process_time()
        while True:
            decide()
            n += 1
            dt = time.process_time() - t0
            if dt >= min_seconds / 5:
                break
        rounds.append(dt / n * 1e6)
    return {"us": round(statistics.median(rounds), 1), "poll_us": round(_empty_poll_us(), 2),
            "blocks_per_replica": blocks, "prompt_blocks": len(policy.block_hashes(ids, None, None))}


def _empty_poll_us(n: int = 20000) -> float:
    """One KVEventSubscriber.poll() with nothing to read, on a real socket."""
    from pagedserve.cluster.wire.kv_events import KVEventPublisher, KVEventSubscriber

    pub = KVEventPublisher("127.0.0.1")
    sub = KVEventSubscriber(pub.address)
    try:
        t0 = time.process_time()
        for _ in range(n):
            sub.poll()
        return (time.process_time() - t0) / n * 1e6
    finally:
        sub.close()
        pub.close()


# ---------------------------------------------------------------- (b) the simulation
@dataclass(frozen=True)
class StepModel:
    """Seconds a step takes (module doc)."""

    prefill_tok_s: float
    decode_step_s: float
    decode_per_req_s: float

    def seconds(self, prefill_tokens: int, num_decoding: int) -> float:
        decode = self.decode_step_s + (num_decoding - 1) * self.decode_per_req_s if num_decoding else 0.0
        return decode + prefill_tokens / self.prefill_tok_s


@dataclass(eq=False)
class SimRequest:
    session: int
    prompt_blocks: list  # the session's block keys (its stream is append-only: block i is (session, i))
    prompt_len: int
    output_len: int
    arrival: float
    computed: int = 0
    decoded: int = 0
    hit_tokens: int = 0
    ttft: float | None = None


@dataclass(eq=False)
class SimReplica:
    model: StepModel
    budget: int
    max_num_seqs: int
    cache_blocks: int
    block_size: int
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    cache: OrderedDict = field(default_factory=OrderedDict)  # block key -> None, least recent first
    rates: StepRates = field(default_factory=StepRates)
    stats: ReplicaStats | None = None
    stats_at: float = 0.0
    in_flight: int = 0
    sent: Counter = field(default_factory=Counter)  # block keys of the requests in flight there
    busy: bool = False
    served: int = 0
    _step: tuple = ()

    def matched(self, blocks: list) -> int:
        return matched_blocks(blocks, self.cache, lambda b: self.sent[b] > 0)

    def _store(self, blocks) -> None:
        for b in blocks:
            self.cache[b] = None
            self.cache.move_to_end(b)
        while len(self.cache) > self.cache_blocks:
            self.cache.popitem(last=False)

    def start_step(self) -> float:
        """Plans a step (decodes first, then prefill chunks, then admissions); its seconds."""
        budget = self.budget
        decodes = [r for r in self.running if r.computed >= r.prompt_len]
        budget -= len(decodes)
        chunks = []
        for r in self.running:
            if r.computed < r.prompt_len and budget > 0:
                take = min(r.prompt_len - r.computed, budget)
                chunks.append((r, take))
                budget -= take
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            r = self.waiting.popleft()
            hit = 0
            for b in r.prompt_blocks:  # its own lookup, as the scheduler's: leading blocks cached now
                if b not in self.cache:
                    break
                self.cache.move_to_end(b)
                hit += 1
            r.computed = r.hit_tokens = min(hit * self.block_size, r.prompt_len - 1)
            self.running.append(r)
            take = min(r.prompt_len - r.computed, budget)
            chunks.append((r, take))
            budget -= take
        prefill = sum(t for _, t in chunks)
        dt = self.model.seconds(prefill, len(decodes))
        self._step = (chunks, decodes, prefill, dt)
        self.busy = True
        return dt

    def end_step(self, now: float) -> list[SimRequest]:
        """Applies the step; the requests it finished. Then publishes its stats."""
        chunks, decodes, prefill, dt = self._step
        self.rates.add(dt, prefill, len(decodes))
        done = []
        for r, take in chunks:
            r.computed += take
            if r.computed >= r.prompt_len:
                r.ttft, r.decoded = now - r.arrival, 1
                self._store(r.prompt_blocks)
        for r in decodes:
            r.decoded += 1
        for r in [r for r in self.running if r.decoded >= r.output_len]:
            self.running.remove(r)
            stream = (r.prompt_len + r.output_len) // self.block_size
            self._store([(r.session, i) for i in range(stream)])
            self.in_flight -= 1
            self.sent.subtract(r.prompt_blocks)
            done.append(r)
        self.busy = False
        self.publish(now)
        return done

    def publish(self, now: float) -> None:
        waiting = 0
        for r in self.waiting:
            held = 0
            for b in r.prompt_blocks:
                if b not in self.cache:
                    break
                held += 1
            waiting += r.prompt_len - min(held * self.block_size, r.prompt_len - 1)
        running = sum(r.prompt_len - r.computed for r in self.running if r.computed < r.prompt_len)
        decoding = sum(1 for r in self.running if r.computed >= r.prompt_len)
        self.stats = ReplicaStats(waiting, running, len(self.waiting), len(self.running), decoding, self.budget,
                                  self.rates.prefill_tok_s or 0.0, self.rates.decode_step_s or 0.0)
        self.stats_at = now


def _route(router: str, replicas: list[SimReplica], req: SimRequest, now: float, policy: KVRoutingPolicy,
           rng: random.Random) -> int:
    if router == "pow2":
        pick = rng.sample(range(len(replicas)), min(2, len(replicas)))
        return min(pick, key=lambda i: (replicas[i].in_flight, rng.random()))
    if router == "affinity":
        return max(range(len(replicas)), key=lambda i: (replicas[i].matched(req.prompt_blocks),
                                                         -replicas[i].in_flight, rng.random()))
    loads = {}
    for i, x in enumerate(replicas):
        age = None if x.stats is None else now - x.stats_at
        if age is not None and not x.busy:
            age %= HEARTBEAT_S  # an idle replica's heartbeat
        loads[i] = replica_load(x.matched(req.prompt_blocks), x.in_flight, len(x.cache), x.stats, age)
    return rank(policy, req.prompt_len, loads, rng.random)[0][0]


def simulate(router: str, num_replicas: int, shape: SessionShape, model: StepModel, *, concurrency: int = 4,
             budget: int = 2048, max_num_seqs: int = 8, cache_blocks: int = 1024, seed: int = 0,
             policy: KVRoutingPolicy | None = None) -> dict:
    """One run: ``concurrency`` x replicas clients over the shape's sessions until every turn
    has been served. Predicted TTFT per request, from the step model."""
    policy = policy or KVRoutingPolicy()
    bs = policy.block_size
    rng = random.Random(seed)
    replicas = [SimReplica(model, budget, max_num_seqs, cache_blocks, bs) for _ in range(num_replicas)]
    num_sessions = max(1, round(shape.sessions_per_replica * num_replicas))
    lens = shape.prompt_lens()
    next_turn = [0] * num_sessions
    ready = list(range(num_sessions))
    rng.shuffle(ready)
    events: list = []  # (time, seq, replica index): step ends
    seq = 0
    finished: list[SimRequest] = []
    idle_clients = concurrency * num_replicas

    def issue(now: float) -> None:
        nonlocal idle_clients, seq
        while idle_clients and ready:
            s = ready.pop(rng.randrange(len(ready)))
            n = lens[next_turn[s]]
            next_turn[s] += 1
            req = SimRequest(s, [(s, i) for i in range(n // bs)], n, shape.output_len, now)
            first = next_turn[s] == 1 and shape.pinned_start
            i = 0 if first else _route(router, replicas, req, now, policy, rng)
            x = replicas[i]
            x.in_flight += 1
            x.served += 1
            x.sent.update(req.prompt_blocks)
            x.waiting.append(req)
            idle_clients -= 1
            if not x.busy:
                seq += 1
                heapq.heappush(events, (now + x.start_step(), seq, i))

    issue(0.0)
    now = 0.0
    while events:
        now, _, i = heapq.heappop(events)
        x = replicas[i]
        for r in x.end_step(now):
            finished.append(r)
            idle_clients += 1
            if next_turn[r.session] < shape.turns:
                ready.append(r.session)
        if x.running or x.waiting:
            seq += 1
            heapq.heappush(events, (now + x.start_step(), seq, i))
        issue(now)
    ttfts = sorted(r.ttft for r in finished)
    prompt = sum(r.prompt_len for r in finished)
    return {"ttft_mean_s": round(statistics.fmean(ttfts), 4),
            "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 4),
            "hit_rate": round(sum(r.hit_tokens for r in finished) / prompt, 3),
            "max_replica_share": round(max(x.served for x in replicas) / len(finished), 3),
            "output_tok_s": round(sum(r.output_len for r in finished) / now, 1), "requests": len(finished)}


def measure_rates(model: str | None = None, prompt_len: int = 512, batch: int = 8) -> dict:
    """The engine's own rates (module doc): StepRates over its timed steps, and the decode
    step at batch 1 and batch ``batch`` for the step model's per-request term."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=model, max_model_len=2048, max_num_seqs=batch, enable_prefix_caching=False)
    eng, rng = llm.engine, random.Random(0)
    vocab = eng.model_config.vocab_size
    rates = StepRates()

    def run(tag: str, n: int, max_tokens: int) -> list[float]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for k in range(n):
            eng.add_request(f"{tag}{k}", [rng.randrange(5, vocab) for _ in range(prompt_len)], params)
        decode_steps = []
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            p, d = step_mix(eng.last_plan, eng.scheduler)
            rates.add(dt, p, d)
            if p == 0 and d == n:
                decode_steps.append(dt)
        return decode_steps

    try:
        run("warm", 2, 4)
        rates = StepRates()  # the warm-up's first steps are slower: not in the figures
        one = statistics.median(run("one", 1, 32))
        many = statistics.median(run("many", batch, 32))
    finally:
        llm.shutdown()
    return {"prefill_tok_s": round(rates.prefill_tok_s, 1), "decode_step_s": round(one, 5),
            "decode_per_req_s": round(max(0.0, (many - one) / (batch - 1)), 6)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 8, 64, 1000], help="(a): hash tables")
    p.add_argument("--blocks", type=int, default=16384, help="(a): cached blocks per replica")
    p.add_argument("--holders", type=int, default=2, help="(a): replicas holding the prompt's first half")
    p.add_argument("--prompt-len", type=int, default=1024, help="(a): prompt tokens")
    p.add_argument("--seconds", type=float, default=0.5, help="(a): CPU time per replica count")
    p.add_argument("--sim-replicas", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--shapes", nargs="+", choices=list(ROUTER_SIM_SHAPES), default=list(ROUTER_SIM_SHAPES))
    p.add_argument("--routers", nargs="+", choices=SIM_ROUTERS, default=list(SIM_ROUTERS))
    p.add_argument("--concurrency", type=int, default=4, help="clients per replica")
    p.add_argument("--cache-blocks", type=int, default=1024, help="prefix-cache blocks per replica")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seeds", type=int, default=5, help="runs per case (mean of their results)")
    p.add_argument("--measure", action="store_true", help="measure the rates on the default model first")
    p.add_argument("--model", default=None, help="with --measure (default: the built-in default model)")
    # Defaults: the default model's, by --measure on a 2-core CPU (BENCHMARKS.md).
    p.add_argument("--prefill-tok-s", type=float, default=500.0)
    p.add_argument("--decode-step-s", type=float, default=0.038, help="a decode step at batch 1")
    p.add_argument("--decode-per-req-s", type=float, default=0.005, help="each further decoding request")
    p.add_argument("--no-decision", action="store_true")
    p.add_argument("--no-sim", action="store_true")
    a = p.parse_args(argv)

    from pagedserve.loadtest.peers.bench_vs_vllm import cpu_name

    out: dict = {"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"CPU: {out['cpu']}", flush=True)
    if not a.no_decision:
        out["decision"] = {}
        for n in a.replicas:
            res = decision_cost(n, a.blocks, a.holders, a.prompt_len, a.seconds)
            out["decision"][str(n)] = res
            print(f"decision  {n:5d} replicas x {a.blocks} blocks: {res['us']:10.1f} us "
                  f"(+ {n} x {res['poll_us']:.2f} us of socket polls)", flush=True)
    if not a.no_sim:
        rates = (measure_rates(a.model) if a.measure else
                 {"prefill_tok_s": a.prefill_tok_s, "decode_step_s": a.decode_step_s,
                  "decode_per_req_s": a.decode_per_req_s})
        out["rates"] = dict(rates, measured=a.measure)
        print(f"rates: {out['rates']}", flush=True)
        model = StepModel(**rates)
        out["simulation"] = {}
        for shape_name in a.shapes:
            shape = ROUTER_SIM_SHAPES[shape_name]
            per_n = out["simulation"][shape_name] = {}
            for n in a.sim_replicas:
                row = per_n[str(n)] = {}
                for router in a.routers:
                    runs = [simulate(router, n, shape, model, concurrency=a.concurrency, budget=a.max_num_batched_tokens,
                                     max_num_seqs=a.max_num_seqs, cache_blocks=a.cache_blocks, seed=s)
                            for s in range(a.seeds)]
                    row[router] = {k: round(statistics.fmean(r[k] for r in runs), 4) for k in runs[0]}
                kv, pow2 = row.get("kv"), row.get("pow2")
                ratio = f"  kv/pow2 mean TTFT {kv['ttft_mean_s'] / pow2['ttft_mean_s']:.2f}" if kv and pow2 else ""
                print(f"sim {shape_name:13s} {n} replicas: " + "  ".join(
                    f"{r} {v['ttft_mean_s'] * 1000:.0f} ms (p99 {v['ttft_p99_s'] * 1000:.0f}, hit {v['hit_rate']:.2f}, "
                    f"max share {v['max_replica_share']:.2f})" for r, v in row.items()) + ratio, flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
