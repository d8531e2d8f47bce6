"""``pagedserve serve --http-ingress haproxy``: Ray Serve's HAProxy in front of the ingress
replica (cluster/cli/http_ingress.py), as a user meets it, on one server on loopback.

- HAProxy and its manager run, on the serving path's priority, and every socket of the
  server listens on loopback: HAProxy's stats page and Prometheus endpoint too, which Ray's
  configuration binds on every interface, on fixed ports a second server would collide on.
- A dropped stream aborts its request and frees its KV blocks, while the others finish
  (tests/test_serve_cancel.py's scenario, against this server). An unstreamed request whose
  client leaves is not tested: HAProxy passes that close on mostly but not always (the
  module has the counts), which is why Serve's proxy stays the default.
- Errors keep OpenAI's shape, a body over the limit is a 413.
- Ctrl-C stops it within its bound, HAProxy included, and leaves nothing behind.
Serve's proxy, the default, is what every other server of the tests runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

import test_serve_cancel as cancel
from _serve_process import ServerProcess, chat

BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("haproxy")
    srv = ServerProcess(sys.executable, work / "serve.log", work, "--http-ingress", "haproxy",
                        "--max-request-body-bytes", str(BODY_LIMIT), "--graceful-shutdown-timeout-s", "10")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop_for_good()


def test_the_choice_of_ingress_and_its_environment(monkeypatch, tmp_path):
    """No Ray: what ``configure`` decides and sets before the private Ray starts."""
    from pagedserve.cluster.cli import http_ingress

    for key in [k for k in os.environ if k.startswith("RAY_SERVE_")]:
        monkeypatch.delenv(key)
    assert http_ingress.configure(None, private=True, loopback=True) == "proxy"
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    with pytest.raises(SystemExit, match="private Ray only"):
        http_ingress.configure("haproxy", private=False, loopback=True)
    assert http_ingress.configure(None, private=False, loopback=True) == "cluster's own"
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")  # the environment chooses it too
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")  # what the user set stays theirs
    real = http_ingress.haproxy_binary()
    assert os.access(real, os.X_OK)
    assert http_ingress.configure(None, private=True, loopback=False) == "haproxy"
    wrapper = os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"]
    assert os.access(wrapper, os.X_OK) and f"exec {real} " in open(wrapper).read()
    assert os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    assert int(os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"]) not in (9101, 18404)
    # A pagedserve started from this environment finds the real binary, not this one's wrapper.
    assert http_ingress.haproxy_binary() == real
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(tmp_path / "none"))
    with pytest.raises(SystemExit, match="no HAProxy ingress"):
        http_ingress.configure("haproxy", private=True, loopback=True)


def test_the_wrapper_edits_rays_configuration(tmp_path):
    """The script Ray runs as HAProxy, on a configuration as Ray writes it: connections not
    shared, and on loopback the two listeners Ray binds on every interface on 127.0.0.1."""
    from pagedserve.cluster.cli.http_ingress import write_wrapper

    ray_cfg = ("frontend prometheus\n    bind :9101\nfrontend http_frontend\n    bind 127.0.0.1:8000\n"
               "backend http-app\n    http-reuse always\n    server r 127.0.0.1:30000 check\n"
               "listen stats\n  bind *:8404\n")
    for loopback, binds in ((True, ["127.0.0.1:9101", "127.0.0.1:8000", "127.0.0.1:8404"]),
                            (False, [":9101", "127.0.0.1:8000", "*:8404"])):
        cfg = tmp_path / f"haproxy-{loopback}.cfg"
        cfg.write_text(ray_cfg)
        run = subprocess.run([str(write_wrapper("/bin/echo", loopback)), "-db", "-f", str(cfg)],
                             capture_output=True, text=True)
        assert run.returncode == 0 and run.stdout.split() == ["-db", "-f", str(cfg)], run
        text = cfg.read_text()
        assert [ln.split()[1] for ln in text.splitlines() if ln.strip().startswith("bind")] == binds
        assert "http-reuse never" in text and "http-reuse always" not in text


def _url(server: ServerProcess) -> str:
    return f"http://127.0.0.1:{server.port}"


def test_haproxy_carries_the_requests_and_listens_on_loopback_only(server):
    assert "HTTP ingress: haproxy" in server.text(), server.tail()
    chat(server.port)
    procs = server.leftovers()
    titles = {p.pid: " ".join(p.cmdline()[:1]) for p in procs}
    haproxy = [p for p in procs if p.name() == "haproxy"]
    assert haproxy and any(t.startswith("ray::HAProxyManager") for t in titles.values()), titles
    if len(psutil.Process().cpu_affinity()) > 1:  # the CPU split: the serving path at nice 19
        deadline = time.monotonic() + 10  # ServingCPU's pass runs every few seconds
        while any(p.nice() != 19 for p in haproxy) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [p.nice() for p in haproxy] == [19] * len(haproxy)
    listening, exposed = [], []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                listening.append((p.name(), c.laddr.port))
                addr = c.laddr.ip.removeprefix("::ffff:")
                if addr not in ("127.0.0.1", "::1"):
                    exposed.append((titles.get(p.pid, p.name()), c.laddr.ip, c.laddr.port))
    assert exposed == [], exposed
    haproxy_ports = {port for name, port in listening if name == "haproxy"}
    # The HTTP frontend, and the stats page and Prometheus endpoint on free ports.
    assert server.port in haproxy_ports and len(haproxy_ports) >= 3, listening
    assert not haproxy_ports & {8404, 9101}, haproxy_ports


def test_a_dropped_stream_is_aborted_and_frees_its_blocks(server):
    cancel.test_disconnect_mid_stream_frees_kv_and_others_finish(_url(server))


def test_errors_keep_openais_shape_and_a_big_body_is_a_413(server):
    url = _url(server)
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": "one"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens", bad.text
    missing = httpx.get(f"{url}/v1/nowhere", timeout=30)
    assert missing.status_code == 404 and "message" in missing.json()["error"], missing.text
    big = httpx.post(f"{url}/v1/completions", timeout=30,
                     json={"prompt": "x" * (BODY_LIMIT + 1), "max_tokens": 1})
    assert big.status_code == 413 and big.json()["error"]["code"] == 413, big.text
    chat(server.port)  # and it goes on answering


def test_ctrl_c_stops_it_with_haproxy_and_leaves_nothing(server):
    assert any(p.name() == "haproxy" for p in server.leftovers())
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(timeout=90) == 0, server.tail()
    print(f"stopped in {time.monotonic() - t0:.1f} s")
    assert server.wait_gone() == []
