"""Prometheus metrics: vLLM's series under vLLM's own names (``vllm:*``, so a vLLM
dashboard or alert works unchanged), and every series under a ``pagedserve:`` prefix too,
including ours that vLLM has no name for (waiting by reason, tenants, replicas).

The ``pagedserve:`` copies of vLLM's series stay: existing dashboards, the /dashboard
page and loadtest/ read them. The ``vllm:`` histograms use vLLM's bucket boundaries
(vllm/v1/metrics/buckets.py); the ``pagedserve:`` ones keep their trimmed sets.

Where each number comes from:

    engine replica k ──stats snapshot (after steps, >= 1/s when idle)──▶ StatsAggregator
                                                                      (one Serve replica)
    ingress: per-request latencies from RequestOutput.metrics ──▶ histograms
    GET /metrics  = histograms (ingress) + gauges/counters summed over live replicas

Counters of a replica that went away (downscaling) are folded into a "retired" base, so
the summed counters never go backwards. Gauges of a replica that stopped reporting for
``stale_after_s`` are dropped.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pagedserve.cluster.front.router import route_counts
from pagedserve.cluster.wire.stats import COUNTER_KEYS, GAUGE_KEYS, LORA_NAME_KEYS, PER_POS_KEY, TENANT_KEYS
from pagedserve.scheduler.stats import WAITING_REASONS

PREFIX = "pagedserve:"
VLLM_PREFIX = "vllm:"
# vLLM's FinishReason values, each with a series from the start (0 until one happens).
FINISHED_REASONS = ("stop", "length", "abort", "error")

# Snapshot keys summed across replicas. Counters are monotonic per replica.
class StatsAggregator:
    """Latest snapshot per replica, summed on demand (plain class: unit-testable without
    Ray; cluster/app.py wraps it in a one-replica deployment)."""

    def __init__(self, stale_after_s: float = 10.0) -> None:
        self.stale_after_s = stale_after_s
        self._latest: dict[str, tuple[float, dict[str, Any]]] = {}
        self._views: dict[str, dict] = {}
        self._retired = {k: 0 for k in COUNTER_KEYS}
        self._retired_per_pos: list[int] = []
        self._retired_tenant_tokens: dict[str, float] = {}

    def report(self, replica_id: str, snapshot: dict[str, Any], now: float | None = None) -> None:
        if "view" in snapshot:  # the dashboard's; not summed
            snapshot = dict(snapshot)
            self._views[replica_id] = snapshot.pop("view")
        self._latest[replica_id] = (time.monotonic() if now is None else now, snapshot)

    def views(self) -> dict[str, dict]:
        """{replica id: its latest live view (live_view.py)}, live replicas only."""
        return {rid: self._views[rid] for rid in sorted(self._latest) if rid in self._views}

    def remove(self, replica_id: str) -> None:
        entry = self._latest.pop(replica_id, None)
        self._views.pop(replica_id, None)
        if entry is not None:
            for k in COUNTER_KEYS:
                self._retired[k] += entry[1].get(k, 0)
            _add_per_pos(self._retired_per_pos, entry[1].get(PER_POS_KEY, ()))
            for t, v in entry[1].get("tenants", {}).items():
                self._retired_tenant_tokens[t] = self._retired_tenant_tokens.get(t, 0) + v.get("tokens", 0)

    def merged(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        for rid, (t, _) in list(self._latest.items()):
            if now - t > self.stale_after_s:
                self.remove(rid)
        snaps = [s for _, s in self._latest.values()]
        out: dict[str, Any] = {k: sum(s.get(k, 0) for s in snaps) for k in GAUGE_KEYS}
        for k in COUNTER_KEYS:
            out[k] = self._retired[k] + sum(s.get(k, 0) for s in snaps)
        reasons: dict[str, int] = {}
        for s in snaps:
            for r, c in s.get("waiting_by_reason", {}).items():
                reasons[r] = reasons.get(r, 0) + c
        out["waiting_by_reason"] = reasons
        per_pos = list(self._retired_per_pos)
        for s in snaps:
            _add_per_pos(per_pos, s.get(PER_POS_KEY, ()))
        out[PER_POS_KEY] = per_pos
        out["queue_kv_demand_blocks"] = sum(s.get("queue_kv_demand_blocks", 0) for s in snaps)
        for k in LORA_NAME_KEYS:
            out[k] = sorted({name for s in snaps for name in s.get(k, ())})
        out["max_lora"] = max((s.get("max_lora", 0) for s in snaps), default=0)  # per replica, as vLLM's
        tenants: dict[str, dict[str, float]] = {}
        for s in snaps:
            for t, v in s.get("tenants", {}).items():
                acc = tenants.setdefault(t, dict.fromkeys(TENANT_KEYS, 0))
                for k in TENANT_KEYS:
                    acc[k] += v.get(k, 0)
        # Tokens of a retired replica's tenants keep counting (the counter never drops).
        for t, n in self._retired_tenant_tokens.items():
            tenants.setdefault(t, dict.fromkeys(TENANT_KEYS, 0))["tokens"] += n
        out["tenants"] = tenants
        # Pool-weighted usage: used blocks over all blocks of all live replicas.
        out["kv_cache_usage"] = (out["num_used_blocks"] / out["num_blocks"]) if out["num_blocks"] else 0.0
        out["num_replicas"] = len(snaps)
        out["replica_ids"] = sorted(self._latest)
        # Each live replica's own prefix-cache counters: whether routing keeps prefixes
        # where their blocks are shows here, not in the sums.
        out["replica_prefix_cache"] = {rid: (s.get("prefix_cache_queries", 0), s.get("prefix_cache_hits", 0))
                                       for rid, (_, s) in sorted(self._latest.items())}
        return out


def _add_per_pos(acc: list[int], counts) -> None:
    """acc[i] += counts[i], growing acc to the longer of the two."""
    acc.extend([0] * (len(counts) - len(acc)))
    for i, c in enumerate(counts):
        acc[i] += c


# Buckets as vLLM's (seconds), trimmed to what a CPU box and a GPU cluster both hit.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 10.0, 20.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0)


# vLLM's own boundaries (seconds), for the vllm: histograms.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                        60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Yields the summed replica snapshot as gauge/counter families at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.merged: dict[str, Any] = StatsAggregator().merged()

    def collect(self):
        m, labels = self.merged, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", m["running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", m["waiting"])
        by_reason = GaugeMetricFamily(PREFIX + "num_requests_waiting_by_reason",
                                      "Waiting requests by reason.", labels=["model_name", "reason"])
        # Every reason always (0 when none wait for it), so a dashboard's series exist.
        reasons = {**dict.fromkeys(WAITING_REASONS, 0), **m["waiting_by_reason"]}
        for reason, count in sorted(reasons.items()):
            by_reason.add_metric([self.model_name, str(reason)], count)
        yield by_reason
        yield gauge("num_free_blocks", "Free KV-cache blocks (cached-free included).",
                    m["num_free_blocks"])
        yield gauge("queue_kv_demand_blocks", "KV blocks the waiting prompts would take.",
                    m.get("queue_kv_demand_blocks", 0))
        yield from _tenant_families(self.model_name, m.get("tenants", {}))
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                    m["kv_cache_usage"])
        yield gauge("num_gpu_blocks", "KV-cache blocks over all replicas.", m["num_blocks"])
        yield gauge("num_replicas", "Engine replicas reporting stats.", m["num_replicas"])
        yield counter("num_preemptions", "Preemptions (recompute).", m["num_preemptions"])
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      m["prefix_cache_queries"])
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      m["prefix_cache_hits"])
        yield counter("prompt_tokens", "Prefill tokens processed.", m["num_prompt_tokens"])
        yield counter("generation_tokens", "Tokens generated.", m["num_generation_tokens"])
        per = (CounterMetricFamily(PREFIX + "replica_prefix_cache_queries",
                                   "Prompt tokens looked up in one replica's prefix cache.",
                                   labels=["model_name", "replica"]),
               CounterMetricFamily(PREFIX + "replica_prefix_cache_hits",
                                   "Prompt tokens found in one replica's prefix cache.",
                                   labels=["model_name", "replica"]))
        for rid, values in m.get("replica_prefix_cache", {}).items():
            for fam, v in zip(per, values):
                fam.add_metric([self.model_name, rid], v)
        yield from per
        yield from _router_families(self.model_name)
        yield from self._vllm_families()

    def _vllm_families(self):
        """vLLM's names and types for the same numbers (no ``engine`` label: ours are summed
        over replicas, as a vLLM dashboard's sum by (model_name) would)."""
        m, labels = self.merged, [self.model_name]
        for name, doc, value in (
                ("num_requests_running", "Number of requests in model execution batches.", m["running"]),
                ("num_requests_waiting", "Number of requests waiting to be processed.", m["waiting"]),
                ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m["kv_cache_usage"])):
            g = GaugeMetricFamily(VLLM_PREFIX + name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            yield g
        for name, doc, key in (
                ("num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
                ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                 "prefix_cache_queries"),
                ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                 "prefix_cache_hits"),
                ("prompt_tokens", "Number of prefill tokens processed.", "num_prompt_tokens"),
                ("generation_tokens", "Number of generation tokens processed.", "num_generation_tokens")):
            c = CounterMetricFamily(VLLM_PREFIX + name, doc, labels=["model_name"])
            c.add_metric(labels, m[key])
            yield c
        if m.get("max_lora"):  # LoRA is on (vLLM shows this only then)
            # vLLM's info gauge: the labels carry the adapters (comma-joined names), the
            # value is when they were last seen (seconds since the epoch).
            g = GaugeMetricFamily(VLLM_PREFIX + "lora_requests_info", "Running stats on lora requests.",
                                  labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            g.add_metric([str(m["max_lora"]), ",".join(m.get("waiting_lora_adapters", ())),
                          ",".join(m.get("running_lora_adapters", ()))], time.time())
            yield g
        if m.get(PER_POS_KEY):  # speculative decoding is on (vLLM shows these only then)
            for name, doc, key in (
                    ("spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_num_drafts"),
                    ("spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_num_draft_tokens"),
                    ("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                     "spec_num_accepted_tokens")):
                c = CounterMetricFamily(VLLM_PREFIX + name, doc, labels=["model_name"])
                c.add_metric(labels, m[key])
                yield c
            c = CounterMetricFamily(VLLM_PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", labels=["model_name", "position"])
            for pos, n in enumerate(m[PER_POS_KEY]):
                c.add_metric([self.model_name, str(pos)], n)
            yield c


def _router_families(model_name: str):
    """What this front's KV router decided (routing.py, route_counts.py)."""
    r = route_counts.snapshot()
    routed = CounterMetricFamily(PREFIX + "router_requests", "Requests the KV router sent to a replica, by "
                                 "what decided: the prompt's cached prefix, or load.",
                                 labels=["model_name", "decision"])
    for decision, n in sorted(r["routed"].items()):
        routed.add_metric([model_name, decision], n)
    yield routed
    for name, doc, key in (("router_prompt_tokens", "Prompt tokens of the requests the KV router routed.",
                            "prompt_tokens"),
                           ("router_matched_tokens", "Of those, the tokens the chosen replica held cached, "
                            "as its KV events said.", "matched_tokens")):
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        c.add_metric([model_name], r[key])
        yield c


def _tenant_families(model_name: str, tenants: dict[str, dict[str, float]]):
    fams = (GaugeMetricFamily(PREFIX + "tenant_requests_running", "Running requests per tenant.",
                              labels=["model_name", "tenant"]),
            GaugeMetricFamily(PREFIX + "tenant_requests_waiting", "Waiting requests per tenant.",
                              labels=["model_name", "tenant"]),
            CounterMetricFamily(PREFIX + "tenant_tokens", "Tokens scheduled per tenant "
                                "(prefill and decode: the fair share's measure).",
                                labels=["model_name", "tenant"]))
    for t, v in sorted(tenants.items()):
        for fam, k in zip(fams, TENANT_KEYS):
            fam.add_metric([model_name, t], v.get(k, 0))
    yield from fams


class _RepeatedHistogram:
    """A histogram that takes one value k times in O(buckets), not k observe() calls on
    the ingress's event loop (a 32k-token answer is 32k gaps)."""

    def __init__(self, name: str, doc: str, model_name: str, buckets) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = tuple(buckets) + (float("inf"),)
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[next(i for i, b in enumerate(self.bounds) if value <= b)] += count
        self.sum += value * count

    def collect(self):
        h = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative = list(itertools.accumulate(self.counts))
        h.add_metric([self.model_name], [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative)],
                     self.sum)
        yield h


class ServeMetrics:
    """The ingress's registry: latency histograms it observes itself plus the replicas'
    summed stats. A private registry, so two apps in one process never collide."""

    def __init__(self, model_name: str, kv_sizing: dict | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine = _EngineCollector(model_name)
        self.registry.register(self.engine)
        self.model_name = model_name

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        # The same request seen from the HTTP front: from its handler's start, through the
        # replica call, tokenization, admission and the engine's queue, to the first output
        # read off the output channel. Beside the client's TTFT it shows the wait before the
        # front (proxy, network); beside the engine's, the wait between front and engine.
        self.front_ttft = hist("front_time_to_first_token_seconds",
                               "Time to first token as the HTTP front sees it (its arrival to the "
                               "first output it reads).", _TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Time per output token after the first.",
                         _TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.",
                          _LATENCY_BUCKETS)

        def vhist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(VLLM_PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.v_ttft = vhist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                            VLLM_TTFT_BUCKETS)
        self.v_itl = _RepeatedHistogram(VLLM_PREFIX + "inter_token_latency_seconds",
                                        "Histogram of inter-token latency in seconds.", model_name,
                                        VLLM_ITL_BUCKETS)
        self.registry.register(self.v_itl)
        self.v_e2e = vhist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                           VLLM_LATENCY_BUCKETS)
        self.v_queue = vhist("request_queue_time_seconds",
                             "Histogram of time spent in WAITING phase for request.", VLLM_LATENCY_BUCKETS)
        success = Counter(VLLM_PREFIX + "request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=self.registry)
        self.v_success = {r: success.labels(model_name, r) for r in FINISHED_REASONS}
        self.shed_at_ingress = Counter(PREFIX + "requests_shed_at_ingress",
                                       "429s the ingress answered itself while every replica shed.",
                                       ["model_name"], registry=self.registry).labels(model_name)
        self.replicas_lost = Counter(PREFIX + "replicas_lost",
                                     "Engine replicas this front saw die (their lifeline ended).",
                                     ["model_name"], registry=self.registry).labels(model_name)
        self.requests_retried = Counter(PREFIX + "requests_retried",
                                        "Requests tried again on another replica after theirs was lost "
                                        "before it had sent anything.",
                                        ["model_name"], registry=self.registry).labels(model_name)
        if kv_sizing:
            self._kv_sizing_gauges(model_name, kv_sizing)

    def _kv_sizing_gauges(self, model_name: str, kv: dict) -> None:
        """What one token costs in the KV cache of each TP rank, scales included (the
        startup log's and ``pagedserve kv-size``'s figure), and vLLM's cache_config_info."""
        dtype = str(kv.get("kv_cache_dtype", "auto"))
        for name, doc, key in (
                ("kv_cache_bytes_per_token", "KV-cache bytes one token takes on each TP rank, scales included.",
                 "kv_bytes_per_token_per_rank"),
                ("kv_cache_scale_bytes_per_token", "Of those, the bytes of quantisation scales.",
                 "kv_scale_bytes_per_token_per_rank")):
            g = Gauge(PREFIX + name, doc, ["model_name", "kv_cache_dtype"], registry=self.registry)
            g.labels(model_name, dtype).set(float(kv.get(key, 0) or 0))
        info = Gauge(VLLM_PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig.",
                     ["model_name", "block_size", "cache_dtype", "num_gpu_blocks"], registry=self.registry)
        info.labels(model_name, str(kv.get("block_size", "")), dtype, str(kv.get("num_blocks", ""))).set(1)

    def count_finished(self, finish_reasons) -> None:
        """vllm:request_success_total, one per sample (vLLM counts each of n)."""
        for r in finish_reasons:
            self.v_success.get(r or "abort", self.v_success["error"]).inc()

    def observe_finished(self, metrics: Any, num_output_tokens: int, finish_reasons=()) -> None:
        """Record one finished request from its RequestMetrics (engine-process clock:
        only differences of its own timestamps are used)."""
        self.count_finished(finish_reasons)
        arrival = getattr(metrics, "arrival_time", None)
        if arrival is None:
            return
        first_sched = getattr(metrics, "first_scheduled_time", None)
        first_tok = getattr(metrics, "first_token_time", None)
        last_tok = getattr(metrics, "last_token_time", None)
        finished = getattr(metrics, "finished_time", None)
        if first_sched is not None:
            self.queue.observe(max(0.0, first_sched - arrival))
            self.v_queue.observe(max(0.0, first_sched - arrival))
        if first_tok is not None:
            self.ttft.observe(max(0.0, first_tok - arrival))
            self.v_ttft.observe(max(0.0, first_tok - arrival))
            if last_tok is not None and num_output_tokens > 1:
                tpot = max(0.0, (last_tok - first_tok) / (num_output_tokens - 1))
                self.tpot.observe(tpot)
                # vLLM observes each gap; the ingress sees a request's first and last token
                # only, so each of its n - 1 gaps counts as their mean: sum and count are
                # exact, the buckets hold per-request means.
                self.v_itl.observe(tpot, num_output_tokens - 1)
        if finished is not None:
            self.e2e.observe(max(0.0, finished - arrival))
            self.v_e2e.observe(max(0.0, finished - arrival))

    def render(self, merged: dict[str, Any]) -> bytes:
        self.engine.merged = merged
        return generate_latest(self.registry)


class _Families:
    """Metric families already collected, as generate_latest reads a registry."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)


def render_models(models: list[tuple[ServeMetrics, dict[str, Any]]]) -> bytes:
    """/metrics of an app of several models: each model's registry with its replicas'
    merged stats, one family per name holding every model's samples (each labelled by its
    model_name, as vLLM's), since an exposition may name a family once."""
    families: dict[str, Any] = {}
    for metrics, merged in models:
        metrics.engine.merged = merged
        for family in metrics.registry.collect():
            if family.name in families:
                families[family.name].samples = families[family.name].samples + family.samples
            else:
                families[family.name] = family
    return generate_latest(_Families(list(families.values())))
