"""The installed distribution has one top-level import name, ``pagedserve``, so it can be
installed beside the PyPI packages called ``kernels`` (Hugging Face's hub kernels),
``scheduler``, ``worker``, ``cluster`` or ``loadtest`` without shadowing them.

Every check runs in a fresh interpreter started outside the checkout, with no
PYTHONPATH: what it can import is what the installed distribution provides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

FOREIGN = ("kernels", "scheduler", "worker", "cluster", "loadtest")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, cwd, pythonpath: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_public_api_imports_from_outside_the_checkout(tmp_path):
    proc = _run("""
        from pagedserve import LLM, SamplingParams, EngineConfig, RequestOutput
        import pagedserve
        print(LLM.__module__, SamplingParams.__module__, pagedserve.__version__)
    """, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == ["pagedserve.cluster.llm", "pagedserve.scheduler.sampling_params"]


def test_distribution_exposes_no_other_top_level_name(tmp_path):
    # Other distributions may provide these names (transformers >= 5.25 installs Hugging
    # Face's ``kernels``): none of them may resolve into this checkout.
    proc = _run(f"""
        import importlib.util, importlib.metadata, json
        found = {{n: str(importlib.util.find_spec(n).origin) for n in {FOREIGN!r}
                 if importlib.util.find_spec(n) is not None
                 and str(importlib.util.find_spec(n).origin).startswith({ROOT!r} + "/" + n + "/")}}
        dist = importlib.metadata.distribution("pagedserve")
        top = (dist.read_text("top_level.txt") or "").split()
        print(json.dumps({{"found": found, "top_level": top,
                          "pagedserve": importlib.util.find_spec("pagedserve").origin}}))
    """, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["found"] == {}, f"importable from outside the checkout: {out['found']}"
    assert out["top_level"] in ([], ["pagedserve"])
    assert out["pagedserve"].endswith("__init__.py")


def test_foreign_scheduler_worker_cluster_first_on_path_do_not_break_generation(tmp_path):
    # Impostors, first on sys.path. If pagedserve imported a bare ``scheduler``, ``worker`` or
    # ``cluster`` anywhere (engine, worker, model, sampler), it would get these and fail.
    # ``kernels`` is no impostor any more: transformers >= 5.25 imports Hugging Face's own at
    # load, so a fake one breaks transformers itself; the test above checks that name.
    for name in ("scheduler", "worker", "cluster"):
        (tmp_path / "foreign" / name).mkdir(parents=True)
        (tmp_path / "foreign" / name / "__init__.py").write_text(f"FOREIGN = {name!r}\n")
    proc = _run("""
        import json, scheduler, worker, cluster
        assert (scheduler.FOREIGN, worker.FOREIGN, cluster.FOREIGN) == ("scheduler", "worker", "cluster")
        from pagedserve import LLM, SamplingParams
        from pagedserve.worker.loading.demo import demo_model_path
        llm = LLM(model=demo_model_path(), max_model_len=256, num_gpu_blocks_override=64, seed=0)
        try:
            outs = llm.generate(["Once upon a time", "hello"],
                                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        finally:
            llm.shutdown()
        import sys
        assert sys.modules["scheduler"].FOREIGN == "scheduler"  # still the impostors
        assert sys.modules["worker"].FOREIGN == "worker"
        print(json.dumps([o.outputs[0].token_ids for o in outs]))
    """, cwd=tmp_path, pythonpath=str(tmp_path / "foreign"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [len(t) for t in ids] == [8, 8]


def test_run_inside_the_checkout_the_folders_do_not_shadow_installed_packages():
    # `python -m` / `python -c` in the repository root put the root first on sys.path, where
    # `kernels/` would shadow Hugging Face's `kernels` (imported by transformers >= 5.25 at
    # load). Importing pagedserve first takes the root off the path.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys, os, importlib.util
        assert os.getcwd() in [os.path.abspath(p or ".") for p in sys.path]
        import pagedserve
        from transformers import LlamaConfig  # loads transformers.activations -> hub kernels
        spec = importlib.util.find_spec("kernels")
        assert spec is None or not spec.origin.startswith(os.path.join(os.getcwd(), "kernels", "")), spec.origin
        print("ok")
    """)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli = subprocess.run([sys.executable, "-m", "pagedserve.cluster.cli.main", "--help"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and "serve" in cli.stdout, cli.stderr[-3000:]
