"""CPU cores for the model and for the serving path (worker/cpu_affinity.py, vLLM's
VLLM_CPU_OMP_THREADS_BIND): core-list parsing, the "auto" split, what serve resolves it to,
and a worker that pins itself. The CLI test (test_serve_cli.py) checks the processes of a
real server."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from pagedserve.cluster.app import bound_worker_config, resolve_cpu_bind
from pagedserve.cluster.replica.serve_replica import cpu_threads
from pagedserve.config import EngineConfig
from pagedserve.worker.cpu_affinity import parse_bind, parse_core_list, plan_auto


def test_core_lists():
    assert parse_core_list("3") == [3]
    assert parse_core_list("0,2-4,7") == [0, 2, 3, 4, 7]
    for bad in ("", "1,,2", "a", "3-1", "1-", "2,2"):
        with pytest.raises(ValueError):
            parse_core_list(bad)


def test_bind_strings_name_one_list_per_rank():
    assert parse_bind("auto", 2) is None and parse_bind("nobind", 1) is None
    assert parse_bind("1-3|4-7", 2) == [[1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="tensor_parallel_size is 1"):
        parse_bind("1|2", 1)
    with pytest.raises(ValueError, match="share a core"):
        parse_bind("1-2|2-3", 2)
    with pytest.raises(ValueError):  # the config checks it up front
        EngineConfig(model="m", cpu_omp_threads_bind="1-x")


def test_auto_keeps_the_first_core_for_serving_and_splits_the_rest():
    assert plan_auto([0, 1], 1) == ([0], "1")
    assert plan_auto([3, 0, 1, 2], 1) == ([0], "1,2,3")
    assert plan_auto(list(range(8)), 2) == ([0], "1,2,3|4,5,6")  # 7 left over: even ranks
    assert plan_auto([0], 1) is None  # one core: nothing to split
    assert plan_auto([0, 1], 2) is None  # one compute core cannot hold two ranks


def test_serve_resolves_auto_only_for_one_cpu_replica_on_a_split_node():
    cfg = EngineConfig(model="m", device="cpu")
    resolved, serving = resolve_cpu_bind(cfg, single_replica=True, cores=[0, 1, 2, 3])
    assert serving == [0] and resolved.cpu_omp_threads_bind == "1,2,3"
    assert resolved.cpu_borrow_cores == "off"  # a rank of 3 cores: its OpenMP threads split the GEMMs
    assert resolve_cpu_bind(cfg, single_replica=False, cores=[0, 1, 2, 3]) == (cfg, None)  # autoscaled
    assert resolve_cpu_bind(cfg, single_replica=True, cores=[0]) == (cfg, None)
    nobind = dataclasses.replace(cfg, cpu_omp_threads_bind="nobind")
    assert resolve_cpu_bind(nobind, single_replica=True, cores=[0, 1]) == (nobind, None)
    gpu = dataclasses.replace(cfg, device="cuda")
    assert resolve_cpu_bind(gpu, single_replica=True, cores=[0, 1]) == (gpu, None)
    explicit = dataclasses.replace(cfg, cpu_omp_threads_bind="2-3")
    assert resolve_cpu_bind(explicit, single_replica=True, cores=[0, 1, 2, 3]) == \
        (dataclasses.replace(explicit, cpu_borrow_cores="off"), [0, 1])


def test_a_one_core_rank_borrows_the_serving_cores():
    cfg = EngineConfig(model="m", device="cpu")
    resolved, serving = resolve_cpu_bind(cfg, single_replica=True, cores=[0, 1])
    assert (serving, resolved.cpu_omp_threads_bind, resolved.cpu_borrow_cores) == ([0], "1", "0")
    one = dataclasses.replace(cfg, cpu_omp_threads_bind="3")
    assert resolve_cpu_bind(one, single_replica=True, cores=[0, 1, 2, 3])[0].cpu_borrow_cores == "0,1,2"
    two_ranks = dataclasses.replace(cfg, cpu_omp_threads_bind="1|2", tensor_parallel_size=2)
    assert resolve_cpu_bind(two_ranks, single_replica=True, cores=[0, 1, 2])[0].cpu_borrow_cores == "off"
    off = dataclasses.replace(cfg, cpu_borrow_cores="off")
    assert resolve_cpu_bind(off, single_replica=True, cores=[0, 1])[0].cpu_borrow_cores == "off"
    assert resolve_cpu_bind(cfg, single_replica=False, cores=[0, 1])[0].cpu_borrow_cores == "auto"  # no split
    with pytest.raises(ValueError):
        EngineConfig(model="m", cpu_borrow_cores="0-")


def test_a_bound_worker_runs_in_its_own_process_with_async_scheduling():
    cfg = EngineConfig(model="m", device="cpu", cpu_omp_threads_bind="1")
    b = bound_worker_config(cfg)
    assert b.distributed_executor_backend == "ray" and b.async_scheduling is True
    assert bound_worker_config(dataclasses.replace(cfg, async_scheduling=False)).async_scheduling is False
    assert cpu_threads(b).num_threads is None  # the worker takes one thread per core of its own
    with pytest.raises(ValueError, match="serving replica"):
        bound_worker_config(dataclasses.replace(cfg, distributed_executor_backend="uni"))
    unbound = EngineConfig(model="m", device="cpu")
    assert bound_worker_config(unbound) is unbound


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin one")
def test_a_worker_pins_every_thread_of_its_process_and_takes_a_thread_per_core(tmp_path):
    """In a fresh process (pinning is for the life of a process): threads started before
    init_device and the OpenMP pool started after it all run on the rank's cores."""
    core = max(os.sched_getaffinity(0))
    script = f"""
import os, threading, time, torch
from pagedserve.config import EngineConfig
from pagedserve.worker.worker import Worker
early = threading.Thread(target=time.sleep, args=(5,), daemon=True)
early.start()
w = Worker(EngineConfig(model="unused", device="cpu", cpu_omp_threads_bind="{core}"))
w.init_device()
torch.ones(1 << 20).sum()  # starts the OpenMP pool
masks = {{tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}}
print("MASKS", masks, torch.get_num_threads())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("MASKS")][0]
    assert line == f"MASKS {{({core},)}} 1"
