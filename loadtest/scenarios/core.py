"""The side-by-side scenarios of ``python -m pagedserve.loadtest compare``.

Each scenario lists the runs it needs, each against a named server configuration, and
turns their results into rows (ratio next to goal). The driver (loadtest.scenarios.compare) starts
each server configuration once, runs everything that needs it, and stops it, so only one
server is ever up at a time (two cores).

    scenario            servers                 ratio (>1 = ours better)         goal
    continuous-batching default vs static       throughput, goodput              >= 4x
    paged-kv            paged-kv vs contig-kv   peak running seqs; KV util.      >= 3x; >= 0.96
    chunked-prefill     default vs no-chunk     p99 ITL off/on; throughput       >= 3x; loss <= 10%
    prefix-caching      default vs no-prefix    mean TTFT off/on; hit rate       >= 2x; >= 0.5
    mixed-saturation    default                 leaked KV blocks; accounting     0; all
    rate-sweep          default                 knee (req/s)                     reported
    vs-vllm             default vs vllm         throughput, TTFT, TPOT           reported
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Callable

from pagedserve.loadtest.workloads import (RequestSpec, decode_and_doc_specs, generate_workload, kv_pressure_specs,
                                           long_prefix_specs)


@dataclass(slots=True)
class Row:
    scenario: str
    metric: str
    baseline: str
    baseline_value: float
    ours: str
    ours_value: float
    ratio: float | None  # oriented so that > 1 means ours is better (None: not a ratio)
    goal: str
    met: bool | None  # None: reported, no goal
    note: str = ""


@dataclass
class Run:
    server: str  # key into the server configurations
    name: str
    call: Callable  # (ctx, server) -> BenchmarkResult or dict


@dataclass
class Scenario:
    name: str
    runs: list[Run]
    rows: Callable  # (ctx, {run name: result}) -> list[Row]
    extra: dict = field(default_factory=dict)


def _ratio(ours: float, base: float, higher_better: bool = True) -> float:
    if higher_better:
        return ours / base if base else float("inf")
    return base / ours if ours else float("inf")


def _pair_row(scn, metric, base_label, base, ours_label, ours, goal_x, higher=True, note="") -> Row:
    r = _ratio(ours, base, higher)
    goal = f">= {goal_x:g}x" if goal_x else "reported"
    return Row(scn, metric, base_label, base, ours_label, ours, r, goal, (r >= goal_x) if goal_x else None, note)


# ---------------------------------------------------------------- continuous vs static
def continuous_batching(ctx) -> Scenario:
    specs = generate_workload("chat", ctx.n(96, 24), max_model_len=ctx.max_model_len,
                              vocab_size=ctx.vocab_size, seed=ctx.seed)
    slo = ctx.slo

    def run(server):
        return ctx.bench(server, specs, label="continuous-batching", goodput=slo)

    def rows(_, res):
        c, s = res["continuous"].metrics, res["static"].metrics
        slo_txt = " ".join(f"{k}:{v:g}ms" for k, v in slo.items())
        return [_pair_row("continuous-batching", "output throughput (tok/s)", "static", s["output_throughput"],
                          "continuous", c["output_throughput"], 4.0),
                _pair_row("continuous-batching", f"goodput (req/s, {slo_txt})", "static", s["request_goodput"],
                          "continuous", c["request_goodput"], 4.0)]
    return Scenario("continuous-batching", [Run("default", "continuous", run), Run("static", "static", run)], rows)


# ---------------------------------------------------------------- paged vs contiguous KV
def kv_utilisation(result, num_blocks: int, block_size: int) -> float | None:
    """Median over scrapes of (tokens the client knows are cached) / (allocated block
    slots), using only scrapes where the client's count of decoding requests equals the
    server's running count (no request mid-prefill or just finished)."""
    vals = []
    for _, toks, n_started, s in result.timeline:
        running = s.gauges.get("num_requests_running", 0)
        used = s.gauges.get("kv_cache_usage_perc", 0) * s.gauges.get("num_gpu_blocks", num_blocks)
        if running >= 1 and n_started == running and used > 0:
            vals.append(toks / (used * block_size))
    return statistics.median(vals) if vals else None


