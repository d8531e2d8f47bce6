"""Admission control per tenant over HTTP (cluster/replica/admission.py, cluster/front/door.py): on a
real Serve app with the default queue-delay bound, a tenant flooding the replica gets 429s
with Retry-After, and another tenant's request is admitted and answered meanwhile: the
flood's 429s (the replica's, and the ingress gate's) are its own."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import SERVE_ENGINE, delete_app

pytestmark = pytest.mark.scenarios  # a Serve app of its own under load: -m scenarios (pyproject.toml)

MODEL = "llama-gqa2-hd64"
ENGINE = dict(SERVE_ENGINE, max_waiting_requests=None, max_queue_delay_s=1.0)


@pytest.fixture(scope="module")
def url(serve_url, serve_model):
    from ray import serve

    from pagedserve.cluster.app import build_app
    from pagedserve.config import EngineConfig

    cfg = EngineConfig(model=serve_model, served_model_name=MODEL, **ENGINE)
    serve.run(build_app(cfg, name_prefix="tadm-", allow_tenant_header=True), name="tenant-admission",
              route_prefix="/tadm")
    yield f"{serve_url}/tadm"
    delete_app("tenant-admission")


def test_a_flooding_tenant_is_refused_and_another_is_served(url):
    body = {"model": MODEL, "prompt": "flood " * 20, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def one(http, tenant, payload):
        async with http.stream("POST", f"{url}/v1/completions", json=payload, headers={"x-tenant": tenant}) as r:
            if r.status_code != 200:
                return r.status_code, r.headers.get("retry-after"), (await r.aread()).decode()
            chunks = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return 200, None, chunks[-1]

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            flood = [asyncio.create_task(one(http, "flood", body)) for _ in range(24)]
            await asyncio.sleep(1.0)  # the flood is in: 4 running, its queue refused beyond that
            calm = await one(http, "calm", dict(body, prompt="calm", max_tokens=8))
            flood_later = await one(http, "flood", body)  # still flooding: still refused
            done_before_calm = sum(t.done() and t.result()[0] == 200 for t in flood)
            return calm, flood_later, await asyncio.gather(*flood), done_before_calm

    calm, flood_later, flood, done_before_calm = asyncio.run(main())
    assert calm[0] == 200 and calm[2] == "data: [DONE]"
    refused = [f for f in flood if f[0] == 429]
    assert refused and all(f[1] is not None and int(f[1]) >= 1 for f in refused)  # Retry-After
    assert all('"overloaded' in f[2] or "overloaded" in f[2] for f in refused)
    assert flood_later[0] == 429
    assert sum(f[0] == 200 for f in flood) >= 4 and all(f[0] in (200, 429) for f in flood)
    assert done_before_calm < sum(f[0] == 200 for f in flood)  # calm finished while flood streamed

    def gauges():
        text = httpx.get(f"{url}/metrics", timeout=30).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if not (s.labels.get("reason") or s.labels.get("tenant"))}

    deadline = time.monotonic() + 20  # nothing stays behind: every admitted stream finished
    while True:
        m = gauges()
        idle = (m["pagedserve:num_requests_running"] == 0 and m["pagedserve:num_requests_waiting"] == 0
                and m["pagedserve:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, m
