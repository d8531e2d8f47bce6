"""Drive one benchmark run: send a workload at its arrival times, under a concurrency
cap, while sampling the server's ``/metrics``; then wait for the server to drain.

    t=0 ── arrival[0] ── arrival[1] ── ...     (Gamma process, loadtest.harness.arrivals)
             │ wait for a --max-concurrency slot, and for the parent turn (multi-turn)
             ▼
           send_completion (streaming)  ──▶ RequestResult
    sampler: GET /metrics every ``sample_interval`` s ──▶ ServerSample peaks
    end:     poll /metrics until nothing runs or waits ──▶ leaked KV blocks
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from pagedserve.loadtest.harness.arrivals import arrival_times
from pagedserve.loadtest.harness.client import RequestResult, get_served_model, send_completion
from pagedserve.loadtest.harness.metrics import ServerSample, compute_metrics, parse_prometheus, server_view
from pagedserve.loadtest.workloads import RequestSpec, summarize


LAG_PROBE_S = 0.01


@dataclass
class BenchmarkResult:
    label: str
    config: dict
    metrics: dict
    server: dict
    results: list[RequestResult] = field(default_factory=list)
    # (seconds since start, tokens of decoding requests, their number, ServerSample) per scrape: lets a
    # scenario relate the tokens the client knows of to the KV blocks the server holds.
    timeline: list[tuple[float, int, int, ServerSample]] = field(default_factory=list)

    def to_dict(self, with_requests: bool = True) -> dict:
        d = {"label": self.label, "config": self.config, "metrics": self.metrics, "server": self.server}
        if with_requests:
            d["requests"] = [{"request_id": r.request_id, "kind": r.kind, "success": r.success,
                              "cancelled": r.cancelled, "error": r.error, "prompt_len": r.prompt_len,
                              "output_len": r.output_len, "n": r.n, "ttft": r.ttft, "tpot": r.tpot,
                              "latency": r.latency, "retries": r.retries, "itl": r.itl}
                             for r in self.results]
        return d


async def scrape(client: httpx.AsyncClient, base_url: str) -> ServerSample | None:
    try:
        resp = await client.get(f"{base_url}/metrics", timeout=10.0)
        return parse_prometheus(resp.text) if resp.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def run_benchmark(base_url: str, specs: list[RequestSpec], *, model: str | None = None,
                        request_rate: float = float("inf"), burstiness: float = 1.0,
                        max_concurrency: int | None = None, seed: int = 0,
                        goodput: dict[str, float] | None = None, label: str = "",
                        sample_interval: float = 0.5, progress: bool = True,
                        drain_timeout: float = 30.0, extra_body: dict | None = None,
                        arrivals: list[float] | None = None, max_retries: int = 0,
                        request_timeout: float = 600.0) -> BenchmarkResult:
    """``arrivals`` (seconds from start, one per spec) replaces the Gamma process."""
    base_url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=max(len(specs), 1) + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        model = model or await get_served_model(client, base_url)
        before = await scrape(client, base_url)
        times = arrivals if arrivals is not None else arrival_times(len(specs), request_rate, burstiness, seed)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        finished = [asyncio.Event() for _ in specs]
        results: list[RequestResult | None] = [None] * len(specs)
        inflight: dict[int, RequestSpec] = {}
        live: dict[str, int] = {}
        bar = _progress(len(specs), progress)
        start = time.perf_counter()

        async def one(i: int) -> None:
            spec = specs[i]
            try:
                await asyncio.sleep(max(0.0, start + times[i] - time.perf_counter()))
                if spec.parent is not None:
                    await finished[spec.parent].wait()
                if sem:
                    await sem.acquire()
                inflight[i] = spec
                try:
                    results[i] = await send_completion(client, base_url, spec, model, extra_body, live=live,
                                                       max_retries=max_retries, timeout=request_timeout)
                finally:
                    inflight.pop(i, None)
                    if sem:
                        sem.release()
            finally:
                finished[i].set()
                if bar:
                    bar.update(1)

        samples: list[ServerSample] = []
        timeline: list = []
        stop = asyncio.Event()

        async def sampler() -> None:
            while not stop.is_set():
                s = await scrape(client, base_url)
                if s is not None:
                    # Tokens the client knows are in the KV cache: prompt + outputs so far, of
                    # requests that have streamed at least one token (so are past prefill).
                    started = [sp for sp in inflight.values() if live.get(sp.request_id, 0) > 0]
                    toks = sum(sp.prompt_len + live[sp.request_id] for sp in started)
                    samples.append(s)
                    timeline.append((time.perf_counter() - start, toks, len(started), s))
                try:
                    await asyncio.wait_for(stop.wait(), sample_interval)
                except asyncio.TimeoutError:
                    pass

        lags: list[float] = []

        async def lag_probe() -> None:
            # The client's own event-loop lag: how late a 10 ms sleep wakes. A client
            # that lags measures its lag into every TTFT (a token that arrived waits
            # to be read), so a saturated load generator shows here, not as server time.
            while not stop.is_set():
                t = time.perf_counter()
                await asyncio.sleep(LAG_PROBE_S)
                lags.append(max(0.0, time.perf_counter() - t - LAG_PROBE_S))

        sampler_task = asyncio.create_task(sampler()) if sample_interval > 0 else None
        lag_task = asyncio.create_task(lag_probe())
        await asyncio.gather(*(one(i) for i in range(len(specs))))
        duration = time.perf_counter() - start
        stop.set()
        if sampler_task:
            await sampler_task
        await lag_task
        if bar:
            bar.close()
        after = await _drain(client, base_url, drain_timeout)
    done = [r if r is not None else RequestResult(s.request_id, kind=s.kind, error="never sent")
            for r, s in zip(results, specs)]
    config = {"base_url": base_url, "model": model, "request_rate": request_rate,
              "burstiness": burstiness, "max_concurrency": max_concurrency, "seed": seed,
              "goodput": goodput or {}, "workload": summarize(specs)}
    metrics = compute_metrics(done, duration, goodput)
    if times and times[-1] > 0:  # the rate this sample of arrivals actually offered
        metrics["offered_request_rate"] = len(times) / times[-1]
    lags.sort()
    metrics["client_loop_lag_p99_s"] = lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else 0.0
    metrics["client_loop_lag_max_s"] = lags[-1] if lags else 0.0
    return BenchmarkResult(label, config, metrics,
                           server_view(before, samples, after), done, timeline)


async def _drain(client: httpx.AsyncClient, base_url: str, timeout: float) -> ServerSample | None:
    """Poll until the server reports nothing running or waiting (aborts of cancelled
    streams land a step or two after the disconnect), or ``timeout`` passes."""
    deadline = time.perf_counter() + timeout
    last = None
    while True:
        last = await scrape(client, base_url) or last
        idle = last is not None and not last.gauges.get("num_requests_running", 0) \
            and not last.gauges.get("num_requests_waiting", 0) and not last.gauges.get("kv_cache_usage_perc", 0)
        if idle or last is None or time.perf_counter() > deadline:
            return last
        await asyncio.sleep(0.25)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="requests", unit="req", leave=False)
