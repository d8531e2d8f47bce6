"""``pagedserve serve --model pagedserve-demo`` as a user starts it, for the tests that need
the whole command (its own Ray, its HTTP ingress, its shutdown): tests/test_serve_shutdown.py,
tests/test_serve_haproxy.py."""

from __future__ import annotations

import glob
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import psutil

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
