"""Tenants over HTTP on a real Serve app (issue 15, the serving side).

The story: a request's tenant comes from its API key (a keys file) or an allowed x-tenant
header; the prefix cache never hits across tenants but does within one; a waiting
request says why (response header, GET /v1/requests/{id}); /metrics has per-tenant
series; two tenants offering 10:1 load get ~50/50 of the tokens while both are
backlogged.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import SERVE_ENGINE, delete_app

PLAIN_KEY = "sk-plain"  # the single --api-key: an unmapped key, x-tenant may name its tenant
KEYS_YAML = "sk-gold: gold\nsk-bronze: {tenant: bronze, weight: 1.0}\n"
ENGINE = dict(SERVE_ENGINE, max_waiting_requests=None, max_queue_delay_s=0)
MODEL = "llama-gqa2-hd64"
LONG_PROMPT = "tenant isolation check " * 12  # > 3 full blocks of 16 tokens


@pytest.fixture(scope="module")
def url(serve_url, serve_model, tmp_path_factory):
    from ray import serve

    from pagedserve.cluster.app import build_app
    from pagedserve.config import EngineConfig

    keys = tmp_path_factory.mktemp("tenants") / "keys.yaml"
    keys.write_text(KEYS_YAML)
    cfg = EngineConfig(model=serve_model, served_model_name=MODEL, **ENGINE)
    serve.run(build_app(cfg, name_prefix="tenants-", api_key=PLAIN_KEY, api_keys_file=str(keys),
                        allow_tenant_header=True), name="tenants-test", route_prefix="/tenants")
    yield f"{serve_url}/tenants"
    delete_app("tenants-test")


def headers(tenant: str | None = None, key: str = PLAIN_KEY) -> dict:
    h = {"Authorization": f"Bearer {key}"}
    if tenant is not None:
        h["x-tenant"] = tenant
    return h


def client(url: str, tenant: str | None = None, key: str = PLAIN_KEY) -> openai.OpenAI:
    extra = {"x-tenant": tenant} if tenant else None
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120,
                         default_headers=extra)


def tenant_series(url: str) -> dict[str, dict[str, float]]:
    """{metric name (no prefix): {tenant: value}} for the per-tenant families."""
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            if "tenant" in s.labels:
                out.setdefault(s.name.removeprefix("pagedserve:"), {})[s.labels["tenant"]] = s.value
    return out


def test_tenant_from_key_or_allowed_header(url):
    body = {"prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 401
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers("bronze", key="sk-gold"))
    assert r.status_code == 403 and r.json()["error"]["param"] == "x-tenant"
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers("no spaces!"))
    assert r.status_code == 400 and "x-tenant" in r.json()["error"]["message"]
    for h in (headers(key="sk-gold"), headers("gold", key="sk-gold"), headers("acme")):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=h, timeout=60)
        assert r.status_code == 200, r.text
    client(url).completions.create(model=MODEL, prompt="hi", max_tokens=2)  # -> "default"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # stats arrive with the next push (<= 1 s)
        tokens = tenant_series(url).get("tenant_tokens_total", {})
        if {"gold", "acme", "default"} <= set(tokens):
            break
        time.sleep(0.2)
    assert {"gold", "acme", "default"} <= set(tokens), tokens
    assert "bronze" not in tokens  # the 403 never reached an engine


def test_prefix_cache_is_per_tenant(url):
    def cached(tenant: str) -> int:
        r = client(url, tenant).completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=1)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("iso-a") == 0
    hit = cached("iso-a")  # the same tenant again: its own full prompt blocks
    assert hit >= 48 and hit % 16 == 0
    assert cached("iso-b") == 0  # another tenant, the same prompt: no cross-tenant hit
    assert cached("iso-b") == hit


async def _stream_headers(url: str, tenant: str, max_tokens: int):
    """Open a streamed completion; return (response, its async client) once headers are in."""
    http = httpx.AsyncClient(timeout=120)
    req = http.build_request("POST", f"{url}/v1/completions", headers=headers(tenant),
                             json={"prompt": "why am I waiting", "max_tokens": max_tokens,
                                   "ignore_eos": True, "stream": True})
    return await http.send(req, stream=True), http


def test_why_waiting_header_and_request_status(url):
    async def main():
        n = ENGINE["max_num_seqs"]
        running = [await _stream_headers(url, "ww-busy", 400) for _ in range(n)]
        for resp, _ in running:
            assert resp.status_code == 200
        # One more of the same tenant waits for a slot (its tenant holds them all).
        resp, http = await _stream_headers(url, "ww-busy", 4)
        late = []
        try:
            rid = resp.headers["x-pagedserve-request-id"]
            queue = resp.headers.get("x-pagedserve-queue")
            assert queue is not None and "reason=max_seqs" in queue and "position=0" in queue, queue
            async with httpx.AsyncClient(timeout=30) as c:
                st = (await c.get(f"{url}/v1/requests/{rid}", headers=headers("ww-busy"))).json()
                other = await c.get(f"{url}/v1/requests/{rid}", headers=headers("ww-late"))
                busy_id = running[0][0].headers["x-pagedserve-request-id"]
                busy = (await c.get(f"{url}/v1/requests/{busy_id}", headers=headers("ww-busy"))).json()
            assert st.get("id") == rid and st["status"] == "waiting" and st["reason"] == "max_seqs", st
            assert st["tenant"] == "ww-busy" and st["position"] == 0 and st["est_start_s"] > 0
            assert st["num_preemptions"] == 0
            assert other.status_code == 404  # another tenant cannot see it
            assert busy["status"] == "running" and busy["tenant"] == "ww-busy"
            # Another tenant, under its share of the slots, starts at once: one of ww-busy's
            # streams is preempted for it (the scheduler's slot share).
            late.append(await _stream_headers(url, "ww-late", 4))
            assert late[0][0].status_code == 200
            assert "x-pagedserve-queue" not in late[0][0].headers, late[0][0].headers
        finally:
            for r, h in running + [(resp, http)] + late:
                await r.aclose()
                await h.aclose()
        async with httpx.AsyncClient(timeout=30) as c:  # finished or aborted: gone
            deadline = time.monotonic() + 10
            while (await c.get(f"{url}/v1/requests/{rid}", headers=headers("ww-busy"))).status_code != 404:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)

    asyncio.run(main())


def test_metrics_have_tenant_and_pool_series(url):
    text = httpx.get(f"{url}/metrics").text
    for name in ("pagedserve:num_free_blocks", "pagedserve:queue_kv_demand_blocks",
                 'pagedserve:num_requests_waiting_by_reason{model_name="llama-gqa2-hd64",reason="reserved"}',
                 "pagedserve:tenant_requests_running", "pagedserve:tenant_requests_waiting",
                 "pagedserve:tenant_tokens_total"):
        assert name in text, name


@pytest.mark.scenarios  # under -m scenarios (pyproject.toml), not the default run
def test_two_tenants_10_to_1_get_even_token_shares(url):
    """Tenant heavy keeps 10x the requests of tenant light in flight (closed loop, so both
    stay backlogged behind max_num_seqs); over a window, the tokens each was scheduled
    (the fair share's measure) split within 10% of 50/50. Light keeps 8 in flight, twice
    max_num_seqs: with 4, its finished requests were sometimes not yet sent again when a
    slot freed, its queue was empty, and heavy took the slot (light's share 0.44-0.48)."""
    body = {"prompt": "fair share " * 4, "max_tokens": 24, "ignore_eos": True}

    async def worker(http, tenant, stop):
        while not stop.is_set():
            r = await http.post(f"{url}/v1/completions", json=body, headers=headers(tenant))
            assert r.status_code == 200, r.text

    async def main():
        stop = asyncio.Event()
        async with httpx.AsyncClient(timeout=120) as http:
            tasks = [asyncio.create_task(worker(http, "heavy", stop)) for _ in range(80)]
            tasks += [asyncio.create_task(worker(http, "light", stop)) for _ in range(8)]
            await asyncio.sleep(4)  # both backlogged by now
            t0 = tenant_series(url)
            await asyncio.sleep(10)
            t1 = tenant_series(url)
            waiting = t1["tenant_requests_waiting"]
            stop.set()
            await asyncio.gather(*tasks)
        return t0["tenant_tokens_total"], t1["tenant_tokens_total"], waiting

    t0, t1, waiting = asyncio.run(main())
    heavy = t1["heavy"] - t0.get("heavy", 0)
    light = t1["light"] - t0.get("light", 0)
    share = light / (heavy + light)
    print(f"fairness: heavy {heavy:.0f} tokens, light {light:.0f} tokens, light share {share:.3f}; "
          f"waiting at the end {waiting}")
    assert waiting.get("heavy", 0) > 0  # heavy was backlogged
    assert 0.45 <= share <= 0.55


@pytest.mark.skipif(__import__("shutil").which("chromium") is None,
                    reason="needs Debian's chromium (apt-get install -y chromium)")
def test_dashboard_in_headless_chromium(url, tmp_path):
    """Under load, in a real browser: the block map (canvas) differs between two
    screenshots, and the newest timeline row names the running requests' ids."""
    import threading

    from pagedserve.loadtest.harness.browser import Browser

    stop, ids = threading.Event(), set()

    async def worker(http, k):
        i = 0
        while not stop.is_set():
            i += 1
            body = {"prompt": f"dashboard load {k} {i} " * 3, "max_tokens": 48, "ignore_eos": True,
                    "stream": True}
            async with http.stream("POST", f"{url}/v1/completions", json=body,
                                   headers=headers("dash")) as r:
                ids.add(r.headers["x-pagedserve-request-id"])
                async for _ in r.aiter_bytes():
                    pass

    async def load():
        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.gather(*(worker(http, k) for k in range(6)))

    t = threading.Thread(target=asyncio.run, args=(load(),), daemon=True)
    t.start()
    try:
        time.sleep(2)
        with Browser() as b:
            b.goto(f"{url}/dashboard")
            assert b.wait_for("document.querySelectorAll('table.tl .chip').length > 0")
            shots, row = [], []
            for n in range(1, 9):  # bounded: up to 8 looks 1.5 s apart, until the map has moved
                shots.append(b.screenshot(selector="canvas"))
                (tmp_path / f"dashboard-{n}.png").write_bytes(shots[-1])
                row = b.evaluate("[...document.querySelector('table.tl tr').querySelectorAll('.chip')]"
                                 ".map(c => c.title.split(':')[0])") or row
                if len(shots) >= 2 and shots[-1] != shots[0] and row:
                    break
                time.sleep(1.5)
            full = b.screenshot()
            (tmp_path / "dashboard-page.png").write_bytes(full)
    finally:
        stop.set()
        t.join(60)
    print(f"dashboard screenshots in {tmp_path}; newest timeline row {row}")
    assert shots[-1] != shots[0]  # the block map moved under load
    # The newest step ran some of our streams (not always all max_num_seqs: a finished one's
    # successor may not have joined yet), and only ours.
    assert 1 <= len(row) <= ENGINE["max_num_seqs"] and set(row) <= ids, (row, sorted(ids)[:8])


def test_guard_and_keys_file_units(tmp_path):
    """No Serve: the x-tenant rule without --allow-tenant-header, and the keys file's checks."""
    from pagedserve.cluster.front.edge import EdgeGuard, IngressConfig
    from pagedserve.cluster.front.tenants import (key_weights, load_api_keys, parse_reservation,
                                                  parse_tenant_weight)

    closed = EdgeGuard(IngressConfig(api_keys={"k1": "gold"}), None)
    assert closed.identify("Bearer k1") == (True, "gold")
    assert closed.identify("Bearer nope") == (False, None)
    assert closed.tenant(None, None) == (None, "default")
    err, _ = closed.tenant(None, "acme")
    assert "--allow-tenant-header" in err  # refused, and says how to allow it
    keys = tmp_path / "k.json"
    keys.write_text('{"a": "t1", "b": {"tenant": "t2", "weight": 2}}')
    loaded = load_api_keys(str(keys))
    assert {k: v.tenant for k, v in loaded.items()} == {"a": "t1", "b": "t2"}
    assert key_weights(loaded) == {"t2": 2.0}
    keys.write_text('{"a": {"tenant": "t1", "colour": "red"}}')
    with pytest.raises(ValueError, match="each key maps to"):
        load_api_keys(str(keys))
    assert parse_tenant_weight("gold=3") == ("gold", 3.0)
    assert parse_reservation("gold:blocks=64,seqs=2") == ("gold", {"blocks": 64, "seqs": 2})
    assert parse_reservation("priority:0:seqs=1") == ("priority:0", {"seqs": 1})
    for bad in ("gold", "gold:blocks=x", "gold:cpus=1", "priority:x:seqs=1"):
        with pytest.raises(ValueError):
            parse_reservation(bad)
