"""Benchmark metrics with ``vllm bench serve``'s names, and the server's own view
scraped from its Prometheus ``/metrics``.

Client side (from the per-request results):
    request_throughput      completed requests / duration             (req/s)
    output_throughput       output tokens / duration                  (tok/s)
    total_token_throughput  (prompt + output tokens) / duration       (tok/s)
    request_goodput         requests meeting every --goodput SLO / duration
    {mean,median,std,p90,p99}_{ttft,tpot,itl,e2el}_ms
    max_concurrent_requests peak number of requests in flight at once

Server side (``pagedserve:`` names, which are vLLM's with our prefix; ``vllm:`` from a server without them):
gauges sampled during the run (peak KV usage, peak running, peak waiting by reason),
counter deltas over the run (preemptions, prefix-cache queries/hits, tokens).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.loadtest.harness.client import RequestResult

PREFIXES = ("pagedserve:", "vllm:")
COUNTERS = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens",
            "generation_tokens")


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0 for an empty list."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [x * 1000.0 for x in seconds]
    return {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
            f"median_{name}_ms": percentile(ms, 50),
            f"std_{name}_ms": statistics.pstdev(ms) if len(ms) > 1 else 0.0,
            f"p90_{name}_ms": percentile(ms, 90),
            f"p99_{name}_ms": percentile(ms, 99)}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        slos[key] = float(value)
    return slos


def peak_concurrency(results: list[RequestResult]) -> int:
    events = sorted([(r.start_time, 1) for r in results] + [(r.end_time, -1) for r in results],
                    key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def compute_metrics(results: list[RequestResult], duration: float,
                    goodput_slos: dict[str, float] | None = None) -> dict[str, float]:
    done = [r for r in results if r.success]
    in_tokens = sum(r.prompt_len for r in done)
    out_tokens = sum(r.output_len for r in done)
    dur = max(duration, 1e-9)
    m: dict[str, float] = {
        "duration": duration, "num_requests": len(results), "completed": len(done),
        "cancelled": sum(r.cancelled for r in results),
        "failed": sum((not r.success) and (not r.cancelled) for r in results),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(done) / dur, "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "max_concurrent_requests": peak_concurrency(results),
        "retries_429": sum(getattr(r, "retries", 0) for r in results),
    }
    m.update(_stats("ttft", [r.ttft for r in done]))
    m.update(_stats("tpot", [r.tpot for r in done if r.output_len > r.n]))
    m.update(_stats("itl", [x for r in done for x in r.itl]))
    m.update(_stats("e2el", [r.latency for r in done]))
    if goodput_slos:
        good = sum(1 for r in done if r.ttft * 1e3 <= goodput_slos.get("ttft", math.inf)
                   and r.tpot * 1e3 <= goodput_slos.get("tpot", math.inf)
                   and r.latency * 1e3 <= goodput_slos.get("e2el", math.inf))
        m["request_goodput"] = good / dur
        m["goodput_fraction"] = good / max(1, len(done))
    return m


@dataclass(slots=True)
class ServerSample:
    """One scrape: engine gauges and counters with the prefix stripped, summed over
    label sets (model_name, engine), except waiting requests kept per ``reason``."""

    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    waiting_by_reason: dict[str, float] = field(default_factory=dict)
    prefix: str = ""


def parse_prometheus(text: str) -> ServerSample:
    out = ServerSample()
    families = list(text_string_to_metric_families(text))
    # pagedserve serves both prefixes for the same numbers: read one, or counts double.
    found = [p for p in PREFIXES if any(f.name.startswith(p) for f in families)]
    for fam in families:
        prefix = next((p for p in found[:1] if fam.name.startswith(p)), None)
        if prefix is None or fam.type == "histogram":
            continue
        out.prefix = prefix
        base = fam.name[len(prefix):]
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            reason = s.labels.get("reason")
            if reason is not None and base.startswith("num_requests_waiting"):
                out.waiting_by_reason[reason] = out.waiting_by_reason.get(reason, 0.0) + s.value
                continue
            if fam.type == "counter" or s.name.endswith("_total"):
                key = s.name[len(prefix):].removesuffix("_total")
                out.counters[key] = out.counters.get(key, 0.0) + s.value
            elif fam.type in ("gauge", "unknown", "untyped"):
                out.gauges[base] = out.gauges.get(base, 0.0) + s.value
    # vLLM < 0.10 called KV usage gpu_cache_usage_perc.
    if "kv_cache_usage_perc" not in out.gauges and "gpu_cache_usage_perc" in out.gauges:
        out.gauges["kv_cache_usage_perc"] = out.gauges["gpu_cache_usage_perc"]
    return out


def server_view(before: ServerSample | None, samples: list[ServerSample],
                after: ServerSample | None) -> dict[str, object]:
    """Peaks of the sampled gauges, counter deltas over the run, the state at the end."""
    view: dict[str, object] = {"num_samples": len(samples)}
    if after is None:
        return view
    def peak(name: str) -> float:
        return max([s.gauges.get(name, 0.0) for s in samples] + [0.0])
    view["peak_kv_cache_usage_perc"] = peak("kv_cache_usage_perc")
    view["peak_num_requests_running"] = peak("num_requests_running")
    view["peak_num_requests_waiting"] = peak("num_requests_waiting")
    reasons: dict[str, float] = {}
    for s in samples:
        for r, v in s.waiting_by_reason.items():
            reasons[r] = max(reasons.get(r, 0.0), v)
    view["peak_waiting_by_reason"] = reasons
    b = before.counters if before else {}
    for c in COUNTERS:
        view[c] = after.counters.get(c, 0.0) - b.get(c, 0.0)
    q = view["prefix_cache_queries"]
    view["prefix_cache_hit_rate"] = (view["prefix_cache_hits"] / q) if q else 0.0
    view["end_kv_cache_usage_perc"] = after.gauges.get("kv_cache_usage_perc", 0.0)
    view["end_num_requests_running"] = after.gauges.get("num_requests_running", 0.0)
    view["end_num_requests_waiting"] = after.gauges.get("num_requests_waiting", 0.0)
    if "num_gpu_blocks" in after.gauges:
        view["num_gpu_blocks"] = after.gauges["num_gpu_blocks"]
        # Leaked = still held once nothing runs or waits (prefix-cached free blocks don't count).
        view["leaked_blocks"] = round(after.gauges["num_gpu_blocks"] * view["end_kv_cache_usage_perc"])
    return view
