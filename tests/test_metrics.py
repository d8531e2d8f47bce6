"""The metrics plumbing without Ray: replica snapshots summed by the aggregator (counters
never go backwards when a replica leaves), rendered under vLLM's names."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.cluster.serve.metrics import ServeMetrics, StatsAggregator, stats_snapshot
from pagedserve.cluster.engine.outputs import RequestMetrics
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
