"""pagedserve vs vLLM itself, one after the other on the same cores, same model
directory, same dtype (fp32), same token-id prompts:

    offline   LLM.generate in a fresh subprocess each (pagedserve: ``from pagedserve import
              LLM`` in the project venv; vLLM: its own venv), start-up excluded, one
              warm-up request first, then every prompt at once (ignore_eos, fixed length)
    http      the same chat workload against both OpenAI servers at a fixed concurrency

Ratios are pagedserve/vLLM for throughput (> 1: ours faster) and vLLM/pagedserve for
TTFT and TPOT (> 1: ours lower), so every ratio reads "> 1 = pagedserve better".
"""

from __future__ import annotations

import os
import sys

from pagedserve.loadtest.harness.servers import ROOT
from pagedserve.loadtest.peers.vllm_cpu import run_offline_script, vllm_available, vllm_offline
from pagedserve.loadtest.scenarios.core import Row, Run, Scenario, _pair_row
from pagedserve.loadtest.workloads import fixed_length_prompts, generate_workload

_PAGEDSERVE_OFFLINE = r"""
import json, sys, time
spec = json.load(open(sys.argv[1]))
from pagedserve import LLM
from pagedserve.scheduler.sampling_params import SamplingParams
llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
          num_threads=spec["num_threads"], **spec.get("engine_args", {}))
mt = spec["max_tokens"]  # one for all, or one per prompt
params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False)
          for m in (mt if isinstance(mt, list) else [mt] * len(spec["prompts"]))]
llm.generate(spec["prompts"][:1], params[0], use_tqdm=False)  # warm-up
t0 = time.perf_counter()
outs = llm.generate(spec["prompts"], params, use_tqdm=False)
dt = time.perf_counter() - t0
res = {"elapsed": dt, "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
       "first_tokens": [list(o.outputs[0].token_ids[:8]) for o in outs[:4]],
       "cpu_linear_backend": getattr(llm.engine.executor.worker, "cpu_linear_backend", None)}
if spec.get("return_tokens"):
    res["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
print("RESULT " + json.dumps(res), flush=True)
llm.shutdown()
"""


def pagedserve_offline(model: str, prompts: list[list[int]], max_tokens: int | list[int], *,
                       max_model_len: int = 512, dtype: str = "float32", num_threads: int | None = 1,
                       timeout: float = 900.0, return_tokens: bool = False, engine_args: dict | None = None,
                       env: dict | None = None) -> dict:
    """pagedserve's offline ``LLM.generate`` throughput in a fresh process (start-up excluded);
    ``max_tokens``: one for all or one per prompt."""
    spec = {"model": model, "prompts": prompts, "max_tokens": max_tokens, "max_model_len": max_model_len,
            "dtype": dtype, "num_threads": num_threads, "return_tokens": return_tokens,
            "engine_args": engine_args or {}}
    env = {**os.environ, **(env or {})}
    return run_offline_script(sys.executable, _PAGEDSERVE_OFFLINE, spec, env=env, what="pagedserve",
                              timeout=timeout, cwd=str(ROOT))


def vs_vllm(ctx) -> Scenario:
    specs = generate_workload("chat", ctx.n(48, 12), max_model_len=ctx.max_model_len,
                              vocab_size=ctx.vocab_size, seed=ctx.seed + 6)
    num, plen, out = ctx.n(32, 8), 32, ctx.n(64, 16)

    def http(server):
        return ctx.bench(server, specs, label="vs-vllm-http", max_concurrency=16)

    def offline(_server):
        model = ctx.offline_model_dir
        prompts = fixed_length_prompts(num, plen, ctx.offline_vocab_size, ctx.seed)
        # Offline there is no ingress to leave a core for: torch's default threads (on the
        # quiet machine 2 threads beat 1 on the offline model).
        res = {"pagedserve": pagedserve_offline(model, prompts, out, max_model_len=ctx.max_model_len,
                                                num_threads=None)}
        res["vllm"] = vllm_offline(model, prompts, out, max_model_len=ctx.max_model_len)
        res["same_first_tokens"] = res["pagedserve"]["first_tokens"] == res["vllm"]["first_tokens"]
        return res

    def rows(_, res):
        out_rows = []
        if "offline" in res:
            o = res["offline"]
            out_rows.append(_pair_row("vs-vllm", f"offline output throughput (tok/s, {num}x{plen} in, {out} out, "
                                      f"{ctx.offline_model_desc})", "vLLM", o["vllm"]["output_throughput"],
                                      "pagedserve", o["pagedserve"]["output_throughput"], 1.0,
                                      note=f"greedy first tokens equal: {o['same_first_tokens']}"))
        if "http-pagedserve" in res and "http-vllm" in res:
            a, b = res["http-pagedserve"].metrics, res["http-vllm"].metrics
            out_rows += [
                _pair_row("vs-vllm", "HTTP output throughput (tok/s, 16 concurrent)", "vLLM",
                          b["output_throughput"], "pagedserve", a["output_throughput"], 0),
                _pair_row("vs-vllm", "HTTP mean TTFT (ms)", "vLLM", b["mean_ttft_ms"], "pagedserve",
                          a["mean_ttft_ms"], 0, higher=False),
                _pair_row("vs-vllm", "HTTP mean TPOT (ms)", "vLLM", b["mean_tpot_ms"], "pagedserve",
                          a["mean_tpot_ms"], 0, higher=False)]
        return out_rows

    if not vllm_available():
        def missing(_, __):
            return [Row("vs-vllm", "peer not installed", "vLLM", float("nan"), "pagedserve", float("nan"), None,
                        "reported", None, "run without --no-setup-peers to create .venv-vllm (PEERS.md)")]
        return Scenario("vs-vllm", [], missing)
    return Scenario("vs-vllm", [Run("default", "http-pagedserve", http), Run("vllm", "http-vllm", http),
                                Run("none", "offline", offline)], rows)
