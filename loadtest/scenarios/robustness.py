"""Robustness scenarios of ``python -m pagedserve.loadtest compare`` (issue 10).

    scenario      what                                                        goals
    overload      capacity measured, then Poisson arrivals at 1x (baseline),  0 x 5xx, 0 client
                  3x for 60 s and 10x for 20 s of it; 64-token streams        time-outs, 0 restarts,
                                                                              429s carry Retry-After,
                                                                              p99 TTFT (admitted)
                                                                              <= 5x its 1x value
    cancel-soak   2,000 streams, 10% closed by the client mid-stream          0 leaked blocks, gauges
                                                                              back to 0, all accounted

``--quick`` shortens the phases (overload: 3x for 20 s, 10x for 10 s; soak: 400 streams).
Overload runs without client retries: each 429 is a result (its Retry-After is checked),
as are the requests admitted. Replica restarts are counted from the replica ids in the
``x-pagedserve-replica`` header of admitted requests (one id per replica incarnation).
"""

from __future__ import annotations

from pagedserve.loadtest.harness.metrics import percentile
from pagedserve.loadtest.scenarios.core import Row, Run, Scenario
from pagedserve.loadtest.workloads import short_stream_specs

OUT_LEN = 64
CLIENT_TIMEOUT_S = 60.0


def _kind(r) -> str:
    """admitted | 429 | 5xx (a 5xx status, or an in-band error after a 200) | timeout | other."""
    if r.success or r.cancelled:
        return "admitted"
    if "timeout" in r.error.lower():
        return "timeout"
    if r.status_code == 429:
        return "429"
    if r.status_code >= 500 or r.status_code == 200:
        return "5xx"
    return "other"


def _phase(res) -> dict:
    rs = res.results
    kinds = [_kind(r) for r in rs]
    admitted = [r for r in rs if r.success]
    refused = [r for r in rs if r.status_code == 429]
    return {"sent": len(rs), "admitted": len(admitted), "429": len(refused),
            "429_with_retry_after": sum(r.retry_after is not None and r.retry_after >= 1 for r in refused),
            "retry_after_values": sorted({r.retry_after for r in refused if r.retry_after is not None}),
            "5xx": kinds.count("5xx"), "timeouts": kinds.count("timeout"), "other": kinds.count("other"),
            "p99_ttft_s": percentile([r.ttft for r in admitted], 99),
            "p50_ttft_s": percentile([r.ttft for r in admitted], 50),
            "admitted_per_s": len(admitted) / res.metrics["duration"] if res.metrics["duration"] else 0.0,
            "replicas": {r.replica for r in admitted if r.replica},
            "client_lag_p99_s": res.metrics.get("client_loop_lag_p99_s", 0.0),
            "client_lag_max_s": res.metrics.get("client_loop_lag_max_s", 0.0)}


