"""The cluster, checked as a cluster: several Ray nodes on this machine, placement, node loss, scale-down, updates.

    python -m pagedserve.loadtest.multinode.cluster_check                    # every phase
    python -m pagedserve.loadtest.multinode.cluster_check --phases node_kill  # a subset

Builds a multi-node Ray cluster on one machine (cluster/ray_utils.py LocalCluster: a head
with no CPUs and worker nodes of 4 CPUs at 127.0.0.2, 127.0.0.3, ...), then for each
phase joins it as a ``ray up`` user would (``pagedserve serve --ray-address``, or the
declarative ``serve deploy`` apply) and drives it over HTTP with httpx:

    spread          2 engine replicas (TP=1) land on 2 different nodes; the front on the head
    tp              TP=2: each replica's group (replica + 2 workers) on one node, 2 nodes;
                    TP=4 on 4-CPU nodes is refused at once with the group's size and the
                    largest node; with --placement-group-strategy PACK it spans nodes and
                    answers as TP=1 does
    node_kill       2 replicas (TP=2) under a streaming load; the node of one is killed (all
                    its processes at once, as a machine that dies): its streams end within
                    2 s (in-band error) or are retried (no token yet), the other replica's
                    streams never notice, new requests get their usual TTFT, Serve replaces
                    the group within 60 s, /health says 200 throughout (a live replica
                    answers), no placement group or actor is left behind
    node_kill_storm 2 replicas (TP=1) on 2 worker nodes, 16 clients of short streams (a
                    closed loop each, 550 requests sent before the kill and 550 after); every
                    process of one replica's node is killed while it streams: no request that
                    had received no token fails (retried elsewhere); only streams that had
                    shown tokens may end in-band, naming the lost replica
    scale_cycle     autoscaling 1 -> 2 -> 1 under load: 0 failed requests
    rolling_update  ``serve deploy`` of a changed max_num_seqs under load: 0 failed requests

Each phase prints its figures and ``ok``; the last line is JSON: ``{"phases": {...}}``.
BENCHMARKS.md has the figures of a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

from pagedserve.cluster.ray_utils import LocalCluster, cluster_view, delete_app, deploy_config, shutdown_ray
from pagedserve.loadtest.harness.servers import free_port, pagedserve_server
from pagedserve.loadtest.harness.client import RequestResult
from pagedserve.loadtest.multinode.load import Load, failures, median, quantile

PHASES = ("spread", "tp", "node_kill", "node_kill_storm", "scale_cycle", "rolling_update")
ENGINE = "EngineDeployment"
# The replica's own ongoing-request limit and the shedding are off: these phases count
# failures, and an overloaded 2-core box must queue, not refuse.
SERVE_ARGS = dict(max_model_len=512, max_num_seqs=8, max_waiting_requests=256, max_queue_delay_s=0,
                  dtype="float32", kv_cache_memory="64MiB", num_threads=1)


def engine_replicas(view: dict) -> list[dict]:
    return [a for a in view["actors"] if a["state"] == "ALIVE" and f"{ENGINE}" in a["name"]]


class Ctx:
    def __init__(self, args) -> None:
        self.args = args
        self.port = args.port or free_port()  # one port: Serve's proxy keeps the first it was given
        self.base = f"http://127.0.0.1:{self.port}"
        self.out_dir = Path(args.result_dir or "/tmp/cluster-check")
        self.logs = self.out_dir / "logs"
        self.cluster: LocalCluster | None = None

    def new_cluster(self, workers: int) -> LocalCluster:
        """A fresh cluster per phase: a phase that kills a node leaves the next one intact."""
        if self.cluster is not None:
            self.close_cluster()
        t0 = time.monotonic()
        self.cluster = LocalCluster(workers=workers, cpus_per_worker=self.args.cpus_per_node)
        print(f"  cluster: head + {workers} worker nodes of {self.args.cpus_per_node} CPUs "
              f"({time.monotonic() - t0:.1f} s) at {self.cluster.address}", flush=True)
        return self.cluster

    def close_cluster(self) -> None:
        shutdown_ray()  # this driver's connection (cluster_view joined it)
        self.cluster.shutdown()
        self.cluster = None

    def server(self, **kw):
        args = {**SERVE_ARGS, "served_model_name": "model", **kw}
        return pagedserve_server(self.args.model, log_dir=self.logs, port=self.port,
                                 ray_address=self.cluster.address, **args)

    def view(self) -> dict:
        return cluster_view(self.cluster.address)


def _replica_nodes(view: dict) -> list[str]:
    return sorted(a["node"] for a in engine_replicas(view))


def _front_node(view: dict) -> str:
    return next((a["node"] for a in view["actors"] if a["state"] == "ALIVE" and "OpenAIIngress" in a["name"]), "?")


def _wait_deployed(srv, timeout: float = 300.0) -> None:
    """Until ``pagedserve serve`` logs "ready in" (serve.run returned: every deployment's
    min_replicas running). /health answers 200 once one replica does, and a node lost while
    the app is still deploying fails the deploy itself, which is not what a phase tests."""
    deadline = time.monotonic() + timeout
    while "ready in " not in srv.log_path.read_text(errors="replace"):
        if srv.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the app did not finish deploying:\n{srv.tail()}")
        time.sleep(0.5)


def _complete(base: str, prompt: str, max_tokens: int = 12) -> str:
    r = httpx.post(f"{base}/v1/completions", json={"model": "model", "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0}, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


# ---------------------------------------------------------------------------- phases
def phase_spread(ctx: Ctx) -> dict:
    ctx.new_cluster(2)
    with ctx.server(min_replicas=2) as srv:
        view = ctx.view()
        nodes = _replica_nodes(view)
        # Pairs sent together: two idle replicas tie, and one request at a time may go to
        # either by chance; the second of a pair must go where the first is not.
        def replica_of(i: int) -> str | None:
            return httpx.post(f"{srv.base_url}/v1/completions", timeout=60, json={
                "model": "model", "prompt": f"p{i}", "max_tokens": 8}).headers.get("x-pagedserve-replica")

        with ThreadPoolExecutor(2) as pool:
            replicas_seen = set(pool.map(replica_of, range(8)))
    ok = len(nodes) == 2 and len(set(nodes)) == 2 and _front_node(view) == "127.0.0.1"
    return dict(ok=ok, replica_nodes=nodes, front_node=_front_node(view), replicas_answering=len(replicas_seen),
                startup_s=round(srv.startup_s, 1))


def phase_tp(ctx: Ctx) -> dict:
    ctx.new_cluster(2)
    out: dict = {}
    with ctx.server(min_replicas=2, tensor_parallel_size=2) as srv:
        view = ctx.view()
        groups = [g for g in view["placement_groups"] if g["state"] == "CREATED"]
        out["groups"] = [dict(strategy=g["strategy"], bundle_nodes=g["bundle_nodes"]) for g in groups]
        packed = len(groups) == 2 and all(len(set(g["bundle_nodes"])) == 1 for g in groups)
        two_nodes = len({g["bundle_nodes"][0] for g in groups}) == 2
        text_tp2 = _complete(srv.base_url, "the cluster")
    # A group that fits no node: refused with the numbers, at once, not a pending replica.
    t0 = time.monotonic()
    refused = ctx.server(tensor_parallel_size=4)
    try:
        refused.start(timeout=120)
        refused.stop()
        out["refused"] = False
    except RuntimeError as e:  # exited during start-up: the message is in its log
        msg = next((line for line in str(e).splitlines() if "largest" in line), str(e)[-300:])
        out["refused"] = "needs CPU 5 on one node" in msg and "has CPU 4" in msg
        out["refusal"] = msg.split("pagedserve: ", 1)[-1][:300]
    out["refused_in_s"] = round(time.monotonic() - t0, 1)
    # Asked for: TP=4 across the two nodes (the rendezvous on rank 0's node address).
    with ctx.server(tensor_parallel_size=4, placement_group_strategy="PACK") as srv:
        groups = [g for g in ctx.view()["placement_groups"] if g["state"] == "CREATED"]
        out["pack_bundle_nodes"] = groups[0]["bundle_nodes"] if groups else []
        text_tp4 = _complete(srv.base_url, "the cluster")
    out["tp4_across_nodes"] = len(set(out["pack_bundle_nodes"])) == 2
    out["tp4_text_equals_tp2"] = text_tp4 == text_tp2
    out["ok"] = bool(packed and two_nodes and out["refused"] and out["tp4_across_nodes"] and out["tp4_text_equals_tp2"])
    return out


async def _health_watch(base: str, stop: asyncio.Event, codes: list) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                codes.append((t, (await client.get(f"{base}/health")).status_code))
            except httpx.HTTPError as e:
                codes.append((t, type(e).__name__))
            await asyncio.sleep(0.5)


def _kill_node_at_once(cluster: LocalCluster, ip: str) -> int:
    """Every process of node ``ip`` at once, as a machine that dies; returns how many of its
    workers were killed. LocalCluster.kill stops the raylet and its agents; the workers it
    started (the engine replica) follow only once they notice, and until then they serve:
    the requests in flight would have drained."""
    raylet = cluster.nodes[ip].all_processes["raylet"][0].process.pid
    killed = 0
    for proc in psutil.Process(raylet).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
            killed += 1
    cluster.kill(ip)
    return killed


def phase_node_kill(ctx: Ctx) -> dict:
    cluster = ctx.new_cluster(3)
    # Streams and whole-response requests: the lost node holds streams that sent tokens
    # and requests that have sent the client nothing.
    # max_num_seqs 32: one replica holds the whole load after the loss, so the TTFT after it
    # shows the routing, not a queue of half the capacity.
    with ctx.server(min_replicas=2, tensor_parallel_size=2, max_num_seqs=32) as srv:
        _wait_deployed(srv)
        view = ctx.view()
        groups_before = [g["id"] for g in view["placement_groups"] if g["state"] == "CREATED"]
        res = asyncio.run(_kill_under_load(ctx, srv.base_url, cluster))
        view = ctx.view()
    # What the lost node's requests got: those in flight at the kill, by replica.
    kill_t, victim_replicas, victim_node = res.pop("kill_t"), res.pop("victim_replicas"), res.pop("victim_node")
    results: list[RequestResult] = res.pop("results")
    inflight = [r for r in results if r.start_time < kill_t < r.end_time]
    on_victim = [r for r in inflight if r.replica in victim_replicas]
    elsewhere = [r for r in inflight if r.replica not in victim_replicas]
    # Failed: only streams that had sent tokens may (in-band). A retried request keeps the
    # header of its first replica (the lost one) and succeeds.
    in_band = [r for r in on_victim if not r.success and r.kind != "whole" and r.first_token_time < kill_t
               and r.first_token_time > 0]
    failed_unstarted = [r for r in on_victim if not r.success and r not in in_band]
    retried_streams = [r for r in on_victim if r.success and r.kind != "whole"]
    retried_whole = [r for r in on_victim if r.success and r.kind == "whole"]
    streams = [r for r in results if r.kind != "whole"]
    after = [r for r in streams if r.start_time > kill_t + 0.5 and r.success]
    before = [r for r in streams if 0 < r.first_token_time < kill_t]
    out = dict(
        victim_node=victim_node, inflight_at_kill=len(inflight), on_lost_replica=len(on_victim),
        in_band_errors=len(in_band), retried_streams_ok=len(retried_streams),
        retried_whole_ok=len(retried_whole), failed_before_any_token=len(failed_unstarted),
        in_band_error_after_kill_s=round(max((r.end_time - kill_t for r in in_band), default=0.0), 2),
        in_band_errors_named=sum("was lost" in r.error for r in in_band),
        other_replica_failed=len(failures(elsewhere)),
        after_kill=len([r for r in results if r.start_time > kill_t + 0.5]),
        after_kill_failed=len(failures([r for r in results if r.start_time > kill_t + 0.5])),
        after_kill_errors=sorted({r.error[:160] for r in failures([r for r in results
                                                                     if r.start_time > kill_t + 0.5])})[:3],
        slow_after_kill=[(round(r.start_time - kill_t, 2), round(r.ttft, 2), r.replica)
                         for r in after if r.ttft > 1.0][:8],
        victim_replicas=sorted(victim_replicas),
        ttft_before_p50_s=round(median([r.ttft for r in before]), 3),
        ttft_after_p50_s=round(median([r.ttft for r in after]), 3),
        ttft_after_p90_s=round(quantile([r.ttft for r in after], 0.9), 3),
        ttft_after_max_s=round(max((r.ttft for r in after), default=float("nan")), 3),
        **res)
    groups_after = [g for g in view["placement_groups"] if g["state"] == "CREATED"]
    out["groups_left_behind"] = sum(1 for g in groups_after if victim_node in g["bundle_nodes"])
    out["groups_alive"] = len(groups_after)
    out["workers_alive"] = sum(1 for a in view["actors"] if a["state"] == "ALIVE" and a["cls"] == "RayWorkerWrapper")
    out["old_groups_gone"] = sum(1 for g in groups_before if g not in {x["id"] for x in groups_after})
    out["ok"] = bool(out["in_band_errors"] > 0 and out["retried_streams_ok"] + out["retried_whole_ok"] > 0
                     and out["failed_before_any_token"] == 0 and out["other_replica_failed"] == 0
                     and out["in_band_error_after_kill_s"] <= 2.0 and out["in_band_errors_named"] == len(in_band)
                     and out["after_kill_failed"] == 0 and out["replaced_in_s"] is not None
                     and out["replaced_in_s"] <= 60 and out["health_non_200"] == 0
                     and out["groups_left_behind"] == 0 and out["groups_alive"] == 2 and out["workers_alive"] == 4
                     # Sent after the loss: the usual TTFT, not the wait for Serve to notice it
                     # (the replacement's start-up shares this box's 2 cores: the tail grows).
                     and out["ttft_after_p90_s"] <= max(1.0, 3 * out["ttft_before_p50_s"])
                     and out["ttft_after_max_s"] < 5.0)
    return out


def _streaming_node(node_of: dict[str, str], inflight: dict[str, RequestResult]) -> str | None:
    """The worker node whose engine replica holds the most streams that have sent tokens
    (None while none has). ``node_of``: replica id -> node."""
    streaming = Counter(node_of.get(r.replica) for r in list(inflight.values()) if r.first_token_time > 0)
    streaming.pop(None, None)
    return streaming.most_common(1)[0][0] if streaming else None


async def _kill_under_load(ctx: Ctx, base: str, cluster: LocalCluster) -> dict:
    # First 8 whole-response requests, long ones, while both replicas are idle: those on the
    # lost node have sent the client nothing, and must be retried, not failed (the router may
    # put them all on one replica). Then 6 streams, each a closed loop of 160-token answers.
    burst = Load(base, clients=8, max_tokens=300, whole=8, seed=1)
    burst_task = asyncio.ensure_future(burst.run())
    await asyncio.sleep(0.3)
    burst.stop()  # each client's one request runs to its end
    load = Load(base, clients=6, max_tokens=160)
    stop_health = asyncio.Event()
    codes: list = []
    tasks = [asyncio.ensure_future(load.run()), asyncio.ensure_future(_health_watch(base, stop_health, codes))]
    await asyncio.sleep(3.0)
    # The victim: the node whose replica streams the most tokens now (Serve's replica actor
    # names end in the replica id the engine reports in the x-pagedserve-replica header).
    view = await asyncio.to_thread(ctx.view)
    node_of = {a["name"].rsplit("#", 1)[-1]: a["node"] for a in engine_replicas(view)}
    victim_node, t0 = None, time.perf_counter()
    while victim_node is None and time.perf_counter() - t0 < 30:
        victim_node = _streaming_node(node_of, load.inflight)
        if victim_node is None:
            await asyncio.sleep(0.05)
    victim_node = victim_node or _replica_nodes(view)[0]  # no stream started in 30 s: the test says so
    # Then 4 whole responses that have sent nothing when it dies, there by construction: the
    # prompt of a stream it holds, whose blocks its prefix cache has (the KV router's affinity).
    there = next((r for r in list(load.inflight.values()) if node_of.get(r.replica) == victim_node), None)
    held = Load(base, clients=4, max_tokens=300, whole=4, seed=3)
    if there is not None:
        held.prompt = load.prompts.get(there.request_id)
    held_task = asyncio.ensure_future(held.run())
    await asyncio.sleep(0.05)
    held.stop()  # each client's one request runs to its end
    await asyncio.sleep(0.5)  # routed and queued there
    victims = {a["name"].rsplit("#", 1)[-1] for a in engine_replicas(view) if a["node"] == victim_node}
    kill_t = time.perf_counter()
    await asyncio.to_thread(_kill_node_at_once, cluster, victim_node)
    print(f"  node {victim_node} removed under load (replica {', '.join(sorted(victims))})", flush=True)
    replaced = None
    while time.perf_counter() - kill_t < 90:
        await asyncio.sleep(1.0)
        view = await asyncio.to_thread(ctx.view)
        alive = [a for a in engine_replicas(view) if a["node"] != victim_node]
        dep = view["deployments"].get(f"pagedserve/{ENGINE}", {})
        if len(alive) == 2 and dep.get("replicas", {}).get("RUNNING") == 2:
            replaced = time.perf_counter() - kill_t
            break
    await asyncio.sleep(4.0)  # requests on the new replica too
    load.stop()
    stop_health.set()
    await asyncio.gather(*tasks, burst_task, held_task)
    load.results += burst.results + held.results
    return dict(kill_t=kill_t, victim_replicas=victims, victim_node=victim_node, results=load.results,
                replaced_in_s=None if replaced is None else round(replaced, 1),
                health_checks=len(codes), health_non_200=sum(1 for _, c in codes if c != 200),
                requests=len(load.results))


# node_kill_storm: a high rate of short streams, so that many requests are being routed,
# waiting for their admission, or waiting for their first token when the node goes.
STORM_CLIENTS = 16
STORM_TOKENS = 8
STORM_EACH_SIDE = 550  # requests sent before the kill, and after it: >= 1,000 around it
STORM_MIN_AROUND = 1000
STORM_STREAMS_AT_KILL = 3  # the node is killed while its replica answers at least this many streams
STORM_AFTER_S = 4.0  # the load goes on at least this long after the kill
STORM_CAP_S = 90.0  # each side's load stops here whatever it sent (a box too slow: the count says so)


def phase_node_kill_storm(ctx: Ctx) -> dict:
    cluster = ctx.new_cluster(2)
    with ctx.server(min_replicas=2, max_num_seqs=32) as srv:
        _wait_deployed(srv)
        res = asyncio.run(_storm(ctx, srv.base_url, cluster))
    kill_t, victims = res.pop("kill_t"), res.pop("victim_replicas")
    results: list[RequestResult] = res.pop("results")
    failed = failures(results)
    # The client's own measure: a token is a chunk with text or token ids (harness/client.py).
    no_token = [r for r in failed if r.first_token_time == 0]
    in_band = [r for r in failed if r.first_token_time > 0]
    before = [r for r in results if r.start_time < kill_t]
    out = dict(
        requests_around_kill=len(results),
        sent_before_kill=len(before), sent_after_kill=len(results) - len(before),
        load_before_kill_s=round(kill_t - min((r.start_time for r in results), default=kill_t), 1),
        load_after_kill_s=round(max((r.end_time for r in results), default=kill_t) - kill_t, 1),
        started_within_1s_after_kill=sum(1 for r in results if kill_t <= r.start_time < kill_t + 1.0),
        answered_by_before_kill=dict(Counter(r.replica for r in before if r.success)),
        victim_replicas=sorted(victims),
        inflight_at_kill=sum(1 for r in results if r.start_time < kill_t < r.end_time),
        on_lost_replica_at_kill=sum(1 for r in results if r.start_time < kill_t < r.end_time and r.replica in victims),
        refused_429_retried=sum(r.retries for r in results),
        failed_without_token=len(no_token),
        failed_without_token_errors=sorted({r.error[:200] for r in no_token})[:3],
        in_band_after_tokens=len(in_band),
        in_band_named=sum("was lost" in r.error for r in in_band),
        in_band_on_lost_replica=sum(r.replica in victims for r in in_band),
        in_band_last_after_kill_s=round(max((r.end_time - kill_t for r in in_band), default=0.0), 2),
        failed_after_kill=len([r for r in failed if r.start_time > kill_t]),
        answered_after_kill=len([r for r in results if r.start_time > kill_t and r.success]),
        **res)
    # Every request's times from the kill, for a reader who wants the timeline.
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    (ctx.out_dir / "node_kill_storm_requests.json").write_text(json.dumps([
        dict(start=round(r.start_time - kill_t, 3), first=round(r.first_token_time - kill_t, 3) if r.first_token_time else None,
             end=round(r.end_time - kill_t, 3), replica=r.replica, retries=r.retries, error=r.error[:200])
        for r in results]))
    out["ok"] = bool(out["requests_around_kill"] >= STORM_MIN_AROUND and out["failed_without_token"] == 0
                     and out["in_band_named"] == len(in_band) and out["in_band_on_lost_replica"] == len(in_band)
                     and out["on_lost_replica_at_kill"] > 0 and out["answered_after_kill"] > 0
                     and out["workers_killed"] > 0 and out["loss_seen_after_s"] is not None)
    return out


async def _storm(ctx: Ctx, base: str, cluster: LocalCluster) -> dict:
    # Closed loops of short streams; a 429 (the front's own limit on an overloaded box) is
    # sent again after its Retry-After, as the OpenAI SDK does, and counted.
    load = Load(base, clients=STORM_CLIENTS, max_tokens=STORM_TOKENS, max_retries=5)
    task = asyncio.ensure_future(load.run())
    metrics = httpx.AsyncClient(timeout=30)

    async def lost() -> float:  # replicas the front saw die (their lifeline ended)
        return _counter((await metrics.get(f"{base}/metrics")).text, "pagedserve:replicas_lost_total")

    t0 = time.perf_counter()
    while load.num_sent < STORM_EACH_SIDE and time.perf_counter() - t0 < STORM_CAP_S:
        await asyncio.sleep(0.1)
    view = await asyncio.to_thread(ctx.view)
    node_of = {a["name"].rsplit("#", 1)[-1]: a["node"] for a in engine_replicas(view)}
    lost_before = await lost()
    # The victim: the first node whose replica is answering STORM_STREAMS_AT_KILL streams (the
    # router may send a whole burst to one replica: the other may hold none at a given moment).
    victim_node, t1 = None, time.perf_counter()
    while victim_node is None and time.perf_counter() - t1 < 10:
        busy = Counter(node_of.get(r.replica) for r in list(load.inflight.values()) if r.replica)
        busy.pop(None, None)
        if busy and busy.most_common(1)[0][1] >= STORM_STREAMS_AT_KILL:
            victim_node = busy.most_common(1)[0][0]
        else:
            await asyncio.sleep(0.005)
    victim_node = victim_node or _replica_nodes(view)[0]  # none in 10 s: on_lost_replica_at_kill says so
    victims = {rid for rid, node in node_of.items() if node == victim_node}
    kill_t, sent_at_kill = time.perf_counter(), load.num_sent
    killed = await asyncio.to_thread(_kill_node_at_once, cluster, victim_node)
    print(f"  node {victim_node} removed under load (replica {', '.join(sorted(victims))})", flush=True)
    seen = None  # when the front counted the loss, from the kill
    while seen is None and time.perf_counter() - kill_t < 10:
        if await lost() > lost_before:
            seen = time.perf_counter() - kill_t
        else:
            await asyncio.sleep(0.05)
    while (load.num_sent < sent_at_kill + STORM_EACH_SIDE or time.perf_counter() - kill_t < STORM_AFTER_S) \
            and time.perf_counter() - kill_t < STORM_CAP_S:
        await asyncio.sleep(0.1)
    load.stop()
    await task
    page = (await metrics.get(f"{base}/metrics")).text
    await metrics.aclose()
    return dict(kill_t=kill_t, victim_replicas=victims, victim_node=victim_node, results=load.results,
                workers_killed=killed, loss_seen_after_s=None if seen is None else round(seen, 2),
                front_replicas_lost=_counter(page, "pagedserve:replicas_lost_total"),
                front_requests_retried=_counter(page, "pagedserve:requests_retried_total"))


def _counter(metrics: str, name: str) -> float:
    """The series ``name`` in a Prometheus text page, summed over its labels (0 if absent)."""
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith((name + " ", name + "{")))


def phase_scale_cycle(ctx: Ctx) -> dict:
    ctx.new_cluster(2)
    with ctx.server(min_replicas=1, max_replicas=2, target_ongoing_requests=2, upscale_delay_s=0,
                    downscale_delay_s=3) as srv:
        res = asyncio.run(_scale_cycle(ctx, srv.base_url))
    res["ok"] = bool(res["failed_requests"] == 0 and res["peak_replicas"] == 2 and res["final_replicas"] == 1
                     and res["requests_during_scale_down"] > 0)
    return res


async def _scale_cycle(ctx: Ctx, base: str) -> dict:
    load = Load(base, clients=8, max_tokens=120)
    task = asyncio.ensure_future(load.run())
    counts: list[int] = []

    async def until_running(n: int, timeout: float = 120.0) -> float | None:
        """Seconds until Serve says ``n`` engine replicas run (None: not within timeout)."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            view = await asyncio.to_thread(ctx.view)
            counts.append(view["deployments"].get(f"pagedserve/{ENGINE}", {}).get("replicas", {}).get("RUNNING", 0))
            if counts[-1] == n:
                return time.perf_counter() - t0
            await asyncio.sleep(1.0)
        return None

    up = await until_running(2)
    await asyncio.sleep(3.0)
    load.clients_now = 1  # the load falls: Serve removes a replica with streams on it
    t_low = time.perf_counter()
    down = await until_running(1)
    t_down = time.perf_counter()
    await asyncio.sleep(3.0)
    load.stop()
    await task
    failed = failures(load.results)
    return dict(requests=len(load.results), failed_requests=len(failed),
                failures=sorted({r.error[:120] for r in failed})[:5],
                peak_replicas=max(counts, default=0), final_replicas=counts[-1] if counts else 0,
                scaled_up_in_s=None if up is None else round(up, 1),
                scaled_down_in_s=None if down is None else round(down, 1),
                requests_during_scale_down=sum(1 for r in load.results if r.start_time < t_down and r.end_time > t_low),
                replicas_answering=len({r.replica for r in load.results if r.replica}))


