"""The engine replica's CPU threads (cluster/replica/serve_replica.py cpu_threads): Ray gives a 1-CPU actor
OMP_NUM_THREADS=1; a deployment's only engine replica takes the cores it sees instead,
split among its tensor-parallel ranks, unless --num-threads chose."""

import dataclasses
import os

from pagedserve.cluster.replica.serve_replica import cpu_threads
from pagedserve.config import EngineConfig


def test_only_replica_takes_the_cores_split_among_ranks():
    cores = len(os.sched_getaffinity(0))
    cfg = EngineConfig(model="unused", device="cpu")
    assert cpu_threads(cfg).num_threads == cores
    tp2 = dataclasses.replace(cfg, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert cpu_threads(tp2).num_threads == max(1, cores // 2)
    assert cpu_threads(dataclasses.replace(cfg, num_threads=3)).num_threads == 3  # --num-threads wins
    assert cpu_threads(dataclasses.replace(cfg, device="cuda")).num_threads is None
