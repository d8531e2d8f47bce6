"""The steady load the cluster checks drive (cluster_check.py): ``clients`` concurrent
completions over HTTP, each sending its next request when one ends, every result kept, the
streams being answered visible while they run (``inflight``), so a phase can pick the node
that streams the most before it kills it.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from pagedserve.loadtest.harness.client import RequestResult, send_completion
from pagedserve.loadtest.workloads import RequestSpec, WordText


class Load:
    """``clients`` streaming completions, each sending the next when one ends; every
    result is kept (RequestResult: start, first token, end, error, replica)."""

    def __init__(self, base: str, clients: int, max_tokens: int, seed: int = 0, whole: int = 0,
                 max_retries: int = 0) -> None:
        """``whole``: that many of the clients ask for whole (not streamed) responses;
        ``max_retries``: a stream answered 429 is sent again after its Retry-After, up to
        that many times (as the OpenAI SDK does)."""
        self.base, self.clients, self.max_tokens, self.whole = base, clients, max_tokens, whole
        self.max_retries = max_retries
        self.results: list[RequestResult] = []
        self.inflight: dict[str, RequestResult] = {}  # streams being answered (client.send_completion)
        self.prompts: dict[str, str] = {}  # request id -> its prompt
        self.prompt: str | None = None  # every request's prompt, when set
        self._text = WordText(["alpha", "beta", "gamma", "delta"], seed)  # 16-word prompts
        self._stop = asyncio.Event()
        self.num_sent = 0  # requests sent so far (each client's next one counts when it goes)
        self.clients_now = clients

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(self.clients)))

    async def _client(self, client: httpx.AsyncClient, i: int) -> None:
        while not self._stop.is_set():
            if i >= self.clients_now:  # fewer clients for now
                await asyncio.sleep(0.2)
                continue
            self.num_sent += 1
            words = self.prompt or self._text(16)
            spec = RequestSpec(f"c{i}-{self.num_sent}", words, 16, self.max_tokens)
            self.prompts[spec.request_id] = words
            if i < self.clients - self.whole:
                self.results.append(await send_completion(client, self.base, spec, "model", timeout=120,
                                                          inflight=self.inflight, max_retries=self.max_retries))
            else:
                self.results.append(await self._whole(client, spec))

    async def _whole(self, client: httpx.AsyncClient, spec: RequestSpec) -> RequestResult:
        res = RequestResult(spec.request_id, kind="whole", start_time=time.perf_counter())
        try:
            r = await client.post(f"{self.base}/v1/completions", timeout=120, json={
                "model": "model", "prompt": spec.prompt, "max_tokens": spec.max_tokens, "ignore_eos": True})
            res.status_code, res.replica = r.status_code, r.headers.get("x-pagedserve-replica", "")
            if r.status_code == 200:
                res.output_len = r.json()["usage"]["completion_tokens"]
                res.success = res.output_len == spec.max_tokens
            else:
                res.error = f"HTTP {r.status_code}: {r.text[:300]}"
        except httpx.HTTPError as e:
            res.error = f"{type(e).__name__}: {e}"[:300]
        res.end_time = time.perf_counter()
        res.latency = res.ttft = res.end_time - res.start_time
        res.first_token_time = res.end_time
        return res

    def stop(self) -> None:
        self._stop.set()


def failures(results: list[RequestResult]) -> list[RequestResult]:
    return [r for r in results if not r.success]


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def median(xs: list[float]) -> float:
    return quantile(xs, 0.5)
