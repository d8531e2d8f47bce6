"""``python -m pagedserve.loadtest bench ...`` drives a running OpenAI-compatible server (pagedserve
or vLLM); ``python -m pagedserve.loadtest compare ...`` runs the side-by-side scenarios.

    python -m pagedserve.loadtest bench --base-url http://127.0.0.1:8000 --model-dir /path/model \\
        --workload chat --num-prompts 200 --request-rate 4 --goodput ttft:500 tpot:50
    python -m pagedserve.loadtest bench ... --request-rate 1 2 4 inf   # a sweep; plots rate_sweep.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from pagedserve.loadtest.harness.arrivals import parse_rate
from pagedserve.loadtest.harness.metrics import parse_goodput
from pagedserve.loadtest.harness.report import (find_knee, format_table, latency_series, plot_latency_cdfs,
                                                plot_rate_sweep, write_json)
from pagedserve.loadtest.harness.runner import run_benchmark
from pagedserve.loadtest.workloads import WORKLOADS, generate_workload


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="default http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    p.add_argument("--model-dir", default=None, help="read vocab_size / max_position_embeddings from config.json")
    p.add_argument("--workload", choices=WORKLOADS, default="chat")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=parse_rate, nargs="+", default=[float("inf")],
                   help="requests/s (inf: all at once); several values run a sweep")
    p.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape: 1 Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None, help="lengths scale to this (default: config)")
    p.add_argument("--vocab-size", type=int, default=None, help="token-id range (default: config)")
    p.add_argument("--output-len", type=int, default=None, help="fix every output length")
    p.add_argument("--prompt-format", choices=["token-ids", "text"], default="token-ids")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--max-retries", type=int, default=0, help="retry a 429 this many times (OpenAI SDK: 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", default=None, help="write result.json and PNG plots here")
    p.add_argument("--label", default="")
    p.add_argument("--no-progress", action="store_true")


def _model_shape(args) -> tuple[int, int]:
    cfg = {}
    if args.model_dir:
        cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
    max_len = args.max_model_len or int(cfg.get("max_position_embeddings", 2048))
    vocab = args.vocab_size or int(cfg.get("vocab_size", 0))
    if not vocab and args.prompt_format == "token-ids":
        raise SystemExit("token-id prompts need --vocab-size or --model-dir (or use --prompt-format text)")
    return max_len, vocab or 32000


def bench(args) -> dict:
    max_len, vocab = _model_shape(args)
    specs = generate_workload(args.workload, args.num_prompts, max_model_len=max_len, vocab_size=vocab,
                              seed=args.seed, output_len=args.output_len,
                              text=args.prompt_format == "text")
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    goodput = parse_goodput(args.goodput)
    runs, cdfs, sweep = [], {}, []
    for rate in args.request_rate:
        label = f"{args.label or args.workload} @ {rate:g} req/s"
        res = asyncio.run(run_benchmark(base_url, specs, model=args.model, request_rate=rate,
                                        burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                                        seed=args.seed, goodput=goodput, label=label,
                                        progress=not args.no_progress, max_retries=args.max_retries))
        print(format_table(label, res.metrics, res.server))
        runs.append(res.to_dict())
        cdfs[label] = latency_series(res.results)
        sweep.append((rate, res.metrics))
    out = {"runs": runs}
    if len(sweep) > 1:
        out["knee_request_rate"] = find_knee(sweep)
        print(f"knee of the throughput/latency curve: {out['knee_request_rate']} req/s")
    if args.result_dir:
        d = Path(args.result_dir)
        write_json(d / "result.json", out)
        try:
            plot_latency_cdfs(cdfs, d / "latency_cdf.png")
            if len(sweep) > 1:
                plot_rate_sweep({args.label or args.workload: sweep}, d / "rate_sweep.png")
        except ImportError:
            print("matplotlib not installed: skipped the PNG plots (pip install matplotlib)", file=sys.stderr)
        print(f"wrote {d}/result.json")
    return out


# The benchmarks and checks that run on their own (one process, no server to start by hand),
# by sub-package, listed in --help with the first line of each one's docstring (read, not
# imported: no torch, no ray). tests/test_loadtest.py checks that every entry point is here.
BENCHMARKS = (
    "loadtest.offline.bench_offline", "loadtest.offline.bench_scheduler", "loadtest.offline.bench_dispatch",
    "loadtest.offline.bench_structured", "loadtest.offline.bench_kv_quant", "loadtest.offline.bench_kv_dtype",
    "loadtest.offline.bench_thrash", "loadtest.offline.bench_lora", "loadtest.offline.bench_moe",
    "loadtest.serving.bench_frontend", "loadtest.serving.bench_door", "loadtest.serving.bench_routing",
    "loadtest.serving.bench_spec", "loadtest.serving.bench_router_decision",
    "loadtest.peers.bench_vs_vllm", "loadtest.peers.bench_vs_llama_cpp", "loadtest.peers.bench_serving_share",
    "loadtest.peers.vllm_api_smollm2",
    "loadtest.multinode.cluster_check",
    "loadtest.kernel_checks.cpu_attention", "loadtest.kernel_checks.cpu_gguf", "loadtest.kernel_checks.gpu_kernels",
    "loadtest.kernel_checks.aot",
    "loadtest.gpu_check",
)


def benchmarks_epilog() -> str:
    import ast

    root = Path(__file__).resolve().parent.parent
    width = max(map(len, BENCHMARKS))
    lines = ["benchmarks (python -m pagedserve.MODULE --help for each one's flags):"]
    for mod in BENCHMARKS:
        doc = ast.get_docstring(ast.parse((root / (mod.replace(".", "/") + ".py")).read_text())) or ""
        first = doc.split("\n")[0].rstrip(":,").replace(" (issue 15)", "")
        lines.append(f"  {mod:{width}s}  {first}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.loadtest", description=__doc__.split("\n\n")[0],
                                     epilog=benchmarks_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_args(sub.add_parser("bench", help="load-test a running server"))
    from pagedserve.loadtest.scenarios.compare import add_compare_args, run_compare
    add_compare_args(sub.add_parser("compare", help="side-by-side scenarios (starts the servers)"))
    args = parser.parse_args(argv)
    if args.command == "bench":
        out = bench(args)
        failed = sum(r["metrics"]["failed"] for r in out["runs"])
        return 1 if failed else 0
    return run_compare(args)


if __name__ == "__main__":
    sys.exit(main())
