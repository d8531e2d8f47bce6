"""Which cores a CPU worker computes on, and which ones the serving path keeps.

vLLM's CPU backend binds its worker's OpenMP threads to cores and leaves one core to its
API server (``VLLM_CPU_OMP_THREADS_BIND``); ``cpu_omp_threads_bind`` takes its values:

    "auto"      ``pagedserve serve`` with a private Ray on a CPU node of >= 2 cores, one
                engine replica: the first core serves (Ray's proxy, the ingress, the engine
                replica's event loop and scheduler), the others compute, split evenly over
                the tensor-parallel ranks; everywhere else the same as "nobind"
    "nobind"    no pinning: threads float over the cores the process sees
    "1-3|4-7"   explicit, one core list per rank, "|" between ranks (``1,3-5`` style lists)

Why a split and not every core for the model: on a 2-core box the serving path takes a
large share of a core, in many short wake-ups. They preempted the step thread on its
own core (a 1-thread worker spent part of its step time runnable but waiting, with many
involuntary context switches) and, inside the engine replica's process, the step waited
for the GIL behind the event loop. A worker in a process of its own, alone on its core,
with the serving processes on the other, serves more HTTP output at 8 concurrent streams
(docs/notes/benchmarks-history.md). Two OpenMP threads across both cores with the serving
path on one of them did worse than the split: a static OpenMP split waits for its preempted half.

The split is not a wall the other way: once Serve runs, cluster/cli/serving_cpu.py lets
the serving processes onto the model's cores too, at nice 19 (``yield_process`` below), so
they use what the model leaves idle without preempting it.

No ray here: the serving side (cluster/) decides and pins its own processes; a worker pins
itself from the resolved string it is given.
"""

from __future__ import annotations

import os

AUTO, NOBIND = "auto", "nobind"


def parse_core_list(text: str) -> list[int]:
    """``"1,3-5"`` -> [1, 3, 4, 5]."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty core in {text!r}")
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad core list {text!r}: use e.g. '1', '1,3' or '2-5'")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"bad core range {part!r} in {text!r}")
        cores.extend(range(a, b + 1))
    if len(set(cores)) != len(cores):
        raise ValueError(f"a core appears twice in {text!r}")
    return cores


def format_core_list(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def parse_bind(text: str, tensor_parallel_size: int) -> list[list[int]] | None:
    """The cores of each rank, or None for "auto"/"nobind" (nothing explicit to pin)."""
    if text in (AUTO, NOBIND):
        return None
    ranks = [parse_core_list(t) for t in text.split("|")]
    if len(ranks) != tensor_parallel_size:
        raise ValueError(f"cpu_omp_threads_bind {text!r} names {len(ranks)} core lists, but "
                         f"tensor_parallel_size is {tensor_parallel_size} (one list per rank, '|' between).")
    seen = [c for r in ranks for c in r]
    if len(set(seen)) != len(seen):
        raise ValueError(f"cpu_omp_threads_bind {text!r}: two ranks share a core.")
    return ranks


def plan_auto(cores: list[int], tensor_parallel_size: int, reserved: int = 1) -> tuple[list[int], str] | None:
    """"auto" on a node whose usable cores are ``cores``: (the serving cores, the explicit
    bind string for the ranks), or None when there are too few cores to split."""
    cores = sorted(cores)
    compute = cores[reserved:]
    if reserved < 1 or len(compute) < tensor_parallel_size:
        return None
    per = len(compute) // tensor_parallel_size
    ranks = [compute[r * per:(r + 1) * per] for r in range(tensor_parallel_size)]
    return cores[:reserved], "|".join(format_core_list(r) for r in ranks)


def pin_this_process(cores: list[int]) -> None:
    """Every thread of this process, and the ones it starts later (they inherit the
    mask of the thread that starts them), onto ``cores``."""
    yield_process(os.getpid(), cores, None)
    os.sched_setaffinity(0, cores)


def yield_process(pid: int, cores: list[int], niceness: int | None, done: set[int] | None = None) -> int:
    """Every thread of process ``pid`` onto ``cores`` and, unless it is None, at ``niceness``
    (only ever raised: an unprivileged user may lower its own priority, not raise it back).
    Threads whose id is in ``done`` are skipped, and the ones changed are added to it.
    Threads a changed thread starts later inherit both. Returns how many threads changed."""
    mask, n = set(cores), 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # the process ended
        return 0
    for tid in tids:
        if done is not None and tid in done:
            continue
        try:
            os.sched_setaffinity(tid, mask)
            if niceness is not None and os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)  # Linux: per thread
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            continue
        n += 1
        if done is not None:
            done.add(tid)
    return n
