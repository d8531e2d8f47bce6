"""Run a test module as a script under the Triton interpreter and collect its JSON lines.

TRITON_INTERPRET=1 must be in the environment when ``@triton.jit`` runs (when the kernel
modules are first imported), and pytest imports every test module into one process, so
interpreter cases run in child processes; each prints one ``{"case": ..., "result": ...}``
line per case (``emit``). The interpreter computes on one core: the cases are dealt
round-robin over one child per core.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARD_ENV = "PAGEDSERVE_INTERP_SHARD"  # "i/n": this child runs cases i, i + n, i + 2n, ...
_case_index = itertools.count()


def interpreter_results(script: str, timeout: int = 900) -> dict:
    n = max(1, min(4, len(os.sched_getaffinity(0))))
    children = [subprocess.Popen([sys.executable, script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=dict(os.environ, TRITON_INTERPRET="1", **{SHARD_ENV: f"{i}/{n}"}))
                for i in range(n)]
    out = {}
    try:
        for child in children:
            stdout, stderr = child.communicate(timeout=timeout)
            for line in stdout.splitlines():
                if line.startswith("{"):
                    rec = json.loads(line)
                    out[rec["case"]] = rec["result"]
            assert child.returncode == 0, stderr[-4000:]
    finally:
        for child in children:  # the others, when one failed
            if child.poll() is None:
                child.kill()
                child.wait()
    return out


def emit(case: str, run) -> None:
    """In a child: ``{"case": case, "result": run()}``, if the case is this child's."""
    shard, n = (int(x) for x in os.environ.get(SHARD_ENV, "0/1").split("/"))
    if next(_case_index) % n == shard:
        print(json.dumps({"case": case, "result": run()}), flush=True)


def aot_compiled(flag: str) -> int:
    """``loadtest.kernel_checks.aot <flag>`` (frontend + ptxas for sm_90, no GPU, no
    interpreter): asserts it succeeded and returns how many variants compiled."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "pagedserve.loadtest.kernel_checks.aot", flag], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.count("OK ")


def gemm_cases_within_rounding(script: str, cases: dict) -> dict:
    """A weight-only GEMM's interpreter cases (``{"err", "scale", "dtype"}`` each, their names
    saying fp32 or fp16): every case ran, and its max error is within the activations'
    rounding of the output's scale. Returns the results."""
    import pytest

    pytest.importorskip("triton")
    results = interpreter_results(script, timeout=300)
    assert set(results) == set(cases)
    for name, r in results.items():
        tol = 1e-5 if "fp32" in name else 2e-3  # fp16: the tile and the output rounded to fp16
        assert r["err"] <= tol * max(1.0, r["scale"]), (name, r)
    return results
