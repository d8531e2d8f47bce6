"""bench_frontend against a real server: every kind gets the status it should, and the CPU
it reports is attributed to the processes of the serving path (not the speed of this box)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_frontend_prices_each_kind_by_process(tmp_path):
    from pagedserve.worker.random_models import make_random_llama

    model = tmp_path / "m"
    make_random_llama(model, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
    cmd = [sys.executable, "-m", "pagedserve.loadtest.bench_frontend", "--model", str(model), "--rounds", "1",
           "--kinds", "models:20", "bad400:20", "tok1:12", "stream64:6"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    codes = {k: out[k]["rounds"][0]["codes"] for k in ("models", "bad400", "tok1", "stream64")}
    assert codes == {"models": {"200": 20}, "bad400": {"400": 20}, "tok1": {"200": 12}, "stream64": {"200": 6}}
    tok1 = out["tok1"]["rounds"][0]["cpu_ms_per_request"]
    assert tok1["ingress"] > 0 and tok1["engine replica"] > 0 and tok1["proxy"] > 0, tok1
    # 64 streamed tokens cost the serving path more than one token does
    assert out["stream64"]["serving_ms_per_request"] > out["tok1"]["serving_ms_per_request"] > 0
    assert out["serving_ms_per_token"] > 0