def phase_rolling_update(ctx: Ctx) -> dict:
    ctx.new_cluster(2)
    args = {**{k: v for k, v in SERVE_ARGS.items() if k != "kv_cache_memory"},
            "kv_cache_memory_bytes": 64 << 20, "model": ctx.args.model, "served_model_name": "model", "min_replicas": 2, "max_replicas": 2}
    config = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": ctx.port},
              "applications": [{"name": "pagedserve", "route_prefix": "/",
                                "import_path": "pagedserve.cluster.app:app_builder", "args": args}]}
    t0 = time.perf_counter()
    deploy_config(ctx.cluster.address, config)
    _wait_healthy(ctx.base, 120)
    started = time.perf_counter() - t0
    res = asyncio.run(_update_under_load(ctx, config))
    res["first_deploy_s"] = round(started, 1)
    res["ok"] = bool(res["failed_requests"] == 0 and res["updated"] and res["replicas_answering"] >= 3)
    delete_app("pagedserve")
    return res


def _wait_healthy(base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base} not healthy after {timeout:.0f} s")


async def _update_under_load(ctx: Ctx, config: dict) -> dict:
    load = Load(ctx.base, clients=4, max_tokens=120)
    task = asyncio.ensure_future(load.run())
    await asyncio.sleep(4.0)
    before = {r.replica for r in load.results if r.replica}
    changed = json.loads(json.dumps(config))
    changed["applications"][0]["args"]["max_num_seqs"] = 16
    t0 = time.perf_counter()
    await asyncio.to_thread(deploy_config, ctx.cluster.address, changed)
    updated = None
    while time.perf_counter() - t0 < 180:
        await asyncio.sleep(1.0)
        view = await asyncio.to_thread(ctx.view)
        dep = view["deployments"].get(f"pagedserve/{ENGINE}", {})
        if "HEALTHY" in dep.get("status", "") and dep.get("replicas") == {"RUNNING": 2}:
            new = [a for a in engine_replicas(view) if a["name"].rsplit("#", 1)[-1] not in before]
            if len(new) == 2:
                updated = time.perf_counter() - t0
                break
    await asyncio.sleep(4.0)
    load.stop()
    await task
    failed = failures(load.results)
    return dict(requests=len(load.results), failed_requests=len(failed),
                failures=sorted({r.error[:120] for r in failed})[:5],
                updated=updated is not None, updated_in_s=None if updated is None else round(updated, 1),
                replicas_answering=len({r.replica for r in load.results if r.replica}))


