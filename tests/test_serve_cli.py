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
    from pagedserve.cluster.ray_utils import get_open_port

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
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= 2:  # --cpu-omp-threads-bind auto: the model on its cores, the rest on the first
            assert f"CPU cores: serving path {cores[0]}, model ranks {','.join(map(str, cores[1:]))}" in text
            # ... and the serving path may use every core at nice 19 (--serving-nice)
            assert f"may also use cores {','.join(map(str, cores))} at nice 19" in text
            procs = {p.pid: (" ".join(p.cmdline()), p.cpu_affinity(), p.nice()) for p in tree}
            procs[proc.pid] = ("cli", psutil.Process(proc.pid).cpu_affinity(), psutil.Process(proc.pid).nice())
            base = os.getpriority(os.PRIO_PROCESS, 0)  # this test's nice: what the CLI started with
            workers = [(m, n) for name, m, n in procs.values() if "RayWorkerWrapper" in name]
            assert workers == [(cores[1:], base)], procs  # above the serving path, alone on its cores
            titles = ("cli", "ray::ProxyActor", "ray::ServeController", "ray::ServeReplica:pagedserve:OpenAIIngress",
                      "ray::ServeReplica:pagedserve:EngineDeployment")
            for t in titles:
                assert [(m, n) for name, m, n in procs.values() if name.startswith(t)] == [(cores, 19)], (t, procs)
            # the raylet starts workers: its nice is theirs, so it keeps it (and the first core)
            assert [(m, n) for name, m, n in procs.values() if name.split(" ")[0].endswith("/raylet")] == \
                [(cores[:1], base)], procs

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        # vLLM's id and root: --model as given (the CLI resolved it, and must not show that).
        [card] = client.models.list().data
        assert card.id == card.root == serve_model
        r = client.completions.create(model=serve_model, prompt="hi", max_tokens=5,
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


def test_cli_names_the_model_as_vllm_does(serve_model):
    """--served-model-name wins for the id; root (and the default id) is --model as given,
    a built-in name included. No Ray: only the argument parsing and resolution the serve
    command runs first."""
    from pagedserve.cluster.cli.args import engine_config_from_args, resolve_model_or_exit
    from pagedserve.cluster.cli.main import build_parser

    def cfg(*argv):
        args = build_parser().parse_args(["serve", *argv])
        return resolve_model_or_exit(engine_config_from_args(args))

    plain = cfg("--model", serve_model)
    assert (plain.served_model_name, plain.model_root) == (serve_model, serve_model)
    named = cfg("--model", serve_model, "--served-model-name", "my-llama", "--max-logprobs", "-1")
    assert (named.served_model_name, named.model_root, named.max_logprobs) == ("my-llama", serve_model, -1)
    demo = cfg("--model", "pagedserve-demo")
    assert (demo.served_model_name, demo.model_root) == ("pagedserve-demo", "pagedserve-demo")
    assert demo.model != "pagedserve-demo"  # the engine loads the resolved directory
    assert build_parser().parse_args(["generate", "--prompt", "x", "--max-logprobs", "5"]).max_logprobs == 5