def overload(ctx) -> Scenario:
    phases = ((3, ctx.n(60, 20)), (10, ctx.n(20, 10)))

    def run(server):
        cap_specs = short_stream_specs(ctx.n(96, 48), ctx.vocab_size, ctx.seed + 10, "cap", OUT_LEN)
        cap = ctx.bench(server, cap_specs, label="overload-capacity", max_concurrency=ctx.max_num_seqs,
                        request_timeout=CLIENT_TIMEOUT_S)
        capacity = cap.metrics["request_throughput"]
        out = {"capacity_req_s": capacity, "phases": {}}
        base_s = ctx.n(30, 15)
        for mult, secs in ((1, base_s),) + phases:
            rate = mult * capacity
            specs = short_stream_specs(max(1, round(rate * secs)), ctx.vocab_size, ctx.seed + 11 + mult, f"x{mult}",
                                       OUT_LEN)
            res = ctx.bench(server, specs, label=f"overload-{mult}x", request_rate=rate, sample_interval=1.0,
                            request_timeout=CLIENT_TIMEOUT_S, drain_timeout=60.0)
            out["phases"][mult] = {**_phase(res), "offered_req_s": rate, "seconds": secs}
        out["replicas"] = set().union(*(p["replicas"] for p in out["phases"].values()))
        return out

    def rows(_, res):
        r = res["overload"]
        ph, base = r["phases"], r["phases"][1]
        hot = [ph[m] for m, _ in phases]
        n429 = sum(p["429"] for p in hot)
        with_ra = sum(p["429_with_retry_after"] for p in hot)
        restarts = max(0, len(r["replicas"]) - 1)
        note = "; ".join(f"{m}x: {p['sent']} sent, {p['admitted']} admitted ({p['admitted_per_s']:.1f}/s), "
                         f"{p['429']} x 429 (Retry-After {p['retry_after_values'][:6]}), "
                         f"p50/p99 TTFT {p['p50_ttft_s']:.2f}/{p['p99_ttft_s']:.2f} s, "
                         f"client loop lag p99/max {p['client_lag_p99_s']:.2f}/{p['client_lag_max_s']:.2f} s"
                         for m, p in sorted(ph.items()))
        out = [Row("overload", "capacity (req/s, 64-token streams)", "-", 0, "measured", r["capacity_req_s"],
                   None, "reported", None, note),
               Row("overload", "5xx / client time-outs at 3x and 10x", "-", 0, "5xx + time-outs",
                   sum(p["5xx"] + p["timeouts"] for p in hot), None, "== 0",
                   all(p["5xx"] == 0 and p["timeouts"] == 0 for p in hot),
                   f"5xx {[p['5xx'] for p in hot]}, time-outs {[p['timeouts'] for p in hot]}"),
               Row("overload", "engine replica restarts", "-", 0, "restarts", restarts, None, "== 0",
                   restarts == 0),
               Row("overload", "429s carrying Retry-After (3x, 10x)", "429s", n429, "with Retry-After", with_ra,
                   None, "all, and > 0", n429 > 0 and with_ra == n429)]
        for (m, _), p in zip(phases, hot):
            ratio = p["p99_ttft_s"] / base["p99_ttft_s"] if base["p99_ttft_s"] else float("inf")
            out.append(Row("overload", f"p99 TTFT of admitted requests, {m}x vs 1x (s)", "1x",
                           base["p99_ttft_s"], f"{m}x", p["p99_ttft_s"], None, "<= 5x the 1x value",
                           ratio <= 5.0, f"{ratio:.2f}x"))
        return out
    return Scenario("overload", [Run("default", "overload", run)], rows)


def cancel_soak(ctx) -> Scenario:
    specs = short_stream_specs(ctx.n(2000, 400), ctx.vocab_size, ctx.seed + 20, "soak", OUT_LEN, cancel_frac=0.10)

    def run(server):
        # Enough in flight to keep the batch full and a queue behind it, not so many that
        # the queueing-delay bound refuses them (the soak is about cancellation, not 429s).
        return ctx.bench(server, specs, label="cancel-soak", max_concurrency=2 * ctx.max_num_seqs,
                         drain_timeout=60.0, max_retries=8, request_timeout=CLIENT_TIMEOUT_S)

    def rows(_, res):
        r = res["soak"]
        m, s = r.metrics, r.server
        want = sum(x.cancel_after is not None for x in specs)
        leaked = s.get("leaked_blocks")
        end = {k: s.get(f"end_{k}", float("nan")) for k in ("num_requests_running", "num_requests_waiting",
                                                             "kv_cache_usage_perc")}
        accounted = m["completed"] + m["cancelled"] + m["failed"]
        return [Row("cancel-soak", f"leaked KV blocks after {len(specs)} streams ({want} cancelled)", "-", 0,
                    "pagedserve", float("nan") if leaked is None else leaked, None, "== 0", leaked == 0),
                Row("cancel-soak", "gauges at the end (running + waiting + KV usage)", "-", 0, "sum",
                    sum(end.values()), None, "== 0", sum(end.values()) == 0,
                    ", ".join(f"{k} {v:g}" for k, v in end.items())),
                Row("cancel-soak", "requests accounted (done+cancelled+failed / sent)", "sent", len(specs),
                    "accounted", accounted, None, "all; 0 failed",
                    accounted == len(specs) and m["failed"] == 0 and m["cancelled"] == want,
                    f"{m['completed']} done, {m['cancelled']}/{want} cancelled, {m['failed']} failed, "
                    f"{sum(q.retries for q in r.results)} 429 retries, {m['duration']:.0f} s")]
    return Scenario("cancel-soak", [Run("default", "soak", run)], rows)
