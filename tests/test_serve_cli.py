"""``pagedserve serve`` as a user runs it: a subprocess that starts its own Ray on
127.0.0.1, logs the URL and the KV sizing once ready, answers the openai client, and on
SIGTERM exits 0 leaving none of the processes it started (Ray's GCS, raylet, workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import psutil

ROOT = Path(__file__).resolve().parent.parent


def test_serve_cli_starts_answers_and_leaves_nothing_behind(serve_model, tmp_path):
    from pagedserve.cluster.control.ray_utils import get_open_port

    port = get_open_port()
    log = tmp_path / "serve.log"
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "pagedserve.cluster.cli.main", "serve", "--model", serve_model, "--port", str(port),
           "--num-gpu-blocks-override", "64", "--max-model-len", "256", "--dtype", "float32"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "ready in" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        text = log.read_text()
        assert f"http://127.0.0.1:{port}/v1" in text
        assert "KV cache per replica: 64 blocks x 16 tokens = 1024 tokens" in text
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in p.name() for p in tree)  # it started its own Ray

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = client.completions.create(model="llama-gqa2-hd64", prompt="hi", max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
        time.sleep(1.0)
        alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