PHASE_FUNCS = {"spread": phase_spread, "tp": phase_tp, "node_kill": phase_node_kill,
               "node_kill_storm": phase_node_kill_storm,
               "scale_cycle": phase_scale_cycle, "rolling_update": phase_rolling_update}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedserve.loadtest.multinode.cluster_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    p.add_argument("--model", default="pagedserve-demo", help="what each phase serves (default: the demo model)")
    p.add_argument("--cpus-per-node", type=int, default=4)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--result-dir", default=None, help="logs and cluster_check.json (default /tmp/cluster-check)")
    args = p.parse_args(argv)
    ctx = Ctx(args)
    results: dict[str, dict] = {}
    t_all = time.perf_counter()
    try:
        for name in args.phases:
            print(f"[{time.perf_counter() - t_all:5.0f} s] phase {name}", flush=True)
            t0 = time.perf_counter()
            try:
                results[name] = PHASE_FUNCS[name](ctx)
            except Exception as e:
                traceback.print_exc()
                results[name] = dict(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            results[name]["seconds"] = round(time.perf_counter() - t0, 1)
            for k, v in results[name].items():
                if k != "ok":
                    print(f"  {k}: {v}", flush=True)
            print(f"  {'ok' if results[name]['ok'] else 'NOT ok'}", flush=True)
    finally:
        if ctx.cluster is not None:
            ctx.close_cluster()
    out = ctx.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster_check.json").write_text(json.dumps({"phases": results}, indent=1))
    print(json.dumps({"phases": results}))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
