"""Start and stop OpenAI-compatible servers as subprocesses on 127.0.0.1.

Each server runs in its own session (``start_new_session``), so stopping it reaches the
children it spawned (Ray processes and actors, vLLM's engine core) and nothing else:

    start ──▶ poll GET /health until 200 (or the process dies / time runs out)
    stop  ──▶ SIGTERM to the server, wait ``grace`` s for it to exit, then SIGKILL
              whatever is left of its session

Logs go to a file per server so a failed start can show its tail.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``, read from /proc (Linux)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, name: str, cmd: list[str], port: int, *, env: dict | None = None,
                 log_dir: str | Path | None = None, cwd: str | Path | None = None) -> None:
        self.name, self.cmd, self.port = name, cmd, port
        self.env = {**os.environ, **(env or {})}
        # Not the checkout: its top-level folders (kernels/, scheduler/, ...) would shadow
        # PyPI packages of those names for a `python -m` server started there (transformers
        # imports Hugging Face's `kernels` if it finds one; vLLM's server then died on ours).
        self.cwd = cwd or tempfile.gettempdir()
        log_dir = Path(log_dir or "/tmp/loadtest-logs")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}-{port}.log"
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> "ServerProcess":
        t0 = time.perf_counter()
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.cwd, start_new_session=True)
        log.close()
        deadline = t0 + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during start-up:\n{self.tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f} s:\n{self.tail()}")

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        sid = self.proc.pid  # session leader: its pid is the session id
        # SIGTERM to the leader: it shuts its own children down in order (Serve, then Ray;
        # Ray's processes lead groups of their own, so a group signal would do the same).
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        # Leftovers: Ray actors move to their own process groups but stay in our session.
        deadline = time.monotonic() + 5.0
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in session_pids(sid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def pagedserve_command(model: str, port: int, python: str | None = None, **engine_args) -> list[str]:
    """``pagedserve serve`` with vLLM-style flags: ``enable_prefix_caching=False`` becomes
    ``--no-enable-prefix-caching``, ``max_num_seqs=8`` becomes ``--max-num-seqs 8``, and a
    list ``lora_modules=["a=/p", "b=/q"]`` becomes ``--lora-modules a=/p b=/q``."""
    cmd = [python or sys.executable, "-m", "pagedserve.cluster.cli.main", "serve", "--model", model,
           "--host", "127.0.0.1", "--port", str(port)]
    for key, value in engine_args.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            cmd += [flag, *map(str, value)]
        else:
            cmd += [flag, str(value)]
    return cmd


def pagedserve_server(model: str, *, log_dir=None, port: int | None = None, tree: str | Path | None = None,
                      **engine_args) -> ServerProcess:
    """``tree``: serve pagedserve from that checkout instead (e.g. a ``git worktree`` of the
    commit before a change, for a before/after row in one run), with this venv's packages:
    ``pagedserve`` then resolves to it through a path entry of its own."""
    port = port or free_port()
    env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    name = "pagedserve"
    if tree is not None:
        tree = Path(tree).resolve()
        link_dir = Path(tempfile.mkdtemp(prefix="pagedserve-tree-"))
        (link_dir / "pagedserve").symlink_to(tree)
        env["PYTHONPATH"] = str(link_dir)
        name = f"pagedserve-{tree.name}"
    return ServerProcess(name, pagedserve_command(model, port, **engine_args), port, env=env, log_dir=log_dir)
