"""``pagedserve serve`` stops however the stop is sent, within its bound (the replicas'
drain plus SHUTDOWN_MARGIN_S), and leaves no process of its own behind: not in its
session, and none that names the Ray session directory it created.

    group_sigterm    SIGTERM to its process group (``kill -- -PGID``): Ray's processes lead
                     groups of their own, so only pagedserve gets it and stops Serve and Ray
                     in order: exit status 0
    pid_sigint       SIGINT to its pid (Ctrl-C): the same path, exit status 0
    session_sigterm  SIGTERM to every process of its session, Ray's included (what systemd's
                     default KillMode does to a service's cgroup): the GCS stops answering,
                     the shutdown watchdog kills what is left and exits with status 1
    pid_sigkill      SIGKILL to its pid: nothing of it runs, the kernel kills the GCS and the
                     raylet with it (Ray starts them with PR_SET_PDEATHSIG) and the workers
                     exit once their raylet is gone; the raylet's two agents first try to
                     report its death to the GCS, gone too, and exit when that times out.
                     Marked cluster (not in the default run, ./dev test -m cluster): it waits
                     out that timeout, and its server is one more to start on the cores

SIGTERM to the pid alone (a plain ``kill PID``) is tested on the wheel, in
tests/test_packaging.py, and with the default model in tests/test_script_smokes.py.

Each server leads a session of its own (``start_new_session``), so every process it starts
stays in that session (none of Ray's calls setsid) and the test can tell its processes from
anyone else's. The servers start together: each waits on Ray and the engine much of its
start, which the others fill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from pagedserve.cluster.cli.serve import SHUTDOWN_MARGIN_S

from _serve_process import ServerProcess, chat

# A short drain for an idle server: the bound every stop below is held to is DRAIN_S + margin.
DRAIN_S = 10.0
# The raylet's agents outlive a SIGKILLed server until their report of the raylet's death to
# the GCS times out (ray._private.utils.publish_error_to_driver waits 60 s).
RAY_AGENTS = {"ray::DashboardAgent", "ray::RuntimeEnvAgent"}
AGENTS_LINGER_S = 90.0


def _sigterm_session(server: ServerProcess) -> None:
    for p in server.leftovers():
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass


# how -> (send the stop, expected exit status, a line the log must hold)
STOPS = {
    "group_sigterm": (lambda s: os.killpg(s.pid, signal.SIGTERM), 0, "shutting down"),
    "pid_sigint": (lambda s: s.proc.send_signal(signal.SIGINT), 0, "shutting down"),
    "session_sigterm": (_sigterm_session, 1, "shutdown: Ray's GCS stopped answering"),
    "pid_sigkill": (lambda s: s.proc.send_signal(signal.SIGKILL), -signal.SIGKILL, ""),
}


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory) -> dict[str, ServerProcess]:
    """One server for each selected stop, all started at once."""
    hows = sorted({item.callspec.params["how"] for item in request.session.items
                   if item.module is request.module and "how" in getattr(getattr(item, "callspec", None),
                                                                          "params", {})})
    work = tmp_path_factory.mktemp("shutdown")
    started = {}
    try:
        for how in hows:
            started[how] = ServerProcess(sys.executable, work / f"{how}.log", work,
                                         "--graceful-shutdown-timeout-s", str(DRAIN_S))
        yield started
    finally:
        for server in started.values():
            server.stop_for_good()


@pytest.mark.slow
@pytest.mark.timeout(900)
# The group signal (the one this module is about) runs under -m scenarios (a SIGTERM to the
# pid stays in the default run: tests/test_script_smokes.py's serve CLI test); the other
# stops each cost a server more, under -m cluster.
@pytest.mark.parametrize("how", [pytest.param(how, marks=[pytest.mark.scenarios if how == "group_sigterm"
                                                          else pytest.mark.cluster])
                                 for how in sorted(STOPS)])
def test_serve_stops_in_bound_and_leaves_nothing(servers, how):
    server = servers[how]
    send, status, line = STOPS[how]
    server.wait_ready()
    chat(server.port)
    assert server.ray_session_dir() is not None, "no Ray session directory named after the server's pid"
    procs = server.leftovers()
    assert any("raylet" in p.name() for p in procs)  # it runs its own Ray
    in_its_group = [(p.pid, p.name()) for p in procs if p.pid != server.pid and os.getpgid(p.pid) == server.pid]
    assert not in_its_group, f"a signal to pagedserve's process group reaches these too: {in_its_group}"
    t0 = time.monotonic()
    send(server)
    bound = DRAIN_S + SHUTDOWN_MARGIN_S
    try:
        code = server.proc.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{how}: still running {bound:.0f} s after the stop:\n{server.tail()}")
    assert code == status, f"{how}: exit {code} after {time.monotonic() - t0:.0f} s:\n{server.tail()}"
    assert line in server.text(), server.tail()
    left = server.wait_gone()
    if how == "pid_sigkill":
        assert {name for _, name in left} <= RAY_AGENTS, f"{how}: its processes outlived it: {left}"
        left = server.wait_gone(AGENTS_LINGER_S)
    assert not left, f"{how}: its processes outlived it: {left}"
