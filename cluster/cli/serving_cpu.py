"""The serving path on a node of its own: its core, plus the model's cores when they idle.

``pagedserve serve`` with a private Ray splits a CPU node (worker/cpu_affinity.py): the
model worker computes alone on its cores, and the serving path (Ray's proxy, the Serve
controller, the ingress, the engine replica, the stats aggregator, Ray's GCS and agents)
keeps the first core. Under a flood that one core saturates while the worker's idles
part of each step: the front end then queues every request, the steady tenant's too
(issue 15; docs/notes/benchmarks-history.md has the serving core's demand and the worker
core's idle share).
So once they run, the serving processes are moved onto every core of the
node at a low priority (nice ``SERVING_NICE``): on their own core they compete only with
each other, on the worker's they take only what it leaves (the kernel gives a nice-0
thread ~98% of a core against nice-19 ones and preempts them when it wakes).

Who is moved: this command's process and those below it whose title names a serving role.
Never the model workers, nor Ray's idle worker processes (one of them may become a model
worker, and a raised nice cannot be lowered back without privileges), nor the raylet that
starts them (its children inherit its nice). A pass every ``interval_s`` catches replicas
that Serve replaces and threads started since.
"""

from __future__ import annotations

import logging
import os
import threading

from pagedserve.worker.cpu_affinity import yield_process

logger = logging.getLogger("pagedserve")

SERVING_NICE = 19
# Ray actor titles (argv[0]) of the serving path, and Ray's own programs (an argv entry's
# file name); anything else, the model workers ("ray::RayWorkerWrapper") and Ray's idle
# workers ("ray::IDLE") among them, is left alone.
SERVING_TITLES = ("ray::ProxyActor", "ray::ServeController", "ray::ServeReplica", "ray::DashboardAgent",
                  "ray::RuntimeEnvAgent", "ray::HAProxyManager")
SERVING_PROGRAMS = ("gcs_server", "dashboard.py", "log_monitor.py", "monitor.py", "haproxy")


def is_serving(argv: list[str]) -> bool:
    if not argv:
        return False
    if argv[0].startswith("ray::"):
        return argv[0].startswith(SERVING_TITLES)
    return any(os.path.basename(a) in SERVING_PROGRAMS for a in argv[:3] if not a.startswith("-"))


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (from /proc's parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def serving_pids(root: int) -> list[int]:
    """``root`` (this command) and the serving processes below it (the module docstring)."""
    pids = [root]
    for pid in descendants(root):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if is_serving(argv):
            pids.append(pid)
    return pids


class ServingCPU:
    """A daemon thread that keeps the serving processes below ``root`` (default: this
    command) on ``cores`` at ``niceness``."""

    def __init__(self, cores: list[int], niceness: int = SERVING_NICE, interval_s: float = 2.0,
                 root: int | None = None) -> None:
        self.cores, self.niceness, self.interval_s = sorted(cores), niceness, interval_s
        self.root = os.getpid() if root is None else root  # the command whose processes these are
        self._done: dict[int, set[int]] = {}  # pid -> its threads already moved
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serving-cpu", daemon=True)

    def start(self) -> "ServingCPU":
        self.apply()
        self._thread.start()
        logger.info("CPU cores: the serving path may also use cores %s at nice %d (--serving-nice)",
                    ",".join(map(str, self.cores)), self.niceness)
        return self

    def stop(self) -> None:
        self._stop.set()

    def apply(self) -> int:
        """One pass; returns how many threads it moved."""
        live = serving_pids(self.root)
        self._done = {pid: self._done.get(pid, set()) for pid in live}
        return sum(yield_process(pid, self.cores, self.niceness, self._done[pid]) for pid in live)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.apply()
            except Exception:  # a best-effort placement: never take the server down
                logger.debug("serving CPU pass failed", exc_info=True)
