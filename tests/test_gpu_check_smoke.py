"""The one prepared GPU script (python -m pagedserve.loadtest.gpu_check) runs end to end
on the CPU with --cpu-smoke: every section (kernel correctness through the Triton
interpreter, bandwidth, the engine vs transformers) and its JSON. A GPU session has ~15
minutes of device time; a script that breaks there wastes it, so it is checked here."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_gpu_check_cpu_smoke(tmp_path):
    out = tmp_path / "gpu.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "pagedserve.loadtest.gpu_check", "--cpu-smoke", "--json", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["correctness"] and all(v["ok"] for v in res["correctness"].values()), res["correctness"]
    assert any(k.startswith("decode") for k in res["bandwidth"])
    e2e = res["e2e"]
    assert "error" not in e2e, e2e
    assert {"batch 1", "batch 4"} <= set(e2e) and all(e2e[k]["engine_tok_s"] > 0 for k in ("batch 1", "batch 4"))
    # graphs (off on a CPU) and enforce_eager: both ran, greedy tokens equal
    assert all(e2e[k]["eager_tok_s"] > 0 and e2e[k]["seqs_equal_graphs_eager"] == e2e[k]["seqs"]
               for k in ("batch 1", "batch 4"))
    assert "=== pagedserve gpu_check" in proc.stdout