def paged_kv(ctx) -> Scenario:
    # Clients ask for all that fits but stop reading early (see kv_pressure_specs).
    specs = kv_pressure_specs(ctx.n(48, 20), ctx.max_model_len, ctx.vocab_size, ctx.seed + 1)

    def run(server):
        # A cap on in-flight requests keeps the waiting queue mostly under the server's 429
        # bound (waiting demand > all blocks); preempted requests re-queue with their outputs,
        # so a 429 can still happen and is retried as the OpenAI SDK would.
        return ctx.bench(server, specs, label="paged-kv", sample_interval=0.2, max_concurrency=ctx.n(12, 10),
                         max_retries=5)

    def rows(_, res):
        p, c = res["paged"], res["contiguous"]
        nb = ctx.kv_blocks
        up, uc = kv_utilisation(p, nb, ctx.block_size), kv_utilisation(c, nb, ctx.block_size)
        out = [_pair_row("paged-kv", f"peak running sequences ({nb} blocks x {ctx.block_size})", "contiguous",
                         c.server.get("peak_num_requests_running", 0), "paged",
                         p.server.get("peak_num_requests_running", 0), 3.0)]
        out.append(Row("paged-kv", "KV utilisation (cached tokens / allocated slots)", "contiguous",
                       uc if uc is not None else float("nan"), "paged", up if up is not None else float("nan"),
                       None, ">= 0.96 (paged)", (up is not None and up >= 0.96),
                       "median over /metrics scrapes (client token counts lag by <= 1 step)"))
        return out
    return Scenario("paged-kv", [Run("paged-kv", "paged", run), Run("contig-kv", "contiguous", run)], rows)


# ---------------------------------------------------------------- chunked prefill
def _chunked_specs(ctx) -> tuple[list[RequestSpec], list[float]]:
    """Decoders start at t=0 (short prompts, long outputs); long documents (80-100% of
    max_model_len) arrive while they decode. p99 ITL is measured on the decoders."""
    # Stalls must be > 1% of the decoders' gaps for p99 to see them: n_doc / out_len ~ 5%.
    n_dec, n_doc = ctx.n(8, 4), ctx.n(6, 3)
    specs = decode_and_doc_specs(n_dec, n_doc, ctx.n(128, 64), ctx.max_model_len, ctx.vocab_size, ctx.seed + 2)
    times = [0.0] * n_dec + [ctx.chunk_gap_s * (j + 1) for j in range(n_doc)]
    return specs, times


def chunked_prefill(ctx) -> Scenario:
    specs, times = _chunked_specs(ctx)

    def run(server):
        return ctx.bench(server, specs, label="chunked-prefill", arrivals=times)

    def rows(_, res):
        def p99_itl(r):
            from pagedserve.loadtest.harness.metrics import percentile
            return percentile([x for q in r.results if q.kind == "decode" and q.success for x in q.itl], 99) * 1e3
        on, off = res["chunked"], res["no-chunk"]
        a, b = p99_itl(on), p99_itl(off)
        t_on, t_off = on.metrics["total_token_throughput"], off.metrics["total_token_throughput"]
        loss = 1 - t_on / t_off if t_off else 0.0

        def overlap(r):  # documents that arrived while the decoders were still running
            end = max((q.end_time for q in r.results if q.kind == "decode"), default=0.0)
            return sum(q.start_time < end for q in r.results if q.kind == "long-doc")
        n_doc = sum(s.kind == "long-doc" for s in specs)
        return [_pair_row("chunked-prefill", "p99 ITL of decodes (ms)", "chunked off", b, "chunked on", a, 3.0,
                          higher=False, note=f"docs during decodes: off {overlap(off)}/{n_doc}, "
                                              f"on {overlap(on)}/{n_doc}; budget {ctx.chunk_budget} tokens"),
                Row("chunked-prefill", "total token throughput (tok/s)", "chunked off", t_off, "chunked on", t_on,
                    _ratio(t_on, t_off), "loss <= 10%", loss <= 0.10, f"throughput loss {loss:.1%}")]
    return Scenario("chunked-prefill", [Run("default", "chunked", run), Run("no-chunk", "no-chunk", run)], rows)


