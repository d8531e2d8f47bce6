"""A bounded schemathesis fuzz of the real Serve app's /openapi.json (issue 10): bodies
that fit the schema and bodies that do not (wrong types, missing fields, extra nesting,
out-of-range numbers), on every route. The story: no answer is a 5xx, every 4xx is
OpenAI's error JSON with no server internals (traceback, source path) in it, and no
stream carries an in-band internal error. Then issue 27's own: the request that once
killed the engine (a top_p float32 flushes to 0) is a normal completion beside a stream,
and the offline sampling fuzz's bodies over HTTP end in a result or a 4xx.

Bounded so that it stays a test, not a load run: at most MAX_EXAMPLES requests, one at
a time, within BUDGET_S, and generation lengths capped (the tiny test engine must not
spend the budget producing max_model_len tokens for one case). Failures are collected
and reported together with a curl line each (no shrinking: it could outlast the budget).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import Counter

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

MAX_EXAMPLES = 500
BUDGET_S = 150.0
# Caps applied to a generated body before it is sent (values above them are still
# generated, and refused or accepted by the server as before; they only run shorter).
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "min_tokens": 4, "n": 2}


def _bound(case) -> None:
    body = case.body
    if isinstance(body, dict):
        for key, cap in CAPS.items():
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > cap:
                body[key] = cap
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 4  # chat's default is "up to max_model_len"


def _problem(resp, path: str = "") -> str | None:
    """None if the answer is acceptable, else what is wrong with it (``path``: the route; on
    /v1/messages* a 4xx is in Anthropic's error shape, elsewhere in OpenAI's)."""
    req = resp.request  # schemathesis answers with requests' objects (body), httpx's have content
    sent = getattr(req, "body", None) or getattr(req, "content", None) or b""
    sent = sent.decode("utf-8", errors="replace") if isinstance(sent, bytes) else str(sent)
    if resp.status_code >= 400 and _internals(resp.text, sent):
        return f"{resp.status_code} with server internals: {resp.text[:300]}"
    if resp.status_code >= 500:
        return f"{resp.status_code}: {resp.text[:300]}"
    if resp.status_code >= 400 and path.startswith("/v1/messages"):  # Anthropic's API, its error shape
        try:
            body = resp.json()
            ok = body["type"] == "error" and body["error"]["type"] and body["error"]["message"]
        except (ValueError, KeyError, TypeError):
            ok = False
        return None if ok else f"{resp.status_code} not in Anthropic's error JSON: {resp.text[:300]}"
    if resp.status_code >= 400:
        try:
            err = resp.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{resp.status_code} not in OpenAI's error JSON: {resp.text[:300]}"
        if not (set(err) >= {"message", "type", "param", "code"} and err["code"] == resp.status_code
                and err["message"]):
            return f"{resp.status_code} with a malformed error object: {err}"
        return None
    # schemathesis' headers: lower-case names, each a list of values.
    content_type = {k.lower(): v for k, v in resp.headers.items()}.get("content-type") or [""]
    if content_type[0].startswith("text/event-stream"):
        # SSE ends a line at CR or LF only; str.splitlines would also split a JSON string at
        # the U+2028, U+0085 or \x1c it may hold raw (a fuzzed metadata value did).
        for line in resp.text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
            if line.startswith("data: {") and '"error"' in line:
                err = json.loads(line[6:]).get("error")  # an event may only mention "error" in a value
                if not isinstance(err, dict):
                    continue
                code = err.get("code")
                if code is None or code >= 500:
                    return f"in-band stream error: {line[:300]}"
    return None


@pytest.mark.scenarios  # every route's schema fuzzed: the longest call of the default run, under -m scenarios
def test_openapi_fuzz_no_5xx_and_openai_shaped_4xx(openai_app):
    schema = schemathesis.openapi.from_url(f"{openai_app}/openapi.json")
    strategy = (schema.as_strategy(GenerationMode.POSITIVE)
                | schema.as_strategy(GenerationMode.NEGATIVE))
    statuses: Counter = Counter()
    problems: list[str] = []
    stop_at = time.monotonic() + BUDGET_S

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def fuzz(case):
        if time.monotonic() > stop_at:
            return
        _bound(case)
        resp = case.call(base_url=openai_app, timeout=60)
        statuses[(case.operation.path, resp.status_code)] += 1
        bad = _problem(resp, case.operation.path)
        if bad is not None:
            problems.append(f"{bad}\n    {case.as_curl_command()}")

    fuzz()
    sent = sum(statuses.values())
    print(f"fuzz: {sent} requests; by (route, status): {dict(sorted(statuses.items()))}")
    assert not problems, f"{len(problems)} of {sent} answers were wrong:\n" + "\n".join(problems[:20])
    # It really exercised the API: every route, both accepted and refused bodies.
    routes = {path for path, _ in statuses}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= routes
    assert any(s == 200 for _, s in statuses) and any(400 <= s < 500 for _, s in statuses)
    assert sent >= 100


# The request the outside tester's fuzzer found (issue 27), on this model's vocabulary:
# top_p a denormal that float32 flushes to 0.
KILLER = {"prompt": [379], "max_tokens": 4, "top_p": 2.225073858507203e-309}
SAMPLING_EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_HTTP_EXAMPLES", "60"))
SAMPLING_BUDGET_S = float(os.environ.get("PAGEDSERVE_FUZZ_HTTP_BUDGET_S", "60"))


def _replica(base: str) -> str:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-pagedserve-replica"]


def _internals(text: str, sent: str = "") -> bool:
    """A traceback, the checkout's path or a source file's name. A name the request itself
    sent is its echo (an unknown field "monitor.py" is named back), not a leak."""
    if "Traceback" in text or "/work/" in text:
        return True
    # "messages.3.monitor.py": the field path ends in the name the request sent.
    return any(name not in sent for name in re.findall(r"[^\s./\\\"']+\.py\b", text))


def _stream_beside(base: str, out: list) -> threading.Thread:
    def run():
        with httpx.stream("POST", f"{base}/v1/completions", timeout=120, json={
                "prompt": "a stream beside", "max_tokens": 64, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            out.extend(line for line in r.iter_lines() if line)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_the_fuzzers_request_is_a_normal_completion_beside_a_stream(openai_app):
    replica = _replica(openai_app)
    lines: list[str] = []
    stream = _stream_beside(openai_app, lines)
    for top_p in (2.225073858507203e-309, 1e-300, 1e-45, 5e-324):
        r = httpx.post(f"{openai_app}/v1/completions", json={**KILLER, "top_p": top_p}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{openai_app}/health", timeout=10).status_code == 200
    stream.join(120)
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # all 64 tokens
    assert _replica(openai_app) == replica


def test_sampling_fields_fuzz_over_http_gives_results_or_4xx(openai_app):
    """The offline fuzz's bodies (test_sampling_fuzz.py), bounded, against the real
    server, streamed and not: every answer a 200 or an OpenAI-shaped 4xx, no body with
    server internals, and afterwards the same replica healthy and idle."""
    from test_sampling_fuzz import CAPS, body

    replica = _replica(openai_app)
    statuses: Counter = Counter()
    problems: list[str] = []
    stop_at = time.monotonic() + SAMPLING_BUDGET_S

    @settings(max_examples=SAMPLING_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(raw=body, stream=st.booleans())
    def fuzz(raw, stream):
        if time.monotonic() > stop_at:
            return
        for key, cap in CAPS.items():
            v = raw.get(key)
            if isinstance(v, int) and v > cap:
                raw[key] = cap
        raw["max_tokens"] = min(raw.get("max_tokens", 4), 4) if isinstance(raw.get("max_tokens", 4), int) else 4
        # As bytes: a non-finite float is written NaN / Infinity (Python's json, and many a
        # client's), which httpx's json= refuses to send; the server must answer it with a 4xx.
        with httpx.stream("POST", f"{openai_app}/v1/completions", content=json.dumps({**raw, "stream": stream}),
                          headers={"content-type": "application/json"}, timeout=60) as r:
            text = r.read().decode()
            statuses[r.status_code] += 1
            bad = None
            if r.status_code >= 500 or not (r.status_code == 200 or 400 <= r.status_code < 500):
                bad = f"{r.status_code}: {text[:300]}"
            elif r.status_code >= 400 and "error" not in json.loads(text):
                bad = f"{r.status_code} not in OpenAI's error JSON: {text[:300]}"
            elif stream and r.status_code == 200 and '"error"' in text:
                bad = f"in-band stream error: {text[:300]}"
            elif _internals(text):
                bad = f"server internals in a body: {text[:300]}"
            if bad is not None:
                problems.append(f"{bad}\n    body: {json.dumps(raw)}")

    fuzz()
    print(f"sampling fuzz over HTTP: by status {dict(statuses)}")
    assert not problems, "\n".join(problems[:10])
    assert statuses[200] >= 5 and sum(n for s, n in statuses.items() if 400 <= s < 500) >= 5
    assert httpx.get(f"{openai_app}/health", timeout=10).status_code == 200
    assert _replica(openai_app) == replica
