"""python -m pagedserve.loadtest.bench_vs_vllm runs end to end in its small form (no vLLM
peer in CI: --no-vllm) and its last line is the JSON summary the issue asks for."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_vs_vllm_quick_prints_the_summary(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PAGEDSERVE_CACHE"] = os.environ.get("PAGEDSERVE_CACHE", str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "pagedserve.loadtest.bench_vs_vllm", "--quick", "--no-vllm",
                           "--hf-prompts", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("cpu", "pagedserve_tok_s", "ratio_vs_hf_static", "b1_tok_s", "b1_bound_tok_s",
                "b1_fraction_of_bound", "b1_fraction_of_read_bound", "cpu_linear_backend"):
        assert key in summary, key
    # The copy bound counts each byte once, while a copy moves it up to three times (it reads
    # the source, reads the destination's line before writing it, writes it back): a step that
    # only reads can beat it by up to that. (The panel GEMM reads its weights from huge pages,
    # the copy runs on 4 KB ones: on an AVX2 Zen 2 a step beats twice the copy bound.)
    assert summary["pagedserve_tok_s"] > 0 and 0 < summary["b1_fraction_of_bound"] < 3.0
    # A step reads its weights: the read bound is at least the copy one (a copy moves bytes 2-3 times).
    assert 0 < summary["b1_fraction_of_read_bound"] <= summary["b1_fraction_of_bound"] * 1.2
    assert 220 < summary["weight_mb_per_step"] < 235  # the 63M bench Llama's 226.5 MB, packed or not
