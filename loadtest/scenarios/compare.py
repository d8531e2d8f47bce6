"""``python -m pagedserve.loadtest compare``: every side-by-side scenario in one command.

    build (or reuse) random Llama checkpoints ─▶ for each server configuration:
        start it on 127.0.0.1 ─▶ run every scenario part that needs it ─▶ SIGTERM
    ─▶ rows (ratio next to goal) ─▶ terminal table, compare.json, summary.md, PNG plots

Only one server is up at a time and peers run one after the other (two cores). A goal
missed is a result, not an error: the exit status is non-zero only when a run failed.
``--quick`` shrinks every workload (a smoke test); BENCHMARKS.md says how long each run takes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from pagedserve.loadtest.harness.report import latency_series, plot_latency_cdfs, plot_rate_sweep, write_json
from pagedserve.loadtest.harness.runner import run_benchmark
from pagedserve.loadtest.harness.servers import pagedserve_server
from pagedserve.loadtest.peers.vllm_cpu import setup_vllm, vllm_available, vllm_server
from pagedserve.loadtest.peers.vs_vllm import vs_vllm
from pagedserve.loadtest.scenarios import core as S
from pagedserve.loadtest.scenarios import robustness, tenants

SCENARIOS = {"continuous-batching": S.continuous_batching, "paged-kv": S.paged_kv,
             "chunked-prefill": S.chunked_prefill, "prefix-caching": S.prefix_caching,
             "mixed-saturation": S.mixed_saturation, "rate-sweep": S.rate_sweep, "vs-vllm": vs_vllm,
             "overload": robustness.overload, "cancel-soak": robustness.cancel_soak,
             "tenants": tenants.tenants}
# The robustness scenarios (loadtest/scenarios/robustness.py) run on request only: they measure
# the server against itself, not against a baseline, and take minutes each.
DEFAULT_SCENARIOS = [k for k in SCENARIOS if k not in ("overload", "cancel-soak", "tenants")]
SERVER_ORDER = ("default", "tenants", "static", "no-chunk", "no-prefix", "paged-kv", "contig-kv", "vllm", "none")
KV_CACHE_GIB = 1  # CPU KV cache of every server, pagedserve and vLLM alike
MODEL_CACHE = Path(os.environ.get("LOADTEST_MODEL_CACHE", "/tmp/loadtest-models"))
# Serving model: small enough for quick runs on 2 cores, big enough that a long prompt's
# prefill clearly outweighs a decode step's fixed overhead, which is
# what chunked prefill and prefix caching act on. Offline model (vs vLLM): big enough that
# the forward pass dominates a step on this CPU.
SERVE_SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, vocab_size=2048, max_position_embeddings=2048)
OFFLINE_SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=4, vocab_size=8192, max_position_embeddings=2048)


def ensure_model(name: str, shape: dict) -> str:
    path = MODEL_CACHE / name
    if not (path / "config.json").exists():
        from pagedserve.worker.loading.random_models import make_random_llama
        tmp = MODEL_CACHE / f".{name}-{os.getpid()}"
        make_random_llama(tmp, **shape)
        os.replace(tmp, path)
    return str(path)


class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        self.quick = args.quick
        self.seed = args.seed
        self.max_model_len = args.max_model_len or (512 if args.quick else 1024)
        self.block_size = 16
        self.max_num_seqs = 16
        # vLLM's CPU worker pins itself to one core and leaves the other to its scheduler and
        # API server; pagedserve gets the same split. With 2 intra-op threads on 2 busy cores
        # torch's GEMMs wait on each other: offline throughput fell far below 1 thread's.
        self.num_threads = args.num_threads
        self.chunk_budget = args.max_num_batched_tokens or 128
        # KV budget of the paged-kv scenario: two full-length sequences, plus the 1% of
        # blocks the scheduler keeps free at admission (its watermark) and one spare.
        self.kv_blocks = math.ceil(2 * self.max_model_len / self.block_size / 0.99) + 1
        self.chunk_gap_s = 0.3 if args.quick else 0.4
        self.slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
        self.out = Path(args.result_dir or f"results/compare-{time.strftime('%Y%m%d-%H%M%S')}")
        self.model_dir = args.model_dir or ensure_model("serve-h512-l4-v2048", SERVE_SHAPE)
        cfg = json.loads((Path(self.model_dir) / "config.json").read_text())
        self.vocab_size = int(cfg["vocab_size"])
        self.offline_model_dir = (args.offline_model_dir or self.model_dir) if args.quick else \
            (args.offline_model_dir or ensure_model("offline-h1024-l8-v8192", OFFLINE_SHAPE))
        ocfg = json.loads((Path(self.offline_model_dir) / "config.json").read_text())
        self.offline_vocab_size = int(ocfg["vocab_size"])
        self.offline_model_desc = f"hidden {ocfg['hidden_size']}, {ocfg['num_hidden_layers']} layers, fp32"
        self.cdfs: dict[str, dict] = {}
        self.sweeps: dict[str, list] = {}
        self.server_key = ""

    def n(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def server_args(self, key: str) -> dict:
        base = dict(max_model_len=self.max_model_len, block_size=self.block_size, dtype="float32",
                    seed=self.seed, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.chunk_budget,
                    enable_prefix_caching=True, enable_chunked_prefill=True,
                    kv_cache_memory=f"{KV_CACHE_GIB}GiB",  # = vLLM's VLLM_CPU_KVCACHE_SPACE
                    num_threads=self.num_threads)
        # Queue-delay shedding off: the client caps in-flight requests, and these runs measure
        # KV use, not overload (the contiguous baseline drains slowly, so 429s would be its rule).
        kv = dict(num_gpu_blocks_override=self.kv_blocks, enable_prefix_caching=False, max_num_seqs=64,
                  max_queue_delay_s=0)
        return {"default": base, "static": {**base, "scheduling_policy": "static"},
                "no-chunk": {**base, "enable_chunked_prefill": False, "max_num_batched_tokens": self.max_model_len},
                "no-prefix": {**base, "enable_prefix_caching": False},
                "tenants": {**base, "allow_tenant_header": True},
                "paged-kv": {**base, **kv}, "contig-kv": {**base, **kv, "kv_allocation": "contiguous"}}[key]

    def start(self, key: str):
        logs = self.out / "logs"
        if key == "vllm":
            a = self.server_args("default")
            # vLLM's CPU attention takes only multiples of 32 ("No common block size for 16").
            extra = ["--block-size", "32", "--max-num-seqs", str(a["max_num_seqs"]),
                     "--max-num-batched-tokens", str(a["max_num_batched_tokens"]), "--enable-prefix-caching"]
            srv = vllm_server(self.model_dir, served_model_name="model", max_model_len=self.max_model_len,
                              log_dir=logs, extra_args=extra, kv_cache_gib=KV_CACHE_GIB)
        else:
            srv = pagedserve_server(self.model_dir, log_dir=logs, served_model_name="model", **self.server_args(key))
        return srv.start(timeout=300)

    def bench(self, server, specs, *, label: str, request_rate: float = math.inf, **kw):
        res = asyncio.run(run_benchmark(server.base_url, specs, model="model", request_rate=request_rate,
                                        seed=self.seed, label=label, progress=False, **kw))
        tag = f"{label}[{self.server_key}]"
        m = res.metrics
        print(f"  {tag}: {m['completed']}/{m['num_requests']} done, {m['cancelled']} cancelled, "
              f"{m['failed']} failed, {m['output_throughput']:.1f} tok/s, mean TTFT {m['mean_ttft_ms']:.0f} ms, "
              f"p99 ITL {m['p99_itl_ms']:.0f} ms, {m['duration']:.1f} s", flush=True)
        write_json(self.out / "runs" / f"{label}-{self.server_key}.json", res.to_dict())
        self.cdfs[tag] = latency_series(res.results)
        return res


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny workloads: a < 5 min smoke run")
    p.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=DEFAULT_SCENARIOS)
    p.add_argument("--model-dir", default=None, help="HF model dir to serve (default: a random Llama, built once)")
    p.add_argument("--offline-model-dir", default=None, help="model for the offline pagedserve/vLLM row")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="chunk budget of the default server")
    p.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=250.0)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads of each pagedserve worker")
    p.add_argument("--no-peers", action="store_true", help="skip the vLLM rows")
    p.add_argument("--no-setup-peers", action="store_true", help="never create .venv-vllm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", default=None)
    p.add_argument("--update-benchmarks", default=None, metavar="MD",
                   help="replace the block between <!-- compare:begin --> and <!-- compare:end --> in MD")


def run_compare(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    names = [s for s in args.scenarios if not (args.no_peers and s == "vs-vllm")]
    if "vs-vllm" in names and not args.no_setup_peers and not vllm_available():
        setup_vllm()
    ctx = Ctx(args)
    scns = [SCENARIOS[n](ctx) for n in names]
    results: dict[str, dict] = {s.name: {} for s in scns}
    errors: list[str] = []
    startup: dict[str, float] = {}
    for key in SERVER_ORDER:
        todo = [(s, r) for s in scns for r in s.runs if r.server == key]
        if not todo:
            continue
        ctx.server_key = key
        print(f"[{time.perf_counter() - t0:6.0f} s] server {key}: {', '.join(f'{s.name}/{r.name}' for s, r in todo)}",
              flush=True)
        srv = None
        try:
            if key != "none":
                srv = ctx.start(key)
                startup[key] = srv.startup_s
            for s, r in todo:
                try:
                    results[s.name][r.name] = r.call(srv)
                except Exception as e:  # one failed run must not sink the others
                    errors.append(f"{s.name}/{r.name} on {key}: {type(e).__name__}: {e}")
                    traceback.print_exc()
        except Exception as e:
            errors.append(f"server {key} failed to start: {e}")
        finally:
            if srv is not None:
                srv.stop()
    rows: list[S.Row] = []
    for s in scns:
        try:
            rows += s.rows(ctx, results[s.name])
        except Exception as e:
            errors.append(f"{s.name}: no rows ({type(e).__name__}: {e})")
    elapsed = time.perf_counter() - t0
    report = {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "func"},
              "model_dir": ctx.model_dir, "max_model_len": ctx.max_model_len, "elapsed_s": elapsed,
              "server_startup_s": startup, "rows": [asdict(r) for r in rows], "errors": errors,
              "requests": accounting(results)}
    write_json(ctx.out / "compare.json", report)
    md = markdown(rows, report)
    (ctx.out / "summary.md").write_text(md)
    if args.update_benchmarks:
        update_section(Path(args.update_benchmarks), md)
    try:
        if ctx.cdfs:
            plot_latency_cdfs(ctx.cdfs, ctx.out / "latency_cdf.png")
            groups: dict[str, dict] = {}
            for tag, series in ctx.cdfs.items():  # tag = "label[server]": one figure per label
                groups.setdefault(tag.split("[")[0], {})[tag] = series
            for label, runs in groups.items():
                if len(runs) > 1:
                    plot_latency_cdfs(runs, ctx.out / f"latency_cdf-{label}.png")
        if ctx.sweeps:
            plot_rate_sweep(ctx.sweeps, ctx.out / "rate_sweep.png")
    except ImportError:
        print("matplotlib not installed: skipped the PNG plots")
    print(text_table(rows))
    for e in errors:
        print(f"ERROR {e}")
    print(f"compare finished in {elapsed:.0f} s; wrote {ctx.out}/compare.json, summary.md")
    return 1 if errors else 0


def accounting(results: dict) -> dict:
    """Per run: requests sent vs completed + cancelled + failed (every one accounted)."""
    out = {}
    for scn, runs in results.items():
        for name, res in runs.items():
            if hasattr(res, "metrics"):
                m = res.metrics
                out[f"{scn}/{name}"] = {k: m[k] for k in ("num_requests", "completed", "cancelled", "failed")}
    return out


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    try:
        import torch
        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "n/a"
    return f"{x:,.2f}" if isinstance(x, float) else str(x)


def text_table(rows: list[S.Row]) -> str:
    head = f"{'scenario':<20} {'metric':<58} {'baseline':>12} {'ours':>12} {'ratio':>7} {'goal':>16}  met"
    lines = [head, "-" * len(head)]
    for r in rows:
        met = "-" if r.met is None else ("yes" if r.met else "NO")
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        lines.append(f"{r.scenario:<20} {r.metric[:58]:<58} {_fmt(r.baseline_value):>12} {_fmt(r.ours_value):>12} "
                     f"{ratio:>7} {r.goal:>16}  {met}" + (f"   ({r.note})" if r.note else ""))
    return "\n".join(lines)


def markdown(rows: list[S.Row], report: dict) -> str:
    m = report["machine"]
    lines = [f"Measured {m['date_utc']} UTC on {m['cpus']} CPUs ({m['platform']}, torch {m.get('torch')}, "
             f"GPU: {m.get('gpu') or 'none'}); compare took {report['elapsed_s']:.0f} s.", "",
             "| scenario | metric | baseline | value | ours | value | ratio | goal | met | note |",
             "|---|---|---|---:|---|---:|---:|---|---|---|"]
    for r in rows:
        met = "-" if r.met is None else ("yes" if r.met else "**no**")
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        lines.append(f"| {r.scenario} | {r.metric} | {r.baseline} | {_fmt(r.baseline_value)} | {r.ours} | "
                     f"{_fmt(r.ours_value)} | {ratio} | {r.goal} | {met} | {r.note} |")
    if report["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in report["errors"]]]
    return "\n".join(lines) + "\n"


def update_section(path: Path, md: str) -> None:
    text = path.read_text()
    begin, end = "<!-- compare:begin -->", "<!-- compare:end -->"
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"{path} has no {begin} ... {end} block")
    path.write_text(text[:i + len(begin)] + "\n" + md + text[j:])
