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
    proc = _run(f"""
        import importlib.util, importlib.metadata, json
        found = {{n: str(importlib.util.find_spec(n).origin) for n in {FOREIGN!r}
                 if importlib.util.find_spec(n) is not None}}
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


def test_foreign_kernels_and_scheduler_first_on_path_do_not_break_generation(tmp_path):
    # Two impostors, first on sys.path. If pagedserve imported a bare ``kernels`` or
    # ``scheduler`` anywhere (engine, worker, model, sampler), it would get these and fail.
    for name in ("kernels", "scheduler"):
        (tmp_path / "foreign" / name).mkdir(parents=True)
        (tmp_path / "foreign" / name / "__init__.py").write_text(f"FOREIGN = {name!r}\n")
    proc = _run("""
        import json, kernels, scheduler
        assert kernels.FOREIGN == "kernels" and scheduler.FOREIGN == "scheduler"
        from pagedserve import LLM, SamplingParams
        from pagedserve.worker.demo import demo_model_path
        llm = LLM(model=demo_model_path(), max_model_len=256, num_gpu_blocks_override=64, seed=0)
        try:
            outs = llm.generate(["Once upon a time", "hello"],
                                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        finally:
            llm.shutdown()
        import sys
        assert sys.modules["kernels"].FOREIGN == "kernels"  # still the impostor
        print(json.dumps([o.outputs[0].token_ids for o in outs]))
    """, cwd=tmp_path, pythonpath=str(tmp_path / "foreign"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [len(t) for t in ids] == [8, 8]
