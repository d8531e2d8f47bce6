"""The metrics plumbing without Ray: replica snapshots summed by the aggregator (counters
never go backwards when a replica leaves), rendered under vLLM's names."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.cluster.front.metrics import ServeMetrics, StatsAggregator
from pagedserve.cluster.wire.stats import stats_snapshot
from pagedserve.cluster.wire.outputs import RequestMetrics
from pagedserve.scheduler.stats import SchedulerStats


def _snap(running, waiting, usage, blocks, gen, **kw):
    return stats_snapshot(SchedulerStats(running=running, waiting=waiting, kv_cache_usage=usage,
                                         num_blocks=blocks, num_free_blocks=blocks,
                                         num_generation_tokens=gen, **kw))


def test_aggregator_sums_replicas_and_keeps_counters_of_departed_ones():
    agg = StatsAggregator(stale_after_s=5.0)
    agg.report("a", _snap(2, 1, 0.5, 100, 40, waiting_by_reason={"max_seqs": 1}), now=0.0)
    agg.report("b", _snap(1, 0, 0.25, 300, 10), now=0.0)
    m = agg.merged(now=1.0)
    assert (m["running"], m["waiting"], m["num_replicas"]) == (3, 1, 2)
    assert m["num_used_blocks"] == 50 + 75
    assert m["kv_cache_usage"] == 125 / 400  # pool-weighted, not the mean of 0.5 and 0.25
    assert m["num_generation_tokens"] == 50 and m["waiting_by_reason"] == {"max_seqs": 1}
    agg.remove("b")  # downscaled: its gauges go, its counters stay
    m = agg.merged(now=2.0)
    assert (m["running"], m["num_replicas"], m["num_generation_tokens"]) == (2, 1, 50)
    # "a" stops reporting: dropped after stale_after_s, counters still kept.
    m = agg.merged(now=10.0)
    assert (m["running"], m["num_replicas"], m["num_generation_tokens"], m["kv_cache_usage"]) == (0, 0, 50, 0.0)


def test_render_uses_vllm_names_with_prefix():
    agg = StatsAggregator()
    agg.report("a", _snap(1, 2, 0.5, 64, 7, num_preemptions=3, prefix_cache_queries=20,
                          prefix_cache_hits=16, num_prompt_tokens=20,
                          waiting_by_reason={"no_blocks": 2}))
    sm = ServeMetrics("demo")
    sm.observe_finished(RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5,
                                       first_token_time=11.0, last_token_time=13.0,
                                       finished_time=13.0), num_output_tokens=5)
    text = sm.render(agg.merged()).decode()
    values = {(s.name, s.labels.get("reason")): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    v = lambda name, reason=None: values[("pagedserve:" + name, reason)]  # noqa: E731
    assert v("num_requests_running") == 1 and v("num_requests_waiting") == 2
    assert v("num_requests_waiting_by_reason", "no_blocks") == 2
    assert v("kv_cache_usage_perc") == 0.5
    assert v("num_preemptions_total") == 3
    assert v("prefix_cache_queries_total") == 20 and v("prefix_cache_hits_total") == 16
    assert v("prompt_tokens_total") == 20 and v("generation_tokens_total") == 7
    assert v("time_to_first_token_seconds_sum") == 1.0
    assert v("time_per_output_token_seconds_sum") == 0.5  # (13 - 11) / (5 - 1)
    assert v("e2e_request_latency_seconds_sum") == 3.0
    assert v("request_queue_time_seconds_sum") == 0.5
    assert 'model_name="demo"' in text


def test_vllm_names_types_and_buckets_and_one_prefix_for_the_loadtest_scraper():
    from pagedserve.cluster.front.metrics import VLLM_ITL_BUCKETS
    from pagedserve.loadtest.harness.metrics import parse_prometheus

    agg = StatsAggregator()
    agg.report("a", _snap(1, 2, 0.5, 64, 7, num_preemptions=3, prefix_cache_queries=20,
                          prefix_cache_hits=16, num_prompt_tokens=20))
    sm = ServeMetrics("demo")
    sm.observe_finished(RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5,
                                       first_token_time=11.0, last_token_time=13.0,
                                       finished_time=13.0), num_output_tokens=5,
                        finish_reasons=["length", "stop"])
    sm.count_finished(["abort"])
    text = sm.render(agg.merged()).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    kinds = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
             "vllm:kv_cache_usage_perc": "gauge", "vllm:num_preemptions": "counter",
             "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
             "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
             "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
             "vllm:inter_token_latency_seconds": "histogram",
             "vllm:e2e_request_latency_seconds": "histogram",
             "vllm:request_queue_time_seconds": "histogram"}
    assert {n: fams[n].type for n in kinds} == kinds
    values = {(s.name, s.labels.get("finished_reason"), s.labels.get("le")): s.value
              for f in fams.values() for s in f.samples}
    assert values[("vllm:generation_tokens_total", None, None)] == 7
    assert values[("vllm:num_preemptions_total", None, None)] == 3
    assert [values[("vllm:request_success_total", r, None)] for r in ("stop", "length", "abort", "error")] \
        == [1, 1, 1, 0]
    # 4 gaps of 0.5 s (13 - 11 over 5 - 1), each its own observation, in vLLM's buckets.
    assert values[("vllm:inter_token_latency_seconds_count", None, None)] == 4
    assert values[("vllm:inter_token_latency_seconds_sum", None, None)] == 2.0
    assert values[("vllm:inter_token_latency_seconds_bucket", None, "0.4")] == 0
    assert values[("vllm:inter_token_latency_seconds_bucket", None, "0.5")] == 4
    les = [s.labels["le"] for s in fams["vllm:inter_token_latency_seconds"].samples if "le" in s.labels]
    assert les == [str(b) for b in VLLM_ITL_BUCKETS] + ["+Inf"]
    # Both prefixes carry the same numbers: the scraper reads one, not their sum.
    sample = parse_prometheus(text)
    assert sample.prefix == "pagedserve:" and sample.counters["generation_tokens"] == 7
    assert sample.gauges["num_requests_waiting"] == 2


def test_kv_sizing_gauges_say_what_a_token_costs_per_dtype():
    """The startup log's KV sizing reaches /metrics: bytes per token per rank, scales
    included, labelled with the cache format; and vLLM's cache_config_info."""
    kv = {"kv_cache_dtype": "int8", "kv_bytes_per_token_per_rank": 3960,
          "kv_scale_bytes_per_token_per_rank": 120, "num_blocks": 3971, "block_size": 16}
    text = ServeMetrics("demo", kv_sizing=kv).render(StatsAggregator().merged()).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("pagedserve:kv_cache_bytes_per_token",
                    (("kv_cache_dtype", "int8"), ("model_name", "demo")))] == 3960
    assert samples[("pagedserve:kv_cache_scale_bytes_per_token",
                    (("kv_cache_dtype", "int8"), ("model_name", "demo")))] == 120
    assert samples[("vllm:cache_config_info", (("block_size", "16"), ("cache_dtype", "int8"),
                                               ("model_name", "demo"), ("num_gpu_blocks", "3971")))] == 1
    plain = ServeMetrics("demo").render(StatsAggregator().merged()).decode()
    assert "kv_cache_bytes_per_token" not in plain and "requests_shed_at_ingress" in plain


