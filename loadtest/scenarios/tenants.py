"""The "tenants" scenario (issue 15): one tenant bursts at 5x its fair share while another
sends a steady trickle; the steady tenant's p99 TTFT must stay within 2x of its p99 when
it runs alone. Server "tenants": the default engine with --allow-tenant-header (requests
name their tenant in x-tenant) and admission's queue-delay bound off, so what is measured
is the scheduler's fair share (scheduler/fair_queue.py), not load shedding.

    capacity   64-token streams at max_num_seqs concurrency           -> C req/s
    alone      steady: Poisson at STEADY_FRAC x C for T s             -> p99 TTFT alone
    burst      steady as above + bursty: Poisson at 5 x C/2 for T s   -> steady's p99 TTFT
               (two equal weights: each tenant's share is C/2)
"""

from __future__ import annotations

import threading
import time

from pagedserve.loadtest.harness.arrivals import arrival_times
from pagedserve.loadtest.harness.metrics import percentile
from pagedserve.loadtest.scenarios.core import Row, Run, Scenario
from pagedserve.loadtest.scenarios.robustness import OUT_LEN
from pagedserve.loadtest.workloads import tenant_stream_specs

STEADY_FRAC = 0.2
BURST_X_SHARE = 5.0


def _screenshot_later(url: str, path, after_s: float) -> threading.Thread:
    """A thread that saves a screenshot of the live view ``after_s`` into the burst: after
    the last arrival, while the bursty backlog drains, so the browser's CPU does not land
    on a measured steady request. ``thread.result``: the path, or why there is none."""

    def take() -> None:
        time.sleep(after_s)
        try:
            from pagedserve.loadtest.harness.browser import Browser, find_chromium

            if find_chromium() is None:
                t.result = "not saved (no chromium on PATH)"
                return
            with Browser() as b:
                b.goto(url)
                b.wait_for("document.querySelectorAll('table.tl .chip').length > 0")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b.screenshot())
            t.result = str(path)
        except Exception as e:  # a screenshot must never fail the benchmark
            t.result = f"not saved ({type(e).__name__}: {e})"

    t = threading.Thread(target=take, daemon=True)
    t.result = None
    t.start()
    return t


def tenants(ctx) -> Scenario:
    window_s = ctx.n(30, 12)

    def run(server):
        # Warm-up first: a cold server's first requests (kernel builds, allocator growth)
        # measured far below the real capacity, and a burst sized on that never queued.
        warm = tenant_stream_specs(ctx.max_num_seqs, ctx.vocab_size, ctx.seed + 39, "warm", OUT_LEN)
        ctx.bench(server, warm, label="tenants-warmup")
        cap_specs = tenant_stream_specs(ctx.n(48, 16), ctx.vocab_size, ctx.seed + 40, "cap", OUT_LEN)
        cap = ctx.bench(server, cap_specs, label="tenants-capacity", max_concurrency=ctx.max_num_seqs)
        capacity = cap.metrics["request_throughput"]
        rate_s, rate_b = STEADY_FRAC * capacity, BURST_X_SHARE * capacity / 2
        steady = tenant_stream_specs(max(8, round(rate_s * window_s)), ctx.vocab_size, ctx.seed + 41, "steady", OUT_LEN)
        t_steady = arrival_times(len(steady), rate_s, 1.0, ctx.seed + 42)
        alone = ctx.bench(server, steady, label="tenants-steady-alone", arrivals=t_steady)
        bursty = tenant_stream_specs(round(rate_b * window_s), ctx.vocab_size, ctx.seed + 43, "bursty", OUT_LEN)
        t_bursty = arrival_times(len(bursty), rate_b, 1.0, ctx.seed + 44)
        shot = _screenshot_later(f"{server.base_url}/dashboard", ctx.out / "dashboard-tenants-burst.png",
                                 max(t_steady[-1], t_bursty[-1]) + 3.0)
        mixed = ctx.bench(server, steady + bursty, label="tenants-burst", arrivals=t_steady + t_bursty,
                          drain_timeout=120.0, sample_interval=1.0)
        shot.join(60)

        def p99(res, kind):
            return percentile([r.ttft for r in res.results if r.kind == kind and r.success], 99)

        def refused(res, kind):
            return sum(1 for r in res.results if r.kind == kind and r.status_code == 429)

        def failed(res):
            return sum(1 for r in res.results if not r.success and not r.cancelled and r.status_code != 429)

        return {"capacity": capacity, "rate_steady": rate_s, "rate_bursty": rate_b,
                "alone_p99": p99(alone, "steady"), "mixed_p99": p99(mixed, "steady"),
                "bursty_p99": p99(mixed, "bursty"), "n_steady": len(steady), "n_bursty": len(bursty),
                "failed": failed(mixed) + failed(alone), "steady_refused": refused(mixed, "steady")
                + refused(alone, "steady"), "bursty_refused": refused(mixed, "bursty"),
                "screenshot": getattr(shot, "result", None)}

    def rows(_, res):
        r = res["tenants"]
        ratio = r["mixed_p99"] / r["alone_p99"] if r["alone_p99"] else float("inf")
        note = (f"capacity {r['capacity']:.2f} req/s; steady {r['rate_steady']:.2f} req/s x {r['n_steady']} "
                f"({r['steady_refused']} refused), bursty {r['rate_bursty']:.2f} req/s x {r['n_bursty']} (5x its "
                f"share; {r['bursty_refused']} refused with 429); bursty p99 TTFT {r['bursty_p99']:.2f} s; "
                f"{r['failed']} failed; dashboard: {r['screenshot']}")
        return [Row("tenants", "steady tenant p99 TTFT (s), with a 5x-share burst vs alone", "alone",
                    r["alone_p99"], "with burst", r["mixed_p99"], ratio and 1 / ratio, "<= 2x its alone",
                    ratio <= 2.0 and r["failed"] == 0 and r["steady_refused"] == 0, note)]
    return Scenario("tenants", [Run("tenants", "tenants", run)], rows)
