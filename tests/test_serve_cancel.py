"""Client disconnects abort requests in the engine, and their KV blocks come back.

The story, read through ``/metrics`` only (what an operator sees): three streams run
together; one long stream (it would run 900 tokens) is dropped after its first tokens;
the two others finish intact with exactly their ``max_tokens``; then KV usage and the
running count fall to zero, and the generation-token counter proves the dropped request
stopped early instead of running to its end, and vLLM's abort counter counts it once. The
same for a non-streaming request whose client times out.
"""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "Once upon a time in a land far away"
LONG = 900


def scrape(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.labels.get("reason"):
                out[s.name] = s.value
    return out


def aborted(base: str) -> float:
    """vllm:request_success_total{finished_reason="abort"}: the requests the front saw end unfinished."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "abort")


def wait_aborted(base: str, want: float, timeout_s: float = 10.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (got := aborted(base)) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def wait_idle(base: str, timeout_s: float = 20.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block is held."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(base)
        idle = (m["pagedserve:kv_cache_usage_perc"] == 0 and m["pagedserve:num_requests_running"] == 0
                and m["pagedserve:num_requests_waiting"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_disconnect_mid_stream_frees_kv_and_others_finish(openai_app):
    url = f"{openai_app}/v1/completions"
    before = wait_idle(openai_app)
    assert before["pagedserve:kv_cache_usage_perc"] == 0
    gen0 = before["pagedserve:generation_tokens_total"]
    aborts0 = aborted(openai_app)

    async def stream(ac, max_tokens: int, drop_after: int | None):
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        lines = []
        async with ac.stream("POST", url, json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line:
                    lines.append(line)
                if drop_after is not None and len(lines) >= drop_after:
                    break  # leaving the block closes the connection mid-stream
                if drop_after is not None and len(lines) == 1:
                    # The dropped one really holds KV blocks (stats arrive within ~0.1 s).
                    assert await poll_usage(ac) > 0
        return lines

    async def poll_usage(ac, timeout_s: float = 5.0) -> float:
        deadline = time.monotonic() + timeout_s
        while True:
            text = (await ac.get(f"{openai_app}/metrics")).text
            usage = next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                         if s.name == "pagedserve:kv_cache_usage_perc")
            if usage > 0 or time.monotonic() > deadline:
                return usage
            await asyncio.sleep(0.05)

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as ac:
            return await asyncio.gather(stream(ac, LONG, drop_after=5),
                                        stream(ac, 48, None), stream(ac, 40, None))

    dropped, a, b = asyncio.run(scenario())
    assert len(dropped) == 5 and dropped[-1] != "data: [DONE]"
    for lines, n in ((a, 48), (b, 40)):
        assert lines[-1] == "data: [DONE]"
        assert f'"completion_tokens": {n}' in lines[-2]  # the usage chunk: all tokens arrived
        assert '"finish_reason": "length"' in lines[-3]
    after = wait_idle(openai_app)
    assert after["pagedserve:kv_cache_usage_perc"] == 0
    assert after["pagedserve:num_requests_running"] == 0
    generated = after["pagedserve:generation_tokens_total"] - gen0
    # 48 + 40 for the intact streams; the dropped one stopped far short of its 900.
    assert 88 <= generated < 88 + LONG // 2, generated
    assert wait_aborted(openai_app, aborts0 + 1) == aborts0 + 1  # the dropped one, counted once


def test_non_streaming_client_timeout_aborts(openai_app):
    before = wait_idle(openai_app)
    gen0 = before["pagedserve:generation_tokens_total"]
    aborts0 = aborted(openai_app)
    body = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    try:
        httpx.post(f"{openai_app}/v1/completions", json=body, timeout=0.3)
        raise AssertionError("a 1000-token completion should outlast a 0.3 s client timeout")
    except httpx.TimeoutException:
        pass  # the client hung up
    after = wait_idle(openai_app)
    assert after["pagedserve:kv_cache_usage_perc"] == 0
    assert after["pagedserve:num_requests_running"] == 0
    assert after["pagedserve:generation_tokens_total"] - gen0 < 1000  # stopped before its end
    assert wait_aborted(openai_app, aborts0 + 1) == aborts0 + 1
