"""One streaming OpenAI completions request over httpx, timed the way ``vllm bench
serve`` times it.

    send ─────── first chunk ── chunk ── chunk ─ ... ── [DONE]
    │◀── ttft ──▶│◀─ itl[0] ─▶│◀ itl[1]▶│             │
    │◀──────────────────── e2el (latency) ────────────▶│

TTFT is to the first chunk that carries text or tokens; ITL is the gap between
consecutive such chunks (a chunk may hold several tokens when the server batches
deltas, exactly as in vLLM's tool). Output tokens come from the final ``usage`` chunk
(``stream_options.include_usage``), falling back to counting chunks. A cancellation
closes the stream after ``cancel_after`` tokens: the server sees the disconnect and
must abort the request and free its KV blocks. A request that is cut asks for
``return_token_ids`` (vLLM's field), so a chunk that holds several tokens counts them all:
counted in chunks, a loaded server that batches deltas would reach ``max_tokens`` first
and the cancellation would never happen.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from pagedserve.loadtest.workloads import RequestSpec


@dataclass(slots=True)
class RequestResult:
    request_id: str
    kind: str = ""
    success: bool = False
    cancelled: bool = False  # closed by the client on purpose (counted, not a failure)
    error: str = ""
    status_code: int = 0
    prompt_len: int = 0
    output_len: int = 0  # tokens over all n choices
    n: int = 1
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between chunks (choice 0)
    latency: float = 0.0  # e2el, seconds
    start_time: float = 0.0  # time.perf_counter() at send
    first_token_time: float = 0.0
    end_time: float = 0.0
    text: str = ""
    retries: int = 0  # 429s retried before this result
    retry_after: float | None = None  # the Retry-After header of a non-200 answer, if any
    replica: str = ""  # the engine replica that answered (x-pagedserve-replica header)

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first, per choice (0 when < 2 tokens)."""
        per_choice = self.output_len / max(1, self.n)
        return (self.latency - self.ttft) / (per_choice - 1) if per_choice > 1 else 0.0


def completion_payload(spec: RequestSpec, model: str, extra: dict | None = None) -> dict:
    # A spec may name its own model (bench_lora's LoRASpec: an adapter per request).
    body = {"model": getattr(spec, "model", None) or model, "prompt": spec.prompt,
            "max_tokens": spec.max_tokens, "n": spec.n, "temperature": 0.0 if spec.n == 1 else 1.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": spec.ignore_eos}
    if spec.n > 1:
        body["seed"] = 0
    if spec.cache_salt is not None:
        body["cache_salt"] = spec.cache_salt
    if spec.cancel_after is not None or spec.stop_after is not None:
        body["return_token_ids"] = True  # the cut counts tokens (module doc)
    body.update(extra or {})
    return body


async def send_completion(client: httpx.AsyncClient, base_url: str, spec: RequestSpec, model: str,
                          extra_body: dict | None = None, timeout: float = 600.0,
                          live: dict[str, int] | None = None, max_retries: int = 0,
                          inflight: dict[str, RequestResult] | None = None) -> RequestResult:
    """Send ``spec``; never raises for server or network errors (they land in ``error``).
    ``live[request_id]`` (if given) tracks tokens received so far on choice 0;
    ``inflight[request_id]`` (if given) is the result while it is being filled in (its
    replica once the headers came, its first token time), removed when it ends. A 429
    (overloaded) is retried up to ``max_retries`` times after the server's Retry-After (or
    0.5 s, doubling), as the OpenAI SDK does; latencies count from the first attempt."""
    start = time.perf_counter()
    for attempt in range(max_retries + 1):
        try:
            res, retry_after = await _send_once(client, base_url, spec, model, extra_body, timeout, live, start,
                                                inflight)
        finally:
            if inflight is not None:
                inflight.pop(spec.request_id, None)
        res.retries = attempt
        if res.status_code != 429 or attempt == max_retries:
            return res
        await asyncio.sleep(retry_after if retry_after is not None else 0.5 * 2 ** attempt)
    return res


async def _send_once(client, base_url, spec, model, extra_body, timeout, live, start, inflight=None):
    res = RequestResult(spec.request_id, kind=spec.kind, prompt_len=spec.prompt_len, n=spec.n)
    if inflight is not None:
        inflight[spec.request_id] = res
    payload = completion_payload(spec, model, extra_body)
    cut = spec.cancel_after if spec.cancel_after is not None else spec.stop_after
    chunks = [0] * spec.n
    usage_tokens = None
    texts: list[str] = []
    res.start_time = start
    last = time.perf_counter()
    retry_after = None
    try:
        headers = {"x-tenant": spec.tenant} if spec.tenant else None
        async with client.stream("POST", f"{base_url}/v1/completions", json=payload, timeout=timeout,
                                 headers=headers) as resp:
            res.status_code = resp.status_code
            res.replica = resp.headers.get("x-pagedserve-replica", "")
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                try:
                    retry_after = res.retry_after = float(resp.headers.get("retry-after", ""))
                except ValueError:
                    pass
                return _finish(res), retry_after
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("error"):
                    res.error = str(msg["error"])[:300]
                    return _finish(res), None
                if msg.get("usage"):
                    usage_tokens = msg["usage"].get("completion_tokens")
                for choice in msg.get("choices") or ():
                    if not (choice.get("text") or choice.get("token_ids")) and choice.get("finish_reason"):
                        continue  # a bare finish chunk is not a token
                    idx = int(choice.get("index", 0))
                    now = time.perf_counter()
                    if idx < len(chunks):
                        chunks[idx] += len(choice.get("token_ids") or ()) or 1
                    if idx == 0:
                        if live is not None:
                            live[spec.request_id] = chunks[0]
                        texts.append(choice.get("text") or "")
                        if res.first_token_time == 0.0:
                            res.first_token_time = now
                            res.ttft = now - res.start_time
                        else:
                            res.itl.append(now - last)
                        last = now
                if cut is not None and chunks[0] >= cut:
                    res.cancelled = spec.cancel_after is not None
                    break  # leaving the block closes the connection: the server must abort
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
        return _finish(res), None
    res.output_len = usage_tokens if (usage_tokens is not None and cut is None) else sum(chunks)
    res.text = "".join(texts)
    res.success = not res.cancelled and res.output_len > 0
    if not res.success and not res.cancelled:
        res.error = res.error or "empty response"
    return _finish(res), None


def _finish(res: RequestResult) -> RequestResult:
    res.end_time = time.perf_counter()
    res.latency = res.end_time - res.start_time
    return res


async def read_chat_stream(resp: httpx.Response, t0: float) -> tuple[float, int, str]:
    """A streamed chat completion's (seconds from ``t0`` to its first content, completion
    tokens from its usage chunk, the text)."""
    ttft, tokens, parts = 0.0, 0, []
    async for line in resp.aiter_lines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        msg = json.loads(line[5:])
        if msg.get("usage"):
            tokens = msg["usage"]["completion_tokens"]
        for c in msg.get("choices") or ():
            piece = (c.get("delta") or {}).get("content")
            if piece:
                ttft = ttft or time.perf_counter() - t0
                parts.append(piece)
    return ttft, tokens, "".join(parts)


async def get_served_model(client: httpx.AsyncClient, base_url: str) -> str:
    resp = await client.get(f"{base_url}/v1/models", timeout=30.0)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]