def test_spec_decode_counters_under_vllm_names_summed_by_position():
    """Speculative decoding's counters (vLLM's spec_decode_* names, per position by a
    ``position`` label): summed over replicas, kept when one leaves, absent when off."""
    spec = dict(spec_num_drafts=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=25)
    agg = StatsAggregator()
    agg.report("a", _snap(1, 0, 0.1, 64, 7, spec_num_accepted_tokens_per_pos=[9, 7, 5, 4], **spec))
    agg.report("b", _snap(1, 0, 0.1, 64, 7, spec_num_accepted_tokens_per_pos=[1, 1, 0, 0], **spec))
    agg.remove("b")
    agg.report("c", _snap(0, 0, 0.0, 64, 0))  # a replica without speculation
    text = ServeMetrics("demo").render(agg.merged()).decode()
    values = {(s.name, s.labels.get("position")): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    assert values[("vllm:spec_decode_num_drafts_total", None)] == 20
    assert values[("vllm:spec_decode_num_draft_tokens_total", None)] == 80
    assert values[("vllm:spec_decode_num_accepted_tokens_total", None)] == 50
    assert [values[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(4)] == [10, 8, 5, 4]
    off = StatsAggregator()
    off.report("c", _snap(0, 0, 0.0, 64, 0))
    assert "spec_decode" not in ServeMetrics("demo").render(off.merged()).decode()


def test_queue_time_ends_when_the_request_is_scheduled_not_when_its_first_token_comes(tmp_path):
    """vllm:request_queue_time_seconds is the WAITING phase: arrival to the plan that first
    takes the request. A request queued behind a full batch waits; its prefill step is then
    part of its TTFT, not of its queue time."""
    from pagedserve.cluster.llm import LLM
    from pagedserve.scheduler.sampling_params import SamplingParams
    from pagedserve.worker.loading.random_models import make_test_model

    llm = LLM(model=make_test_model("llama-gqa2-hd64", tmp_path), dtype="float32", max_model_len=256,
              num_gpu_blocks_override=64, max_num_seqs=2)
    try:
        outs = llm.generate([[5 + i] * 120 for i in range(4)],
                            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    for out in outs:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time < m.first_token_time <= m.finished_time
    # Two slots: the last two waited for the first two to finish (8 decode steps at least).
    first, last = outs[0].metrics, outs[-1].metrics
    assert last.first_scheduled_time - last.arrival_time > first.first_scheduled_time - first.arrival_time
