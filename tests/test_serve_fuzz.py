"""A bounded schemathesis fuzz of the real Serve app's /openapi.json (issue 10): bodies
that fit the schema and bodies that do not (wrong types, missing fields, extra nesting,
out-of-range numbers), on every route. The story: no answer is a 5xx, every 4xx is
OpenAI's error JSON, and no stream carries an in-band internal error.

Bounded so that it stays a test, not a load run: at most MAX_EXAMPLES requests, one at
a time, within BUDGET_S, and generation lengths capped (the tiny test engine must not
spend the budget producing max_model_len tokens for one case). Failures are collected
and reported together with a curl line each (no shrinking: it could outlast the budget).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
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


def _problem(resp) -> str | None:
    """None if the answer is acceptable, else what is wrong with it."""
    if resp.status_code >= 500:
        return f"{resp.status_code}: {resp.text[:300]}"
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
        for line in resp.text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                code = json.loads(line[6:])["error"].get("code")
                if code is None or code >= 500:
                    return f"in-band stream error: {line[:300]}"
    return None


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
        bad = _problem(resp)
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
