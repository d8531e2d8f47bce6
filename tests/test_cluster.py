"""The cluster, tested as a cluster (several Ray nodes on this machine): placement, node
loss under load (a steady one, and a storm of short streams), scale-down and a rolling
update, each against real Ray nodes.

One run of ``python -m pagedserve.loadtest.multinode.cluster_check`` in a subprocess: it builds its
own multi-node clusters (cluster/ray_utils.py LocalCluster; the suite's session Ray is not
touched), joins them with ``pagedserve serve --ray-address`` or a ``serve deploy`` apply,
drives them with httpx and prints one JSON line of figures per phase. The tests below
assert on those figures. It takes minutes (BENCHMARKS.md): marked ``cluster``, it is
left out of the default run (``./dev test``, CI) and runs with ``./dev test -m cluster``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    out = tmp_path_factory.mktemp("cluster-check")
    proc = subprocess.run([sys.executable, "-m", "pagedserve.loadtest.multinode.cluster_check",
                           "--result-dir", str(out)],
                          cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=1140)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert last.startswith('{"phases"'), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(last)["phases"]
    for name, figures in result.items():
        assert "error" not in figures, (name, figures["error"], proc.stdout[-3000:])
    return result


def test_replicas_spread_one_per_node_and_the_front_stays_on_the_head(phases):
    p = phases["spread"]
    assert p["replica_nodes"] == ["127.0.0.2", "127.0.0.3"]  # one engine replica per worker node
    assert p["front_node"] == "127.0.0.1"  # the HTTP front beside Serve's proxy on the head
    assert p["replicas_answering"] == 2
    assert p["ok"]


def test_a_tp_group_is_packed_on_one_node_refused_when_none_fits_and_spans_nodes_only_when_asked(phases):
    p = phases["tp"]
    # TP=2: each replica's group (replica + 2 workers) whole on one node, the 2 groups on 2 nodes.
    assert len(p["groups"]) == 2
    for g in p["groups"]:
        assert g["strategy"] == "STRICT_PACK" and len(set(g["bundle_nodes"])) == 1
    assert {g["bundle_nodes"][0] for g in p["groups"]} == {"127.0.0.2", "127.0.0.3"}
    # TP=4 on 4-CPU nodes: refused at once, with the group's size and the largest node.
    assert p["refused"], p.get("refusal")
    assert "needs CPU 5 on one node" in p["refusal"] and "largest of the 3 live nodes has CPU 4" in p["refusal"]
    assert p["refused_in_s"] < 60
    # Asked for (PACK): the group spans both nodes, and answers as TP=2 does (greedy).
    assert set(p["pack_bundle_nodes"]) == {"127.0.0.2", "127.0.0.3"}
    assert p["tp4_text_equals_tp2"]
    assert p["ok"]


def test_node_loss_fails_or_retries_its_requests_at_once_and_serve_replaces_the_group(phases):
    p = phases["node_kill"]
    assert p["on_lost_replica"] > 0
    # Streams that had sent tokens end in-band, naming the lost replica, within 2 s.
    assert p["in_band_errors"] > 0 and p["in_band_errors_named"] == p["in_band_errors"]
    assert p["in_band_error_after_kill_s"] <= 2.0
    # Requests that had sent the client nothing are tried again elsewhere and succeed.
    assert p["retried_whole_ok"] + p["retried_streams_ok"] > 0 and p["failed_before_any_token"] == 0
    # The other replica's requests never notice; later requests go to live replicas at once.
    assert p["other_replica_failed"] == 0
    assert p["after_kill"] > 0 and p["after_kill_failed"] == 0
    assert p["ttft_after_p90_s"] <= max(1.0, 3 * p["ttft_before_p50_s"]) and p["ttft_after_max_s"] < 5.0
    # Serve starts the whole TP group again elsewhere; /health said 200 throughout.
    assert p["replaced_in_s"] is not None and p["replaced_in_s"] <= 60
    assert p["health_checks"] > 10 and p["health_non_200"] == 0
    # Nothing left behind: the lost group is gone, two groups of 2 workers each remain.
    assert p["groups_left_behind"] == 0 and p["old_groups_gone"] == 1
    assert p["groups_alive"] == 2 and p["workers_alive"] == 4
    assert p["ok"]


def test_a_node_lost_under_a_storm_of_short_streams_fails_no_request_that_had_no_token(phases):
    p = phases["node_kill_storm"]
    # At least 1,000 requests around the kill, some streaming on the lost replica when its
    # node's processes were killed, and the front saw it go.
    assert p["requests_around_kill"] >= 1000 and p["sent_before_kill"] > 0 and p["sent_after_kill"] > 0
    assert p["on_lost_replica_at_kill"] > 0 and p["workers_killed"] > 0
    assert p["loss_seen_after_s"] is not None and p["front_replicas_lost"] == 1
    # None of those that had received no token failed: each was admitted elsewhere.
    assert p["failed_without_token"] == 0, p["failed_without_token_errors"]
    # Only streams that had shown tokens ended in-band, each on the lost replica, naming it.
    assert p["in_band_named"] == p["in_band_after_tokens"] == p["in_band_on_lost_replica"]
    assert p["answered_after_kill"] > 0
    assert p["ok"]


def test_scale_down_under_load_loses_no_request(phases):
    p = phases["scale_cycle"]
    assert p["peak_replicas"] == 2 and p["final_replicas"] == 1 and p["replicas_answering"] == 2
    assert p["requests_during_scale_down"] > 0
    assert p["failed_requests"] == 0, p["failures"]
    assert p["ok"]


def test_rolling_update_under_load_loses_no_request(phases):
    p = phases["rolling_update"]
    assert p["updated"] and p["replicas_answering"] >= 3  # old and new replicas both answered
    assert p["failed_requests"] == 0, p["failures"]
    assert p["ok"]
