"""GGUF GEMMs on borrowed cores (kernels/cpu_borrowed_cores.h, ``--cpu-borrow-cores``): helper
threads at SCHED_IDLE on the serving cores take chunks of each GEMM; the calling thread never
waits for one that is preempted, it takes the chunk back. Every chunk is computed by the same
code, so the results are bit-identical to the GEMM without helpers, even while a busy process
on the helpers' core preempts them mid-chunk (and chunks are taken back)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from _gguf_helpers import quantize
from pagedserve.kernels import cpu_gguf

pytestmark = pytest.mark.skipif(not cpu_gguf.available() or len(os.sched_getaffinity(0)) < 2,
                                reason="the GGUF C++ extension does not build here, or one core")

ROWS = (1, 2, 3, 8, 17, 70)  # the register paths up to 4 rows, the strip path beyond


@pytest.fixture
def helper_core():
    """A core for the helper, the test's own thread on the others."""
    cores = sorted(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores[1:])
    yield cores[0]
    cpu_gguf.borrow_cores([])
    os.sched_setaffinity(0, before)


def _cases():
    out = []
    for qtype in cpu_gguf.QTYPES:
        k = 512 if cpu_gguf.BLOCKS[qtype][0] == 256 else 576
        w = np.random.default_rng(1).standard_normal((1533, k)).astype(np.float32) * 0.05
        part = cpu_gguf.pack(torch.from_numpy(quantize(w, qtype)), qtype, k)
        for int8 in (False, True):
            weight = cpu_gguf.GGUFWeight([part], int8=int8)
            for m in ROWS:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                out.append((f"{qtype} int8={int8} M={m}", weight, x, torch.randn(1533) if m % 2 else None))
    return out


def _busy(core: int) -> subprocess.Popen:
    """A nice-0 process on ``core`` that runs 0.3 ms, sleeps 0.3 ms: it preempts the helper."""
    code = "import time\nwhile True:\n  t = time.time()\n  while time.time() - t < 3e-4: pass\n  time.sleep(3e-4)"
    return subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", code])


def test_helpers_give_the_same_bits_even_when_preempted(helper_core):
    cases = _cases()
    alone = [cpu_gguf.linear(x, w, b) for _, w, x, b in cases]
    assert cpu_gguf.borrow_cores([helper_core]) == 1
    helped0, stolen0 = cpu_gguf.borrowed_counts()
    busy = _busy(helper_core)
    try:
        for _ in range(10):
            for (name, w, x, b), ref in zip(cases, alone):
                assert torch.equal(cpu_gguf.linear(x, w, b), ref), name
    finally:
        busy.kill()
    for (name, w, x, b), ref in zip(cases, alone):  # and with the core to itself
        assert torch.equal(cpu_gguf.linear(x, w, b), ref), name
    helped, stolen = cpu_gguf.borrowed_counts()
    assert helped > helped0  # the helper did take chunks


def test_helpers_run_at_sched_idle_on_their_core(helper_core):
    before = set(os.listdir("/proc/self/task"))
    assert cpu_gguf.borrow_cores([helper_core]) == 1 and cpu_gguf.borrowed_cores() == [helper_core]
    x = torch.randn(1, 576)
    w = cpu_gguf.GGUFWeight([cpu_gguf.pack(torch.from_numpy(quantize(np.ones((64, 576), np.float32), "Q8_0")),
                                           "Q8_0", 576)])
    cpu_gguf.linear(x, w)  # (borrow_cores returned with the helper placed; a job does not move it)
    new = [int(t) for t in set(os.listdir("/proc/self/task")) - before]
    policies = {}
    for tid in new:
        stat = open(f"/proc/self/task/{tid}/stat").read()
        policies[tid] = int(stat[stat.rindex(")") + 2:].split()[38])  # field 41: the policy
    helpers = [t for t, p in policies.items() if p == 5]  # SCHED_IDLE
    assert len(helpers) == 1, policies
    assert os.sched_getaffinity(helpers[0]) == {helper_core}
    assert cpu_gguf.borrow_cores([]) == 0 and cpu_gguf.borrowed_cores() == []
    assert not (set(os.listdir("/proc/self/task")) - before)  # stopped and joined
