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

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pagedserve.cluster.cli.serve import SHUTDOWN_MARGIN_S

# A short drain for an idle server: the bound every stop below is held to is DRAIN_S + margin.
DRAIN_S = 10.0
# The raylet's agents outlive a SIGKILLed server until their report of the raylet's death to
# the GCS times out (ray._private.utils.publish_error_to_driver waits 60 s).
RAY_AGENTS = {"ray::DashboardAgent", "ray::RuntimeEnvAgent"}
AGENTS_LINGER_S = 90.0
SMALL = ["--num-gpu-blocks-override", "64", "--max-model-len", "1024"]


class ServerProcess:
    """``pagedserve serve --model pagedserve-demo`` as a user starts it (``python`` runs it),
    in a session of its own, its output in a log file. Knows the processes it started:
    those of its session, and any that names the Ray session directory it created (Ray
    names it after the starting pid)."""

    def __init__(self, python: str, log: Path, cwd: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        from pagedserve.cluster.ray_utils import get_open_port

        self.port, self.log = get_open_port(), log
        cmd = [python, "-m", "pagedserve.cluster.cli.main", "serve", "--model", "pagedserve-demo",
               "--port", str(self.port), *SMALL, *extra]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.pid = self.proc.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, n: int = 4000) -> str:
        return self.text()[-n:]

    def wait_ready(self, timeout_s: float = 420.0) -> None:
        t0 = time.monotonic()
        while "ready in" not in self.text():
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.tail()}"
            assert time.monotonic() - t0 < timeout_s, f"not ready in {timeout_s:.0f} s:\n{self.tail()}"
            time.sleep(0.5)

    def ray_session_dir(self) -> str | None:
        found = glob.glob(os.path.join(tempfile.gettempdir(), "ray", f"session_*_{self.pid}"))
        return found[0] if found else None

    def leftovers(self) -> list[psutil.Process]:
        """Its processes still running (zombies have finished)."""
        session_dir = self.ray_session_dir()
        out = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                mine = os.getsid(p.pid) == self.pid or (
                    session_dir is not None and any(session_dir in a for a in p.info["cmdline"] or ()))
                if mine and p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (psutil.Error, ProcessLookupError, PermissionError):
                pass
        return out

    def wait_gone(self, timeout_s: float = 15.0) -> list[tuple[int, str]]:
        """(pid, name) of its processes still running after ``timeout_s``: Ray's workers
        exit once they see their raylet go, a moment after it."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = self.leftovers()
            if not left or time.monotonic() > deadline:
                return [(p.pid, p.name()) for p in left]
            time.sleep(0.5)

    def stop_for_good(self) -> None:
        """SIGKILL whatever is left of it (a failed test's cleanup)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for p in self.leftovers():
            try:
                p.kill()
            except psutil.Error:
                pass


def chat(port: int) -> dict:
    """One chat completion over HTTP; the demo model's words are random, its shape is not."""
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                   json={"model": "pagedserve-demo", "max_tokens": 8, "temperature": 0,
                         "messages": [{"role": "user", "content": "Say hello."}]})
    assert r.status_code == 200, r.text
    body = r.json()
    [choice] = body["choices"]
    assert body["model"] == "pagedserve-demo"
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    assert 0 < body["usage"]["completion_tokens"] <= 8
    return body


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