# ---------------------------------------------------------------- prefix caching
def prefix_caching(ctx) -> Scenario:
    specs = long_prefix_specs(ctx.n(48, 16), ctx.max_model_len, ctx.vocab_size, ctx.seed + 3)
    # --quick saves a server start: "off" is the default server with a distinct cache_salt
    # per request, so no lookup can hit (the cache still stores, which costs ~nothing).
    salted = [dataclasses.replace(s, cache_salt=s.request_id) for s in specs]

    def run(server):  # two at a time: TTFT measures prefill, not a queue
        return ctx.bench(server, specs, label="prefix-caching", max_concurrency=2)

    def run_off_by_salt(server):
        return ctx.bench(server, salted, label="prefix-caching-salted", max_concurrency=2)

    def rows(_, res):
        on, off = res["prefix-on"], res["prefix-off"]
        hit = on.server.get("prefix_cache_hit_rate", 0.0)
        base = "unique cache_salt" if ctx.quick else "prefix caching off"
        return [_pair_row("prefix-caching", "mean TTFT (ms)", base, off.metrics["mean_ttft_ms"],
                          "prefix caching on", on.metrics["mean_ttft_ms"], 2.0, higher=False),
                Row("prefix-caching", "prefix-cache hit rate (tokens)", "off", 0.0, "on", hit, None,
                    ">= 0.5", hit >= 0.5)]
    off = Run("default", "prefix-off", run_off_by_salt) if ctx.quick else Run("no-prefix", "prefix-off", run)
    return Scenario("prefix-caching", [Run("default", "prefix-on", run), off], rows)


# ---------------------------------------------------------------- mixed at saturation
def mixed_saturation(ctx) -> Scenario:
    specs = generate_workload("mixed", ctx.n(96, 24), max_model_len=ctx.max_model_len,
                              vocab_size=ctx.vocab_size, seed=ctx.seed + 4)

    def run(server):
        return ctx.bench(server, specs, label="mixed-saturation", drain_timeout=60.0)

    def rows(_, res):
        r = res["mixed"]
        m, s = r.metrics, r.server
        want_cancel = sum(x.cancel_after is not None for x in specs)
        accounted = m["completed"] + m["cancelled"] + m["failed"]
        leaked = s.get("leaked_blocks")
        return [Row("mixed-saturation", "leaked KV blocks after drain", "-", 0, "pagedserve",
                    float("nan") if leaked is None else leaked, None, "== 0", leaked == 0,
                    f"end kv usage {s.get('end_kv_cache_usage_perc', float('nan')):.3f}"),
                Row("mixed-saturation", "requests accounted (done+cancelled+failed / sent)", "sent", len(specs),
                    "accounted", accounted, None, "all; 0 failed",
                    accounted == len(specs) and m["failed"] == 0 and m["cancelled"] == want_cancel,
                    f"{m['completed']} done, {m['cancelled']}/{want_cancel} cancelled, {m['failed']} failed")]
    return Scenario("mixed-saturation", [Run("default", "mixed", run)], rows)


# ---------------------------------------------------------------- request-rate sweep
def rate_sweep(ctx) -> Scenario:
    """Measure capacity at rate inf, then offer fractions of it; the knee is the last
    rate the server keeps up with (loadtest.harness.report.find_knee)."""
    specs = generate_workload("chat", ctx.n(48, 12), max_model_len=ctx.max_model_len,
                              vocab_size=ctx.vocab_size, seed=ctx.seed + 5)
    fractions = (0.25, 0.5, 0.75, 1.0, 1.5) if not ctx.quick else (0.5, 1.0)

    def run(server):
        cap = ctx.bench(server, specs, label="sweep-inf")
        capacity = cap.metrics["request_throughput"]
        points = []
        for f in fractions:
            rate = round(f * capacity, 3)
            points.append((rate, ctx.bench(server, specs, label=f"sweep-{rate:g}", request_rate=rate).metrics))
        points.append((float("inf"), cap.metrics))
        return {"capacity": capacity, "points": points}

    def rows(_, res):
        from pagedserve.loadtest.harness.report import find_knee
        sw = res["sweep"]
        ctx.sweeps["pagedserve"] = sw["points"]
        knee = find_knee(sw["points"])
        best = max(m["output_throughput"] for _, m in sw["points"])
        return [Row("rate-sweep", "knee request rate (req/s)", "capacity at rate inf", sw["capacity"],
                    "knee", float("nan") if knee is None else knee, None, "reported", None,
                    f"peak output throughput {best:.1f} tok/s; see rate_sweep.png")]
    return Scenario("rate-sweep", [Run("default", "sweep", run)], rows)
