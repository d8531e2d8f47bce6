"""Security of a single-node deployment (issue 10, defect 8), on a real TP=2 Serve app:

- ``api_key``: /v1/* answers 401 in OpenAI's error JSON without ``Authorization: Bearer
  <key>``, and 200 with it, through the real openai SDK; /health, /metrics and /tokenize
  stay open, as with vLLM's ``--api-key``.
- no process of this Ray instance (the test process's tree: GCS, raylet, agents, Serve
  controller/proxy/replicas, the two TP worker actors) listens on a non-loopback
  address: the Serve replicas' gRPC servers and TP rank 0's rendezvous store were the
  two that did (``[::]``), see deploy/README.md "What listens where".
"""

from __future__ import annotations

import ipaddress
import os

import httpx
import openai
import psutil
import pytest

from conftest import SERVE_ENGINE, delete_app

KEY = "sk-test-" + "0123456789abcdef"
PREFIX = "/secure"


@pytest.fixture(scope="module")
def secure_app(serve_url, serve_model):
    from ray import serve

    from pagedserve.cluster.app import build_app
    from pagedserve.config import EngineConfig

    cfg = EngineConfig(model=serve_model, **{**SERVE_ENGINE, "tensor_parallel_size": 2})
    serve.run(build_app(cfg, name_prefix="secure-", api_key=KEY), name="secure-test",
              route_prefix=PREFIX)
    yield f"{serve_url}{PREFIX}"
    delete_app("secure-test")


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def test_api_key_401_without_it_200_with_it(secure_app):
    good = _client(secure_app, KEY)
    [card] = good.models.list().data
    r = good.completions.create(model=card.id, prompt="hi", max_tokens=3, temperature=0,
                                extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    chunks = list(good.chat.completions.create(
        model=card.id, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason is not None

    with pytest.raises(openai.AuthenticationError) as exc:
        _client(secure_app, "sk-wrong").completions.create(model=card.id, prompt="hi", max_tokens=3)
    assert exc.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        _client(secure_app, "sk-wrong").models.list()

    for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"Bearer {KEY}x"}):
        resp = httpx.post(f"{secure_app}/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert resp.status_code == 401, headers
        err = resp.json()["error"]
        assert err["code"] == 401 and err["type"] == "AuthenticationError" and err["message"]
        assert resp.headers["www-authenticate"] == "Bearer"
    # SageMaker's /invocations generates as /v1 does: it needs the key too.
    assert httpx.post(f"{secure_app}/invocations", json={"prompt": "hi", "max_tokens": 1}).status_code == 401
    assert httpx.post(f"{secure_app}/invocations", json={"prompt": "hi", "max_tokens": 1},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60).status_code == 200
    # A big unauthenticated body is refused from its headers (401 before 413, unread).
    big = httpx.post(f"{secure_app}/v1/completions", content=b"x" * (64 << 20),
                     headers={"content-type": "application/json"}, timeout=60)
    assert big.status_code == 401
    # Open, as in vLLM: probes and metrics scrapers carry no key.
    assert httpx.get(f"{secure_app}/health").status_code == 200
    assert httpx.get(f"{secure_app}/metrics").status_code == 200
    assert httpx.post(f"{secure_app}/tokenize", json={"prompt": "hi"}).status_code == 200


def test_api_key_from_environment(monkeypatch):
    from pagedserve.cluster.front.edge import API_KEY_ENV, EdgeGuard, IngressConfig

    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert IngressConfig.from_options().api_key == "from-env"
    assert IngressConfig.from_options(api_key="flag").api_key == "flag"  # the flag wins
    monkeypatch.setenv(API_KEY_ENV, "")
    assert IngressConfig.from_options().api_key is None
    guard = EdgeGuard(IngressConfig(api_key="k"), max_model_len=None)
    assert guard.authorized("Bearer k") and guard.authorized("bearer  k")
    assert not guard.authorized(None) and not guard.authorized("Bearer") and not guard.authorized("k")


def test_serve_config_args_carry_the_http_options():
    """``api_key`` / ``max_request_body_bytes`` are Serve-config args next to the engine
    fields (deploy/serve_config.yaml), and reach the ingress, not the engine."""
    from pagedserve.cluster.front.edge import IngressConfig
    from pagedserve.cluster.app import build_app, split_args

    cfg, opts = split_args({"max-num-seqs": 4, "api_key": "k", "max_request_body_bytes": 1 << 20})
    assert opts == {"api_key": "k", "max_request_body_bytes": 1 << 20}
    ingress = build_app(cfg, **opts)._bound_deployment
    assert ingress.init_args[2] == IngressConfig(api_key="k", max_request_body_bytes=1 << 20)
    engine_config = ingress.init_args[0]._bound_deployment.init_args[0]
    assert engine_config.max_num_seqs == 4 and not hasattr(engine_config, "api_key")
    with pytest.raises(ValueError):
        IngressConfig.from_options(max_request_body_bytes=0)


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def test_no_listener_of_the_process_tree_on_a_non_loopback_address(secure_app):
    # The TP=2 replica is up and has served (its TCPStore and gloo pairs exist).
    r = httpx.post(f"{secure_app}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    me = psutil.Process(os.getpid())
    procs = [me, *me.children(recursive=True)]
    names = {p.pid: " ".join(p.cmdline()[:2]) for p in procs if p.is_running()}
    assert sum("RayWorkerWrapper" in n or "RayWorkerW" in n for n in names.values()) >= 2, names
    listeners, exposed = [], []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN or (c.type == 2 and not c.raddr):  # TCP listen, UDP bound
                listeners.append((p.pid, c.laddr.ip, c.laddr.port))
                if not _is_loopback(c.laddr.ip):
                    exposed.append((names.get(p.pid, p.pid), c.laddr.ip, c.laddr.port))
    assert len(listeners) >= 10  # GCS, raylet, agents, controller, proxy, replicas, workers
    assert exposed == [], exposed
