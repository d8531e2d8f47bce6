"""What one request costs the serving path in CPU, process by process (issue 15).

A 2-core box runs the model on one core and everything else on the other: the Serve
proxy, the ingress, the engine replica (scheduler), the stats aggregator, Ray's own
processes and the load generator. Under a flood it is that core which saturates, and a
steady tenant's TTFT then queues behind it whatever the scheduler's fair share does. This
measures its price list: a real ``pagedserve serve`` on 127.0.0.1, one kind of request at a
time from a fixed number of concurrent clients, and each process's CPU time (utime + stime
from /proc) over the batch divided by the requests sent.

    models    GET /v1/models                      the HTTP path alone (proxy + ingress)
    bad400    a completion with a mistyped field  refused by the ingress, as a door 429 is
    tok1      a 1-token completion                + one engine call: the per-request cost
    stream64  a streamed 64-token completion      + 63 more tokens: the per-token cost
    s200x128  a streamed completion, 200 prompt   a serving workload: CPU per output token
              ids in, 128 tokens out              of every process, the model's included

    python -m pagedserve.loadtest.serving.bench_frontend [--kinds models:300 bad400:300 tok1:200 stream64:64]
        [--concurrency 8] [--model DIR] [--rounds 2] [--servers pagedserve vllm tree:DIR ...]

``--servers`` runs the same kinds against each server in turn, in one run: ``pagedserve``
(this checkout), ``vllm`` (vLLM's own OpenAI API server from .venv-vllm, PEERS.md: its API
server and engine-core processes) and ``tree:DIR`` (pagedserve from another checkout, e.g. a
``git worktree`` of the commit before a change; this venv's packages). The serving-workload
comparison of issue 28::

    python -m pagedserve.loadtest.serving.bench_frontend --kinds s200x128:64 --concurrency 16 \
        --servers pagedserve tree:/tmp/before vllm

All servers start first; rounds then interleave servers and kinds (A B C D A B C D) so
drift lands on all of them. The last line
printed is one JSON object: per server and kind, CPU ms per request by process role, and the
rate; for s200x128 also CPU ms per output token, all processes and by role.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

import httpx

from pagedserve.loadtest.harness.servers import pagedserve_server, session_pids
from pagedserve.loadtest.workloads import patterned_ids

# Process role by what its command line contains (Ray sets actor titles: ray::<Class>...). "proxy" is
# the HTTP ingress in front of the ingress replica: Serve's proxy actor, or HAProxy and its manager.
ROLES = (("ProxyActor", "proxy"), ("HAProxyManager", "proxy"), ("bin/haproxy", "proxy"),
         ("OpenAIIngress", "ingress"), ("EngineDeployment", "engine replica"),
         ("StatsAggregator", "stats"), ("RayWorkerWrapper", "model worker"), ("ServeController", "controller"),
         ("cli.main serve", "serve cli"), ("gcs_server", "ray"), ("raylet", "ray"), ("dashboard", "ray"),
         ("DashboardAgent", "ray"), ("RuntimeEnvAgent", "ray"), ("log_monitor", "ray"),
         ("VLLM::Worker", "model worker"), ("EngineCore", "vllm engine core"),
         ("vllm.entrypoints", "vllm api server"))
KINDS = ("models", "bad400", "tok1", "stream64", "s200x128")
S200_IN, S200_OUT = 200, 128
_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def role(cmdline: str) -> str:
    return next((r for key, r in ROLES if key in cmdline), "other")


def cpu_ticks(pids: list[int]) -> dict[int, tuple[str, int]]:
    """pid -> (role, utime + stime in clock ticks) for the live ones."""
    out = {}
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2:].split()
        out[pid] = (role(cmd), int(f[11]) + int(f[12]))
    return out


def by_role(before: dict, after: dict, n: int) -> dict[str, float]:
    """CPU ms per request by role between two cpu_ticks snapshots (processes alive in both)."""
    ms: dict[str, float] = {}
    for pid, (r, t) in after.items():
        if pid in before:
            ms[r] = ms.get(r, 0.0) + (t - before[pid][1]) * _TICK_MS / n
    return dict(sorted(ms.items(), key=lambda kv: -kv[1]))


async def send(base_url: str, kind: str, n: int, concurrency: int, vocab: int) -> tuple[float, dict]:
    sem = asyncio.Semaphore(concurrency)
    codes: dict[int, int] = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as c:
        async def one(i: int) -> None:
            prompt = patterned_ids(i, 8, vocab, 1)
            body = {"model": "model", "prompt": prompt, "max_tokens": 1}
            async with sem:
                if kind == "models":
                    code = (await c.get("/v1/models")).status_code
                elif kind == "bad400":
                    # Not an unknown field: pagedserve and vLLM accept those (and ignore them).
                    code = (await c.post("/v1/completions", json={**body, "max_tokens": "one"})).status_code
                elif kind == "tok1":
                    code = (await c.post("/v1/completions", json=body)).status_code
                else:
                    req = {**body, "max_tokens": 64, "ignore_eos": True, "stream": True}
                    if kind == "s200x128":
                        req.update(prompt=patterned_ids(i, S200_IN, vocab, 1), max_tokens=S200_OUT)
                    async with c.stream("POST", "/v1/completions", json=req) as r:
                        async for _ in r.aiter_bytes():
                            pass
                    code = r.status_code
                codes[code] = codes.get(code, 0) + 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - t0, codes


def measure(base_url: str, sid: int, kind: str, n: int, concurrency: int, vocab: int) -> dict:
    pids = session_pids(sid) + [os.getpid()]

    def snapshot() -> dict:
        ticks = cpu_ticks(pids)
        if os.getpid() in ticks:  # this process sends the requests
            ticks[os.getpid()] = ("load generator", ticks[os.getpid()][1])
        return ticks

    before = snapshot()
    wall, codes = asyncio.run(send(base_url, kind, n, concurrency, vocab))
    ms = by_role(before, snapshot(), n)
    serving = sum(v for r, v in ms.items() if r not in ("model worker", "load generator"))
    out = {"n": n, "req_per_s": n / wall, "codes": codes, "cpu_ms_per_request": ms,
           "serving_ms_per_request": serving}
    if kind == "s200x128":  # every process of the server, the model's compute included
        server = {r: v / S200_OUT for r, v in ms.items() if r != "load generator"}
        out.update(output_tok_per_s=n * S200_OUT / wall, cpu_ms_per_output_token=sum(server.values()),
                   cpu_ms_per_output_token_by_role=server)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["models:300", "bad400:300", "tok1:200", "stream64:64"],
                    help="KIND:N, KIND one of " + ", ".join(KINDS))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="a model directory (default: compare's serving model)")
    ap.add_argument("--servers", nargs="+", default=["pagedserve"],
                    help="pagedserve, vllm and/or tree:DIR (pagedserve from the checkout DIR)")
    args = ap.parse_args()
    kinds = [(k, int(n)) for k, n in (s.split(":") for s in args.kinds)]
    for k, _ in kinds:
        if k not in KINDS:
            ap.error(f"unknown kind {k!r}; one of {KINDS}")
    for name in args.servers:
        if name not in ("pagedserve", "vllm") and not name.startswith("tree:"):
            ap.error(f"unknown server {name!r}: pagedserve, vllm or tree:DIR")
    from pagedserve.loadtest.scenarios.compare import SERVE_SHAPE, ensure_model

    model = args.model or ensure_model("serve-h512-l4-v2048", SERVE_SHAPE)
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    summary = run_servers(args.servers, model, vocab, kinds, args.rounds, args.concurrency)
    # One server: its kinds at the top level, as before --servers existed.
    print(json.dumps(summary[args.servers[0]] if len(args.servers) == 1 else summary))


def server_process(name: str, model: str):
    """compare's "tenants" server (its defaults plus the tenant header), or vLLM's on the
    same model and lengths."""
    engine_args = dict(served_model_name="model", max_model_len=512, block_size=16, dtype="float32", seed=0,
                       max_num_seqs=16, max_num_batched_tokens=128, enable_prefix_caching=True,
                       enable_chunked_prefill=True, kv_cache_memory="1GiB", num_threads=1,
                       allow_tenant_header=True)
    if name == "vllm":
        from pagedserve.loadtest.peers.vllm_cpu import setup_vllm, vllm_server

        setup_vllm()
        return vllm_server(model, served_model_name="model", max_model_len=512,
                           extra_args=["--max-num-seqs", "16"])
    if name.startswith("tree:"):
        return pagedserve_server(model, tree=name[5:], **engine_args)
    return pagedserve_server(model, **engine_args)


def run_servers(names: list[str], model: str, vocab: int, kinds, rounds: int, concurrency: int) -> dict:
    """Every server up at once (an idle one costs the others little), then rounds that
    interleave servers and kinds (A1 A2 B1 B2 A1 ...), so drift lands on all of them."""
    results: dict[str, dict[str, list[dict]]] = {name: {k: [] for k, _ in kinds} for name in names}
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(server_process(name, model)) for name in names}
        for server in servers.values():
            asyncio.run(send(server.base_url, "stream64", 16, concurrency, vocab))  # warm-up
        for rnd in range(rounds):
            for name, server in servers.items():
                for kind, n in kinds:
                    r = measure(server.base_url, server.proc.pid, kind, n, concurrency, vocab)
                    results[name][kind].append(r)
                    parts = " ".join(f"{k} {v:.1f}" for k, v in r["cpu_ms_per_request"].items() if v >= 0.05)
                    extra = (f" | {r['cpu_ms_per_output_token']:.2f} CPU ms/output token, "
                             f"{r['output_tok_per_s']:.0f} tok/s" if "cpu_ms_per_output_token" in r else "")
                    print(f"{name} round {rnd} {kind:8s} {r['req_per_s']:6.1f} req/s codes {r['codes']}  "
                          f"serving {r['serving_ms_per_request']:.1f} ms/req | {parts}{extra}", flush=True)
    return {name: summarize(res) for name, res in results.items()}


def summarize(results: dict[str, list[dict]]) -> dict:
    """Per kind the best round (least CPU): drift and neighbours only ever add CPU."""
    summary: dict = {k: {"serving_ms_per_request": min(r["serving_ms_per_request"] for r in rs),
                         "rounds": rs} for k, rs in results.items()}
    if "s200x128" in summary:
        best = min(results["s200x128"], key=lambda r: r["cpu_ms_per_output_token"])
        summary["s200x128"].update(cpu_ms_per_output_token=best["cpu_ms_per_output_token"],
                                   cpu_ms_per_output_token_by_role=best["cpu_ms_per_output_token_by_role"],
                                   output_tok_per_s=best["output_tok_per_s"])
    if "tok1" in summary and "stream64" in summary:
        summary["serving_ms_per_token"] = (summary["stream64"]["serving_ms_per_request"]
                                           - summary["tok1"]["serving_ms_per_request"]) / 63
    return summary


if __name__ == "__main__":
    main()
