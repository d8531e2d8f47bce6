"""The prepared scripts end to end, as a user runs them: ``compare --quick`` and
``bench_frontend`` against real pagedserve servers, and ``gpu_check --cpu-smoke``.

They run two at a time, started together by the module's fixture: compare in one lane,
bench_frontend then gpu_check in the other. A script that starts a server waits on it much
of the time (Ray, Serve and the engine coming up), which the other lane fills. Each asserts
structure and accounting, never the speed of this machine, so sharing the cores changes no
assertion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPARE_SCENARIOS = ["prefix-caching", "mixed-saturation", "rate-sweep"]


def _lane(jobs: list[tuple[Future, dict]]) -> None:
    for fut, kw in jobs:
        try:
            fut.set_result(subprocess.run(capture_output=True, text=True, **kw))
        except Exception as e:  # a timeout: the test that waits on it reports it
            fut.set_exception(e)


TESTS = {"test_compare_quick_smoke": "compare", "test_bench_frontend_prices_each_kind_by_process": "bench_frontend",
         "test_gpu_check_cpu_smoke": "gpu_check"}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, tuple[Future, Path]]:
    """Every selected test's script, started at once in two lanes."""
    from pagedserve.worker.random_models import make_random_llama

    work = {name: tmp_path_factory.mktemp(name) for name in ("compare", "bench_frontend", "gpu_check")}
    model = work["bench_frontend"] / "m"
    make_random_llama(model, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
    no_path = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmds = {
        "compare": dict(args=[sys.executable, "-m", "pagedserve.loadtest", "compare", "--quick", "--no-peers",
                              "--result-dir", str(work["compare"] / "cmp"), "--scenarios", *COMPARE_SCENARIOS],
                        cwd=ROOT, timeout=280),
        "bench_frontend": dict(args=[sys.executable, "-m", "pagedserve.loadtest.bench_frontend", "--model", str(model),
                                     "--rounds", "1", "--kinds", "models:20", "bad400:20", "tok1:12", "stream64:6"],
                               cwd=ROOT, timeout=280),
        "gpu_check": dict(args=[sys.executable, "-m", "pagedserve.loadtest.gpu_check", "--cpu-smoke", "--json",
                                str(work["gpu_check"] / "gpu.json")], cwd=work["gpu_check"], env=no_path, timeout=600),
    }
    wanted = {TESTS[i.name] for i in request.session.items if i.module is request.module and i.name in TESTS}
    futures = {name: Future() for name in cmds if name in wanted}
    for lane in (["compare"], ["bench_frontend", "gpu_check"]):
        jobs = [(futures[n], cmds[n]) for n in lane if n in futures]
        threading.Thread(target=_lane, args=(jobs,), daemon=True).start()
    yield {name: (futures[name], work[name]) for name in futures}
    for fut in futures.values():  # a test that failed early must not leave a script running past the module
        try:
            fut.result(timeout=700)
        except Exception:
            pass


def _finished(runs, name: str) -> tuple[subprocess.CompletedProcess, Path]:
    fut, work = runs[name]
    proc = fut.result(timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, work


@pytest.mark.timeout(600)
def test_compare_quick_smoke(runs):
    """compare --quick end to end on the scenarios that share the default server (one
    server start; every other configuration costs a start of its own, and their
    schedulers are covered in process: static batching in test_scheduler_policies,
    contiguous KV in test_kv_cache_manager). Asserts the report's structure and that
    every request of every run was accounted for, not the speed of this machine."""
    _, work = _finished(runs, "compare")
    out = work / "cmp"
    report = json.loads((out / "compare.json").read_text())
    assert report["errors"] == []
    assert list(report["server_startup_s"]) == ["default"]
    assert {r["scenario"] for r in report["rows"]} == set(COMPARE_SCENARIOS)
    for r in report["rows"]:
        assert set(r) >= {"metric", "baseline_value", "ours_value", "ratio", "goal", "met"}
    assert set(report["requests"]) == {"prefix-caching/prefix-on", "prefix-caching/prefix-off",
                                       "mixed-saturation/mixed"}
    for name, acc in report["requests"].items():
        assert acc["completed"] + acc["cancelled"] + acc["failed"] == acc["num_requests"], name
        assert acc["failed"] == 0, name
    mixed = next(r for r in report["rows"] if r["metric"].startswith("requests accounted"))
    assert mixed["met"] is True
    assert (out / "summary.md").read_text().count("| ") > 10
    assert (out / "latency_cdf.png").exists() and (out / "rate_sweep.png").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_frontend_prices_each_kind_by_process(runs):
    """bench_frontend against a real server: every kind gets the status it should, and the
    CPU it reports is attributed to the processes of the serving path."""
    proc, _ = _finished(runs, "bench_frontend")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    codes = {k: out[k]["rounds"][0]["codes"] for k in ("models", "bad400", "tok1", "stream64")}
    assert codes == {"models": {"200": 20}, "bad400": {"400": 20}, "tok1": {"200": 12}, "stream64": {"200": 6}}
    tok1 = out["tok1"]["rounds"][0]["cpu_ms_per_request"]
    assert tok1["ingress"] > 0 and tok1["engine replica"] > 0 and tok1["proxy"] > 0, tok1
    # 64 streamed tokens cost the serving path more than one token does
    assert out["stream64"]["serving_ms_per_request"] > out["tok1"]["serving_ms_per_request"] > 0
    assert out["serving_ms_per_token"] > 0


@pytest.mark.timeout(900)
def test_gpu_check_cpu_smoke(runs):
    """The one prepared GPU script (python -m pagedserve.loadtest.gpu_check) runs end to end
    on the CPU with --cpu-smoke: every section (kernel correctness through the Triton
    interpreter, bandwidth, the engine vs transformers) and its JSON. A GPU session has ~15
    minutes of device time; a script that breaks there wastes it, so it is checked here."""
    proc, work = _finished(runs, "gpu_check")
    res = json.loads((work / "gpu.json").read_text())
    assert res["correctness"] and all(v["ok"] for v in res["correctness"].values()), res["correctness"]
    assert any(k.startswith("decode") for k in res["bandwidth"])
    e2e = res["e2e"]
    assert "error" not in e2e, e2e
    assert {"batch 1", "batch 4"} <= set(e2e) and all(e2e[k]["engine_tok_s"] > 0 for k in ("batch 1", "batch 4"))
    # graphs (off on a CPU) and enforce_eager: both ran, greedy tokens equal
    assert all(e2e[k]["eager_tok_s"] > 0 and e2e[k]["seqs_equal_graphs_eager"] == e2e[k]["seqs"]
               for k in ("batch 1", "batch 4"))
    # speculative decoding on vs off: both ran, greedy tokens equal, drafts accepted
    for k in ("spec batch 1", "spec batch 4"):
        assert e2e[k]["spec_tok_s"] > 0 and e2e[k]["seqs_equal"] == e2e[k]["seqs"], e2e[k]
    assert e2e["spec batch 1"]["acceptance_rate"] > 0
    assert "=== pagedserve gpu_check" in proc.stdout
