"""loadtest/: arrivals, workloads, metrics, the /metrics scraper and the report (the
``compare --quick`` smoke run against real servers is in test_script_smokes.py)."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest

from pagedserve.loadtest.harness.arrivals import arrival_times, parse_rate
from pagedserve.loadtest.harness.client import RequestResult
from pagedserve.loadtest.harness.metrics import compute_metrics, parse_goodput, parse_prometheus, percentile, server_view
from pagedserve.loadtest.harness.report import find_knee, format_table, plot_latency_cdfs, plot_rate_sweep
from pagedserve.loadtest.workloads import FIRST_ID, WORKLOADS, generate_workload


# ------------------------------------------------------------------ arrivals
def test_gamma_arrivals_keep_the_rate_and_burstiness_sets_the_spread():
    for burst in (0.25, 1.0, 4.0):
        t = arrival_times(20000, request_rate=5.0, burstiness=burst, seed=1)
        gaps = np.diff([0.0] + t)
        assert all(b >= a for a, b in zip(t, t[1:]))
        assert gaps.mean() == pytest.approx(0.2, rel=0.03)  # mean gap is 1/rate whatever the shape
        # Gamma(k, theta): coefficient of variation 1/sqrt(k): Poisson 1, bursty > 1, regular < 1.
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burst), rel=0.05)
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(50, 3.0, seed=7) == arrival_times(50, 3.0, seed=7) != arrival_times(50, 3.0, seed=8)
    assert parse_rate("inf") == math.inf and parse_rate("2.5") == 2.5
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


# ------------------------------------------------------------------ workloads
@pytest.mark.parametrize("name", WORKLOADS)
def test_every_workload_fits_max_model_len_and_is_seeded(name):
    for max_len in (256, 2048):
        specs = generate_workload(name, 200, max_model_len=max_len, vocab_size=1000, seed=3)
        assert len(specs) == 200
        for s in specs:
            assert len(s.prompt) == s.prompt_len >= 1
            assert s.prompt_len + s.max_tokens <= max_len
            assert all(FIRST_ID <= t < 1000 for t in s.prompt)
        again = generate_workload(name, 200, max_model_len=max_len, vocab_size=1000, seed=3)
        assert [s.prompt for s in again] == [s.prompt for s in specs]


def test_workload_shapes_match_their_descriptions():
    chat = generate_workload("chat", 4000, max_model_len=2048, vocab_size=500, seed=0)
    assert statistics.fmean(s.prompt_len for s in chat) == pytest.approx(200, rel=0.1)
    assert statistics.fmean(s.max_tokens for s in chat) == pytest.approx(180, rel=0.1)
    short = generate_workload("short", 2000, max_model_len=2048, vocab_size=500, seed=0)
    assert statistics.fmean(s.prompt_len for s in short) == pytest.approx(20, rel=0.15)
    assert statistics.fmean(s.max_tokens for s in short) == pytest.approx(60, rel=0.15)
    # Lengths scale with the context: at 512 tokens chat prompts are a quarter as long.
    small = generate_workload("chat", 4000, max_model_len=512, vocab_size=500, seed=0)
    assert statistics.fmean(s.prompt_len for s in small) == pytest.approx(50, rel=0.15)
    docs = generate_workload("long-doc", 300, max_model_len=1000, vocab_size=500, seed=0)
    assert all(0.5 * 1000 - 32 <= s.prompt_len <= 1000 for s in docs)
    fixed = generate_workload("chat", 50, max_model_len=2048, vocab_size=500, seed=0, output_len=64)
    assert {s.max_tokens for s in fixed} == {64} and all(s.ignore_eos for s in fixed)
    text = generate_workload("short", 5, max_model_len=2048, vocab_size=500, seed=0, text=True)
    assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == s.prompt_len for s in text)


def test_shared_prefix_and_multi_turn_reuse_tokens():
    specs = generate_workload("shared-prefix", 400, max_model_len=2048, vocab_size=5000, seed=0)
    heads = [tuple(s.prompt[:64]) for s in specs]
    top4 = sorted((heads.count(h) for h in set(heads)), reverse=True)[:4]
    assert sum(top4) / len(specs) == pytest.approx(0.9, abs=0.05)  # ~90% share one of 4 prefixes
    turns = generate_workload("multi-turn", 60, max_model_len=2048, vocab_size=5000, seed=0)
    children = [s for s in turns if s.parent is not None]
    assert children
    for c in children:  # a follow-up carries its parent's prompt and a reply, then a new message
        p = turns[c.parent]
        assert c.prompt[:p.prompt_len] == p.prompt and c.prompt_len > p.prompt_len + p.max_tokens - 1


def test_mixed_has_forks_and_cancellations_never_on_a_parent():
    specs = generate_workload("mixed", 2000, max_model_len=1024, vocab_size=800, seed=0)
    kinds = {s.kind for s in specs}
    assert kinds == {"chat", "short", "long-doc", "shared-prefix", "multi-turn"}
    assert sum(s.n == 2 for s in specs) / len(specs) == pytest.approx(0.05, abs=0.02)
    cancelled = [s for s in specs if s.cancel_after is not None]
    assert len(cancelled) / len(specs) == pytest.approx(0.05, abs=0.02)
    parents = {s.parent for s in specs if s.parent is not None}
    assert not any(i in parents for i, s in enumerate(specs) if s.cancel_after is not None)
    assert all(1 <= s.cancel_after < s.max_tokens for s in cancelled)


def _digest(x) -> str:
    import dataclasses
    import hashlib

    if isinstance(x, list) and x and dataclasses.is_dataclass(x[0]):
        x = [dataclasses.astuple(s) for s in x]
    return hashlib.sha256(json.dumps(x).encode()).hexdigest()[:16]


def test_bench_workloads_keep_the_numbers_they_had_in_their_benches():
    """Each bench's workload moved into workloads.py unchanged: these digests are of the
    outputs of the functions the benches had (bench_offline, bench_scheduler, bench_kv_dtype,
    peers/, scenarios/, bench_routing) for the same arguments. A change here changes every
    figure measured on that workload: name a new workload instead."""
    from pagedserve.loadtest import workloads as w

    words = [f"w{i}" for i in range(500)]
    cases = {
        "offline_chat_pairs": (lambda: w.offline_chat_pairs(128, 1024, 8192, seed=0), "1ced51dc18ba3a0b"),
        "scheduler_chat_pairs": (lambda: w.scheduler_chat_pairs(600, 0, 1024), "761a851f2888fd2e"),
        "long_context_pairs": (lambda: w.long_context_pairs(50, 0), "5ca87a8cad5ad529"),
        "fixed_length_prompts": (lambda: w.fixed_length_prompts(32, 32, 8192, 0), "92e2747f58143b40"),
        "fixed_length_specs": (lambda: w.fixed_length_specs(128, 200, 128, 8192), "f1a8cad9b4352ad5"),
        "kv_pressure_specs": (lambda: w.kv_pressure_specs(48, 2048, 8192, 1), "a9f1b1df2d61494f"),
        "decode_and_doc_specs": (lambda: w.decode_and_doc_specs(8, 6, 128, 2048, 8192, 2), "a4ed5e67a6dcbcaa"),
        "long_prefix_specs": (lambda: w.long_prefix_specs(48, 2048, 8192, 3), "6c00db25fea2848c"),
        "short_stream_specs": (lambda: w.short_stream_specs(300, 8192, 20, "soak", 64, cancel_frac=0.10),
                               "ec1452a9f5c17191"),
        "tenant_stream_specs": (lambda: w.tenant_stream_specs(40, 8192, 41, "steady", 64), "1096406f6354620c"),
        "word_shared_prefix_prompts": (lambda: list(w.word_shared_prefix_prompts(words, 0, 64, 8, 512, 32)),
                                       "d5285ba596c72908"),
    }
    assert {name: _digest(make()) for name, (make, _) in cases.items()} == {n: d for n, (_, d) in cases.items()}
    pairs = w.offline_chat_pairs(500, 256, 300, seed=1)
    assert all(4 <= len(p) <= 128 and 2 <= o and len(p) + o <= 256 and min(p) >= 3 and max(p) < 300 for p, o in pairs)
    assert all(1 <= len(p) <= 2000 and 1 <= o <= 64 for p, o in w.scheduler_chat_pairs(500, 1, 64))


# ------------------------------------------------------------------ metrics
def _res(i, ttft, itl, out, start, n=1, ok=True, cancelled=False, prompt=10):
    lat = ttft + sum(itl)
    return RequestResult(f"r{i}", success=ok, cancelled=cancelled, prompt_len=prompt, output_len=out, n=n,
                         ttft=ttft, itl=list(itl), latency=lat, start_time=start, end_time=start + lat)


def test_metrics_have_vllm_names_and_exact_values():
    results = [_res(0, 0.1, [0.02, 0.02, 0.02], 4, 0.0),  # tpot = 0.06 / 3 = 20 ms
               _res(1, 0.3, [0.05, 0.05], 3, 0.05),  # tpot = 50 ms
               _res(2, 0.2, [0.01], 0, 0.1, ok=False, cancelled=True),
               _res(3, 0.0, [], 0, 0.2, ok=False)]
    m = compute_metrics(results, duration=2.0, goodput_slos=parse_goodput(["ttft:200", "tpot:30"]))
    assert (m["completed"], m["cancelled"], m["failed"]) == (2, 1, 1)
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 7
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.5
    assert m["total_token_throughput"] == 13.5
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(35.0)
    assert m["mean_itl_ms"] == pytest.approx((3 * 20 + 2 * 50) / 5)
    assert m["p99_e2el_ms"] == pytest.approx(percentile([160.0, 400.0], 99))
    assert m["request_goodput"] == 0.5  # only r0 meets ttft <= 200 ms and tpot <= 30 ms
    assert m["max_concurrent_requests"] == 3  # r0, r1, r2 overlap on [0.10, 0.16) s
    data = np.random.default_rng(0).exponential(size=999).tolist()
    for p in (50, 90, 99):
        assert percentile(data, p) == pytest.approx(float(np.percentile(data, p)))
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def test_a_cut_counts_tokens_when_the_server_batches_deltas():
    """A loaded server sends several tokens per chunk; a cancellation at half of max_tokens
    must still happen (counted in chunks it never would: 12 tokens arrive in 4 chunks)."""
    import asyncio

    import httpx

    from pagedserve.loadtest.harness.client import send_completion
    from pagedserve.loadtest.workloads import RequestSpec

    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        chunks = [{"choices": [{"index": 0, "text": "abc", "token_ids": [i, i + 1, i + 2]}]} for i in range(0, 12, 3)]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def go(spec):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_completion(client, "http://server", spec, "m")

    cut = asyncio.run(go(RequestSpec("c", [5, 6], 2, 12, cancel_after=6)))
    assert sent[-1]["return_token_ids"] is True
    assert cut.cancelled and not cut.success and cut.output_len == 6
    whole = asyncio.run(go(RequestSpec("w", [5, 6], 2, 12)))
    assert "return_token_ids" not in sent[-1] and whole.success and whole.output_len == 12


def test_scraper_reads_pagedserve_exposition_and_vllm_names():
    from pagedserve.cluster.front.metrics import ServeMetrics, StatsAggregator

    def snap(running, waiting, free, queries, hits, preempt):
        return {"running": running, "waiting": waiting, "num_free_blocks": free, "num_blocks": 100,
                "num_used_blocks": 100 - free, "num_preemptions": preempt, "prefix_cache_queries": queries,
                "prefix_cache_hits": hits, "num_prompt_tokens": queries, "num_generation_tokens": 7,
                "kv_cache_usage": (100 - free) / 100, "waiting_by_reason": {"capacity": waiting}}

    sm, agg = ServeMetrics("m"), StatsAggregator()
    agg.report("a", snap(0, 0, 100, 100, 10, 0))
    before = parse_prometheus(sm.render(agg.merged()).decode())
    agg.report("a", snap(5, 2, 60, 300, 110, 3))
    during = parse_prometheus(sm.render(agg.merged()).decode())
    agg.report("a", snap(0, 0, 100, 300, 110, 3))
    after = parse_prometheus(sm.render(agg.merged()).decode())
    assert during.prefix == "pagedserve:"
    assert during.gauges["kv_cache_usage_perc"] == pytest.approx(0.4)
    # Every known reason is exported (0 when none waits for it), the snapshot's own too.
    from pagedserve.scheduler.stats import WAITING_REASONS
    assert during.waiting_by_reason == {**dict.fromkeys(WAITING_REASONS, 0.0), "capacity": 2.0}
    v = server_view(before, [before, during, after], after)
    assert v["peak_kv_cache_usage_perc"] == pytest.approx(0.4) and v["peak_num_requests_running"] == 5
    assert v["num_preemptions"] == 3 and v["prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert v["leaked_blocks"] == 0 and v["peak_waiting_by_reason"] == {**dict.fromkeys(WAITING_REASONS, 0.0), "capacity": 2.0}
    vllm_text = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="x"} 3\n'
                 '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="x"} 0.25\n'
                 '# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{engine="0",model_name="x"} 64\n')
    s = parse_prometheus(vllm_text)
    assert s.prefix == "vllm:" and s.gauges["num_requests_running"] == 3 and s.counters["prefix_cache_hits"] == 64


# ------------------------------------------------------------------ report
def test_knee_table_and_plots(tmp_path):
    def pt(thr, ttft):
        return {"request_throughput": thr, "mean_ttft_ms": ttft, "output_throughput": thr * 100, "p99_tpot_ms": ttft / 10}
    sweep = [(1.0, pt(0.98, 50)), (2.0, pt(1.95, 60)), (4.0, pt(3.0, 900)), (8.0, pt(3.1, 4000)),
             (math.inf, pt(3.1, 9000))]
    assert find_knee(sweep) == 2.0  # at 4 req/s it serves 3: the queue grows from there
    assert find_knee([(1.0, pt(0.5, 50))]) is None
    results = [_res(0, 0.1, [0.02, 0.02], 3, 0.0), _res(1, 0.2, [0.03], 2, 0.0)]
    m = compute_metrics(results, 1.0)
    table = format_table("demo", m, {"peak_kv_cache_usage_perc": 0.5, "leaked_blocks": 0})
    assert "Successful requests:" in table and "P99 ITL (ms):" in table and "leaked_blocks:" in table
    cdf = plot_latency_cdfs({"a": {"ttft": [0.1, 0.2], "itl": [0.01]}}, tmp_path / "cdf.png")
    sw = plot_rate_sweep({"pagedserve": sweep}, tmp_path / "sweep.png")
    for p in (cdf, sw):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help_lists_every_benchmark_with_one_line(capsys):
    import ast
    from pathlib import Path

    from pagedserve.loadtest.__main__ import BENCHMARKS, main

    root = Path(__file__).resolve().parent.parent
    # every module with a top-level ``if __name__ == "__main__":``, in whichever sub-package
    # (parsed: a script held in a string, as peers/vllm_cpu.py has, is not one)
    def runs_as_main(path: Path) -> bool:
        return any(isinstance(node, ast.If) and "__name__" in ast.unparse(node.test)
                   for node in ast.parse(path.read_text()).body)

    on_disk = {".".join(p.relative_to(root).with_suffix("").parts) for p in (root / "loadtest").rglob("*.py")
               if p.name != "__main__.py" and runs_as_main(p)}
    assert "loadtest.offline.bench_scheduler" in on_disk and "loadtest.gpu_check" in on_disk
    assert on_disk == set(BENCHMARKS), on_disk ^ set(BENCHMARKS)
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for mod in BENCHMARKS:
        line = next(line for line in out.splitlines() if line.strip().startswith(mod + " "))
        assert len(line.split(maxsplit=1)[1]) > 20, line  # a real description, one line


def test_bench_routing_reports_medians_over_repeats():
    from pagedserve.loadtest.serving.bench_routing import median_of

    runs = [dict(ttft_mean_s=t, output_tok_s=o, hit_rate=h, failed=0, replica_shares=s, routed_by={"prefix": 1.0})
            for t, o, h, s in ((1.0, 30.0, 0.7, [3, 1]), (3.0, 10.0, 0.9, [2, 2]), (2.0, 20.0, 0.8, [1, 3]))]
    m = median_of(runs)
    assert (m["ttft_mean_s"], m["output_tok_s"], m["hit_rate"], m["failed"]) == (2.0, 20.0, 0.8, 0)
    assert m["replica_shares"] == [3, 1] and m["routed_by"] == {"prefix": 1.0}  # not numbers: the first run's
    assert [r["ttft_mean_s"] for r in m["runs"]] == [1.0, 3.0, 2.0]
    assert median_of(runs[:1]) is runs[0]


def test_bench_routing_shape_goals_are_issue_56s():
    """kv within 5% of the better peer (mean and p99) on every shape; on a prefix-heavy one
    also 1.5x lower mean TTFT than pow2 and 1.1x lower than prefix; tok/s >= 0.95x pow2."""
    from pagedserve.loadtest.serving.bench_routing import SHAPES, shape_goals

    def row(kv, prefix, pow2):  # (mean, p99, tok/s) each
        return {k: dict(ttft_mean_s=m, ttft_p99_s=p, output_tok_s=t, failed=0)
                for k, (m, p, t) in (("kv", kv), ("prefix", prefix), ("pow2", pow2))}

    g = shape_goals(row((1.0, 2.0, 50), (1.2, 2.5, 45), (1.6, 2.2, 50)), prefix_heavy=True)
    assert all(g.values()) and set(g) == {"mean within 5%", "p99 within 5%", "1.5x pow2", "1.1x prefix",
                                          "tok/s 0.95x pow2"}
    g = shape_goals(row((1.0, 2.4, 50), (1.2, 2.5, 45), (1.4, 2.2, 50)), prefix_heavy=True)
    assert not g["1.5x pow2"] and not g["p99 within 5%"] and g["1.1x prefix"] and g["mean within 5%"]
    g = shape_goals(row((1.04, 2.0, 47), (1.2, 2.5, 45), (1.0, 2.2, 50)), prefix_heavy=False)
    assert g == {"mean within 5%": True, "p99 within 5%": True, "tok/s 0.95x pow2": False}
    bad = row((1.0, 2.0, 50), (1.2, 2.5, 45), (1.6, 2.2, 50))
    bad["kv"]["failed"] = 1
    assert shape_goals(bad, prefix_heavy=False) == {"no failures": False}
    assert {n for n, s in SHAPES.items() if s.prefix_heavy} == {"prefix", "mid_prefix", "long_prefix", "zipf"}


def test_zipf_prefixes_are_hot_at_the_head():
    from pagedserve.loadtest.workloads import word_shared_prefix_prompts

    words = [f"w{i}" for i in range(200)]
    prompts, picks = word_shared_prefix_prompts(words, 0, 2000, 32, 8, 2, zipf_s=1.0)
    assert picks.count(0) > 5 * picks.count(31) and picks.count(0) > 2000 / 32 * 3
    assert all(p.startswith(" ".join(prompts[0].split()[:8])) for p, k in zip(prompts, picks) if k == picks[0])
    _, uniform = word_shared_prefix_prompts(words, 0, 2000, 32, 8, 2)
    assert max(uniform.count(i) for i in range(32)) < 2000 / 32 * 2


def test_bench_router_decision_runs_small_and_reports_both_parts(capsys):
    """The router bench (serving/bench_router_decision.py), cut small: a decision's cost at
    2 and 8 replicas, and the simulation at 2 replicas on both session shapes, kv against
    pow2 from the same flags' rates; the last line is its JSON."""
    from pagedserve.loadtest.serving.bench_router_decision import main

    assert main(["--replicas", "2", "8", "--blocks", "256", "--seconds", "0.05", "--sim-replicas", "2",
                 "--shapes", "few_sessions", "many_sessions", "--routers", "kv", "pow2", "--seeds", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["cpu"] and set(out["decision"]) == {"2", "8"}
    assert all(d["us"] > 0 and d["poll_us"] > 0 and d["prompt_blocks"] == 64 for d in out["decision"].values())
    assert out["rates"]["measured"] is False
    for shape in ("few_sessions", "many_sessions"):
        row = out["simulation"][shape]["2"]
        for r in ("kv", "pow2"):
            assert row[r]["requests"] > 0 and 0 < row[r]["ttft_mean_s"] <= row[r]["ttft_p99_s"]
            assert 0 <= row[r]["hit_rate"] <= 1 and 0.5 <= row[r]["max_replica_share"] <= 1
