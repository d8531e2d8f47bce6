"""The KV router (cluster/front/router/routing.py) on a real Serve app of two engine replicas:

- each prompt prefix stays on the replica that prefilled it (the replica named in the
  ``x-pagedserve-replica`` header), and the second request of a prefix finds it cached;
- the front's /metrics counts the router's decisions and each replica's prefix hits;
- with tenant isolation (the default), another tenant's identical prompt is not routed
  by the first tenant's blocks: the router matched none of its tokens;
- the replica that served a LoRA adapter's request publishes the adapter and its measured
  read time in its KV events' header, the other neither (what the router charges a replica
  without the adapter: tests/test_kv_routing.py);
- a replica killed mid-run leaves the router: every later request is answered by the
  other one (or by Serve's replacement), none is sent to the dead one.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import SERVE_ENGINE, delete_app

APP = "routing-test"
PREFIX = "/route"
WORDS = ("alpha", "river", "stone", "cloud", "maple", "orbit", "lemon", "tiger", "piano", "delta", "ember",
         "frost", "grape", "harbor", "island", "jungle", "kettle", "lantern", "meadow", "nectar")


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _metrics(base: str) -> dict:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[key] = s.value
    return out


def _complete(client: httpx.Client, base: str, prompt: str, tenant: str | None = None,
              model: str | None = None) -> httpx.Response:
    headers = {"x-tenant": tenant} if tenant else None
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    if model:
        body["model"] = model
    r = client.post(f"{base}/v1/completions", headers=headers, json=body)
    assert r.status_code == 200, r.text
    return r


@pytest.mark.scenarios  # under -m scenarios (pyproject.toml), not the default run
def test_kv_router_keeps_prefixes_isolates_tenants_and_drops_a_killed_replica(serve_url, serve_model, tmp_path):
    import ray
    from ray import serve

    from _lora_helpers import make_random_adapter
    from pagedserve.cluster.app import build_app
    from pagedserve.config import EngineConfig

    sql = make_random_adapter(serve_model, tmp_path / "sql", r=8, alpha=16)
    cfg = EngineConfig(model=serve_model, **{**SERVE_ENGINE, "max_waiting_requests": None,
                                             "max_queue_delay_s": None},
                       enable_lora=True, max_lora_rank=8, lora_modules=[f"sql={sql}"])
    # Two replicas: the KV router is the default (cluster/app.py request_router).
    serve.run(build_app(cfg, min_replicas=2, max_replicas=2, engine_num_cpus=0.5, allow_tenant_header=True),
              name=APP, route_prefix=PREFIX)
    base = serve_url + PREFIX
    rng = random.Random(0)
    try:
        with httpx.Client(timeout=60) as client:
            # The router decides by the KV view once the front holds the tokenizer and the
            # replicas' event addresses have come in their routing stats.
            deadline = time.monotonic() + 60
            while _metrics(base).get("pagedserve:router_requests_total|decision=load", 0) \
                    + _metrics(base).get("pagedserve:router_requests_total|decision=prefix", 0) == 0:
                assert time.monotonic() < deadline, "the KV router never decided"
                _complete(client, base, _text(rng, 8))
                time.sleep(0.2)

            prefixes = [_text(rng, 120) for _ in range(4)]
            first = {i: _complete(client, base, p + " " + _text(rng, 10)).headers["x-pagedserve-replica"]
                     for i, p in enumerate(prefixes)}
            assert len(set(first.values())) == 2, first  # new prefixes spread over both caches
            time.sleep(0.5)  # the replicas' events reach the router within a step or two
            before = _metrics(base)
            for i, p in enumerate(prefixes):
                r = _complete(client, base, p + " " + _text(rng, 10))
                assert r.headers["x-pagedserve-replica"] == first[i], (i, first)
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96, r.json()["usage"]
            after = _metrics(base)
            routed = "pagedserve:router_requests_total|decision=prefix"
            assert after[routed] - before.get(routed, 0) == len(prefixes)
            matched = after["pagedserve:router_matched_tokens_total"] - before["pagedserve:router_matched_tokens_total"]
            assert matched >= 96 * len(prefixes)
            for rid in set(first.values()):  # each replica reports its own prefix-cache hits
                assert after[f"pagedserve:replica_prefix_cache_hits_total|replica={rid}"] > 0

            # Another tenant's identical prompt: its block 0 is salted with its tenant, so the
            # router sees no match anywhere, whatever replica holds the first tenant's blocks.
            _complete(client, base, prefixes[0] + " once more", tenant="acme")
            time.sleep(0.5)
            before = _metrics(base)
            r = _complete(client, base, prefixes[0] + " once more", tenant="globex")
            after = _metrics(base)
            assert after["pagedserve:router_matched_tokens_total"] == before["pagedserve:router_matched_tokens_total"]
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

            # An adapter's request: its replica's KV events now name the adapter (the id every
            # process derives from name and path) with a read time, read here as the router
            # reads them. (Which replica the next one goes to is the cost model's call, and on
            # this tiny adapter, read in milliseconds, the replicas' measured prefill rates
            # weigh as much: tests/test_kv_routing.py checks that choice.)
            from pagedserve.cluster.wire.kv_events import KVEventSubscriber
            from pagedserve.scheduler.lora import adapter_id

            _complete(client, base, _text(rng, 12), model="sql")
            handle = serve.get_deployment_handle("EngineDeployment", APP)
            addresses: set = set()
            deadline = time.monotonic() + 30
            while len(addresses) < 2:
                assert time.monotonic() < deadline, addresses
                addresses.add(handle.record_routing_stats.remote().result()["kv_events"])
            subs = [KVEventSubscriber(a) for a in sorted(addresses)]
            try:
                want, holders = adapter_id("sql", sql), []
                deadline = time.monotonic() + 30
                while not (len(holders) == 1 and all(s.heard_at for s in subs)):
                    assert time.monotonic() < deadline, [s.stats for s in subs]
                    time.sleep(0.1)
                    for s in subs:
                        s.poll()
                    holders = [s for s in subs if want in s.stats.lora_adapters]
                assert holders[0].stats.lora_load_s > 0
            finally:
                for s in subs:
                    s.close()

            # Kill one replica; once the front has noticed (its lifeline ended), every later
            # request is answered, none by the dead one.
            victim = first[0]
            lost = _metrics(base).get("pagedserve:replicas_lost_total", 0)
            ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#EngineDeployment#{victim}", namespace="serve"),
                     no_restart=True)
            deadline = time.monotonic() + 30
            while _metrics(base).get("pagedserve:replicas_lost_total", 0) <= lost:
                assert time.monotonic() < deadline, "the front never saw the replica die"
                time.sleep(0.1)
            answered = [_complete(client, base, prefixes[i % 4] + " " + _text(rng, 10)).headers["x-pagedserve-replica"]
                        for i in range(8)]
            assert victim not in answered, answered
    finally:
        delete_app(APP)
