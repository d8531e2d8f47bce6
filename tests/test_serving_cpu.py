"""cluster/cli/serving_cpu.py: which processes the serving path's placement moves, and
that it moves every thread of one (its cores, its nice) and leaves the rest alone. The whole
server is checked in test_serve_cli.py (the model worker at nice 0 on its cores, the Serve
processes on every core at nice 19)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pagedserve.cluster.cli.serving_cpu import ServingCPU, descendants, is_serving, serving_pids
from pagedserve.worker.cpu_affinity import yield_process


def test_serving_titles_and_what_is_never_moved():
    for argv in (["ray::ProxyActor"], ["ray::ServeReplica:pagedserve:OpenAIIngress"],
                 ["ray::ServeController.listen_for_change"], ["ray::DashboardAgent"],
                 ["/x/ray/core/src/ray/gcs/gcs_server", "--log_dir=/tmp"],
                 ["/v/bin/python", "-u", "/v/ray/_private/log_monitor.py", "--session-dir=x"],
                 ["/v/bin/python", "/v/ray/dashboard/dashboard.py", "--host=127.0.0.1"]):
        assert is_serving(argv), argv
    for argv in (["ray::RayWorkerWrapper"], ["ray::RayWorkerWrapper.execute_model"], ["ray::IDLE"],
                 ["/x/ray/core/src/ray/raylet/raylet", "--raylet_socket_name=/tmp/gcs_server"],
                 ["bash", "-c", "sleep 1"], []):
        assert not is_serving(argv), argv


def _threads_of(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def test_a_process_is_moved_thread_by_thread_and_only_down_in_priority():
    # A child with three threads, on one core at nice 0.
    code = "import threading, time\nfor _ in range(2): threading.Thread(target=time.sleep, args=(30,)).start()\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while len(_threads_of(child.pid)) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cores = sorted(os.sched_getaffinity(0))
        for tid in _threads_of(child.pid):
            os.sched_setaffinity(tid, cores[:1])
        done: set[int] = set()
        assert yield_process(child.pid, cores, 7, done) == 3
        for tid in _threads_of(child.pid):
            assert sorted(os.sched_getaffinity(tid)) == cores
            assert os.getpriority(os.PRIO_PROCESS, tid) == 7
        assert yield_process(child.pid, cores, 7, done) == 0  # nothing new
        # A lower nice than a thread already has is never applied (it could not be undone).
        os.setpriority(os.PRIO_PROCESS, child.pid, 12)
        assert yield_process(child.pid, cores, 7) == 3
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == 12
        assert child.pid in descendants(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert yield_process(child.pid, cores, 7) == 0  # gone: nothing to do, no error


def test_the_keeper_moves_serving_children_and_leaves_others():
    cores = sorted(os.sched_getaffinity(0))
    # a "command" with a Serve proxy and a model worker below it (argv[0] as Ray titles them)
    root = subprocess.Popen(["bash", "-c", "(exec -a ray::ProxyActor sleep 30) & "
                             "(exec -a ray::RayWorkerWrapper sleep 30) & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(descendants(root.pid)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)  # both exec'd
        kids = {open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")[0].decode(): p for p in descendants(root.pid)}
        assert serving_pids(root.pid) == [root.pid, kids["ray::ProxyActor"]]
        keeper = ServingCPU(cores, niceness=5, root=root.pid)
        assert keeper.apply() == 2  # one thread each: the command and the proxy
        assert os.getpriority(os.PRIO_PROCESS, kids["ray::ProxyActor"]) == 5
        assert os.getpriority(os.PRIO_PROCESS, kids["ray::RayWorkerWrapper"]) == 0
        assert keeper.apply() == 0  # already done
    finally:
        for p in descendants(root.pid):
            os.kill(p, 9)
        root.wait()
