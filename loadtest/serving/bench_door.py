"""The door under overload: open loop at 1x and 3x capacity, client TTFT beside the server's.

    python -m pagedserve.loadtest.serving.bench_door [--base-url URL] [--seconds 40] [--model pagedserve-demo]

Starts ``pagedserve serve --model MODEL`` with default flags (or drives ``--base-url``),
then lowers its own priority to nice 19 (the load generator shares the cores: it must not
take them from the server) and runs three phases: capacity from a closed loop (32 clients,
160 chat requests of 64 tokens), then Poisson arrivals at 1x and 3x that rate for
``--seconds`` each, without retries. Per phase, one JSON line: sent, admitted, 429s (with
Retry-After), 5xx, and the TTFT p50/p99 of admitted requests as the client saw it, as the
HTTP front saw it (``pagedserve:front_time_to_first_token_seconds``) and as the engine did
(``pagedserve:time_to_first_token_seconds``), read from /metrics before and after the phase.
The last line is the JSON of all three.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os

import httpx

from pagedserve.loadtest.harness.metrics import percentile
from pagedserve.loadtest.harness.runner import run_benchmark
from pagedserve.loadtest.harness.servers import pagedserve_server
from pagedserve.loadtest.workloads import generate_workload

HISTOGRAMS = {"front": "pagedserve:front_time_to_first_token_seconds",
              "engine": "pagedserve:time_to_first_token_seconds"}


def buckets(url: str) -> dict[str, dict[float, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    want = {v: k for k, v in HISTOGRAMS.items()}
    out: dict[str, dict[float, float]] = {k: {} for k in HISTOGRAMS}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name.endswith("_bucket") and s.name[:-7] in want:
                out[want[s.name[:-7]]][float(s.labels["le"])] = s.value
    return out


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The q-quantile of what a cumulative histogram gained, interpolated in its bucket."""
    les = sorted(after)
    cum = [after[le] - before.get(le, 0.0) for le in les]
    if not cum or cum[-1] <= 0:
        return None
    target, prev_le, prev_c = q * cum[-1], 0.0, 0.0
    for le, c in zip(les, cum):
        if c >= target:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (target - prev_c) / max(c - prev_c, 1e-9)
        prev_le, prev_c = le, c
    return les[-1]


def phase(url: str, label: str, n: int, max_model_len: int, vocab: int, *, rate: float = math.inf,
          concurrency: int | None = None, seed: int = 0) -> dict:
    specs = generate_workload("chat", n, max_model_len=max_model_len, vocab_size=vocab, seed=seed, output_len=64)
    before = buckets(url)
    res = asyncio.run(run_benchmark(url, specs, request_rate=rate, max_concurrency=concurrency, seed=seed,
                                    label=label, progress=False, request_timeout=120, drain_timeout=120))
    after = buckets(url)
    rs = res.results
    ok = [r for r in rs if r.success]
    out = {"phase": label, "sent": len(rs), "admitted": len(ok),
           "429": sum(r.status_code == 429 for r in rs),
           "429_with_retry_after": sum(r.status_code == 429 and r.retry_after is not None for r in rs),
           "5xx": sum(r.status_code >= 500 for r in rs), "req_per_s": res.metrics["request_throughput"],
           "client_ttft_p50": percentile([r.ttft for r in ok], 50),
           "client_ttft_p99": percentile([r.ttft for r in ok], 99)}
    for short in HISTOGRAMS:
        out[f"{short}_ttft_p50"] = histogram_quantile(before[short], after[short], 0.5)
        out[f"{short}_ttft_p99"] = histogram_quantile(before[short], after[short], 0.99)
    print(json.dumps(out), flush=True)
    return out


def run(url: str, seconds: float) -> dict:
    info = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
    max_len = int(info.get("max_model_len") or 2048)
    vocab = 8192  # token-id prompts stay inside any vocabulary this size or larger
    cap = phase(url, "capacity", 160, max_len, vocab, concurrency=32, seed=1)
    rate = cap["req_per_s"]
    x1 = phase(url, "1x", max(1, round(rate * seconds)), max_len, vocab, rate=rate, seed=2)
    x3 = phase(url, "3x", max(1, round(3 * rate * seconds)), max_len, vocab, rate=3 * rate, seed=3)
    ratio = {k: (x3[f"{k}_ttft_p50"] / cap[f"{k}_ttft_p50"]) if cap[f"{k}_ttft_p50"] else None
             for k in ("client", "front")}
    return {"capacity": cap, "1x": x1, "3x": x3, "3x_over_capacity_ttft_p50": ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="a running server (default: start one)")
    ap.add_argument("--model", default="pagedserve-demo")
    ap.add_argument("--seconds", type=float, default=40.0, help="length of the 1x and 3x phases")
    args = ap.parse_args()
    if args.base_url:
        os.nice(19)
        print(json.dumps(run(args.base_url.rstrip("/"), args.seconds)))
        return
    with pagedserve_server(args.model) as server:
        os.nice(19)  # after the server started: its processes keep their own priority
        print(json.dumps(run(server.base_url, args.seconds)))


if __name__ == "__main__":
    main()
