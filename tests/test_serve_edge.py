"""The ingress's edge on a real Ray Serve app (127.0.0.1): every bad request of the
outside tester's catalogue (issue 10, defects 5-8) gets a 4xx in OpenAI's error JSON,
never a 500 or FastAPI's ``{"detail": ...}``, and the server keeps serving after them.

Bodies are sent as raw bytes where the bad part is the encoding itself: a lone
surrogate (``"\\ud800"``), ``Infinity``, latin-1 or non-UTF-8 bytes, deep nesting.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from conftest import SERVE_ENGINE


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"] and err["type"]
    return err


def _raw(url: str, body: bytes | str, content_type: str = "application/json") -> httpx.Response:
    data = body.encode() if isinstance(body, str) else body
    return httpx.post(url, content=data, headers={"content-type": content_type}, timeout=60)


@pytest.fixture(scope="module")
def url(openai_app):
    return openai_app


def test_unknown_route_and_method_are_openai_errors(url):
    err = _error(httpx.get(f"{url}/v1/nope"), 404)
    assert "/v1/nope" in err["message"] and err["type"] == "NotFoundError"
    _error(httpx.post(f"{url}/nope", json={}), 404)
    resp = httpx.get(f"{url}/v1/completions")
    assert _error(resp, 405)["type"] == "MethodNotAllowedError"
    assert "POST" in resp.headers["allow"]
    _error(httpx.put(f"{url}/tokenize", json={"prompt": "x"}), 405)


@pytest.mark.parametrize("body", [
    b'{"prompt": "x", ',                            # truncated JSON
    b"[" * 100_000 + b"]" * 100_000,                # nested deeper than any parser recursion
    b'{"prompt": {"a": {"b": {"c": [[[[[1]]]]]}}}}',  # nested JSON of the wrong shape
    b'{"prompt": "caf\xe9"}',                       # latin-1, not UTF-8
    b'{"prompt": "\xff\xfe\x00x"}',                 # not UTF-8 at all
    b"\xff\xfe{\x00}\x00",                          # a UTF-16 BOM and garbage
    b"",                                            # no body
    b"null",
    b'"just a string"',
])
def test_unparseable_or_misshapen_bodies_are_400(url, body):
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        _error(_raw(f"{url}{route}", body), 400)


def test_wrong_content_type_is_400(url):
    _error(_raw(f"{url}/v1/completions", '{"prompt": "x"}', "text/plain"), 400)


SURROGATE = r'"\ud800"'  # JSON text: a lone high surrogate, which json.loads accepts


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", '{"prompt": %s, "max_tokens": 2}' % SURROGATE),
    ("/v1/completions", '{"prompt": ["ok", %s]}' % SURROGATE),
    ("/v1/completions", '{"prompt": "x", "stop": [%s]}' % SURROGATE),
    ("/v1/completions", '{"prompt": "x", "model": %s}' % SURROGATE),
    ("/v1/completions", '{"prompt": "x", "cache_salt": %s}' % SURROGATE),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}]}' % SURROGATE),
    ("/v1/chat/completions", '{"messages": [{"role": %s, "content": "x"}]}' % SURROGATE),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}' % SURROGATE),
    ("/tokenize", '{"prompt": %s}' % SURROGATE),
    ("/tokenize", '{"messages": [{"role": "user", "content": %s}]}' % SURROGATE),
])
def test_lone_surrogates_are_400(url, route, body):
    err = _error(_raw(f"{url}{route}", body), 400)
    assert "surrogate" in err["message"]


def test_tokenize_bad_shapes_are_400(url):
    _error(httpx.post(f"{url}/tokenize", json={"messages": []}), 400)
    part_without_type = {"messages": [{"role": "user", "content": [{"text": "hi"}]}]}
    assert "type" in _error(httpx.post(f"{url}/tokenize", json=part_without_type), 400)["message"]
    image_part = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert "image_url" in _error(httpx.post(f"{url}/tokenize", json=image_part), 400)["message"]
    _error(httpx.post(f"{url}/tokenize", json={}), 400)  # neither prompt nor messages
    _error(httpx.post(f"{url}/tokenize", json={"prompt": "x", "messages": [{"role": "user"}]}), 400)
    _error(httpx.post(f"{url}/detokenize", json={"tokens": [-1]}), 400)
    _error(httpx.post(f"{url}/detokenize", json={"tokens": [10**6]}), 400)  # past the vocabulary
    # ...and the good shapes still work.
    ok = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}]})
    assert ok.status_code == 200 and ok.json()["count"] > 0


@pytest.mark.parametrize("fields,needle", [
    ('"stream": "yes"', "stream"),
    ('"stream": 1', "stream"),
    ('"echo": "true"', "echo"),
    ('"temperature": Infinity', "temperature"),
    ('"temperature": NaN', "temperature"),
    ('"top_p": -Infinity', "top_p"),
    ('"seed": 18446744073709551616', "seed"),       # 2**64: the poison of defect 1
    ('"seed": 18446744073709551615, "n": 2', "seed"),
    ('"seed": -9223372036854775809', "seed"),
    ('"seed": "7"', "seed"),
    ('"max_tokens": true', "max_tokens"),
    ('"max_tokens": 2.5', "max_tokens"),
    ('"max_tokens": 0', "max_tokens"),
    ('"n": 0', "n"),
    ('"n": 100000', "n"),
    ('"top_k": 99999999999999999999999', "top_k"),
    ('"priority": 99999999999999999999999', "priority"),
    ('"logprobs": 1000', "logprobs"),
    ('"stop_token_ids": [-5]', "stop_token_ids"),
    ('"stream_options": {"include_usage": "yes"}', "include_usage"),
])
def test_edge_validation_of_sampling_fields_is_400(url, fields, needle):
    err = _error(_raw(f"{url}/v1/completions", '{"prompt": "hi", %s}' % fields), 400)
    assert needle in err["message"], err


def test_int64_seeds_and_existing_forms_still_work(url):
    """The edges of what is valid are accepted: int64 seeds (wrapping n > 1), integer
    temperatures, a one-element list prompt, stop as a string."""
    for body in ({"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1, "n": 2},
                 {"prompt": "hi", "max_tokens": 2, "seed": -(2**63)},
                 {"prompt": ["hi"], "max_tokens": 2, "temperature": 0, "stop": "\n"},
                 {"prompt": [[5, 6, 7]], "max_tokens": 2, "top_p": 1, "stream": False}):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, (body, r.text)


def test_oversized_body_is_413_before_it_is_read(url):
    """The default limit for max_model_len=1024 is 4 MiB + 32 B x 1024. Content-Length
    over it is refused from the header; a chunked body, once that many bytes arrived."""
    from pagedserve.cluster.front.edge import default_max_request_body_bytes

    limit = default_max_request_body_bytes(SERVE_ENGINE["max_model_len"])
    big = json.dumps({"prompt": "a" * (limit + 10)}).encode()
    err = _error(_raw(f"{url}/v1/completions", big), 413)
    assert str(limit) in err["message"]

    def chunks():
        yield b'{"prompt": "'
        for _ in range(limit // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    resp = httpx.post(f"{url}/v1/completions", content=chunks(),
                      headers={"content-type": "application/json"}, timeout=60)
    _error(resp, 413)
    # Just under the limit is read and parsed: a prompt too long for the model (400).
    under = json.dumps({"prompt": "a " * ((limit - 100) // 2)}).encode()
    assert len(under) <= limit
    assert "context length" in _error(_raw(f"{url}/v1/completions", under), 400)["message"]


def _post_raw(url: str, body_len: int, chunk: int = 1 << 16) -> bytes:
    """A POST with Content-Length ``body_len`` written to a plain socket in full, as a client
    that sends its whole body before it reads (curl, requests, the openai SDK do); then
    everything the server answered."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(url)
    head = (f"POST {u.path}/v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {body_len}\r\n\r\n").encode()
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(head)
        block = b"a" * chunk
        for _ in range(body_len // chunk):
            sock.sendall(block)  # a reset here fails the test: the server must read it away
        sock.sendall(b"a" * (body_len % chunk))
        sock.shutdown(socket.SHUT_WR)
        out = b""
        while b"\r\n\r\n" not in out or len(out.partition(b"\r\n\r\n")[2]) < 10:
            data = sock.recv(65536)
            if not data:
                break
            out += data
    return out


def test_a_20_mb_body_gets_its_413_and_json_whole(url):
    """Issue 60: a body far over the limit is refused from its Content-Length without being
    parsed, and the client that writes it whole still reads the 413 and its JSON (the rest is
    read and dropped by the HTTP server, not answered with a reset)."""
    t0 = time.perf_counter()
    out = _post_raw(url, 20 << 20)
    took = time.perf_counter() - t0
    status_line, _, rest = out.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413"), out[:300]
    body = rest.partition(b"\r\n\r\n")[2]
    assert json.loads(body)["error"]["code"] == 413
    assert took < 10, took
    # httpx, the same body: the status and the error shape
    resp = httpx.post(f"{url}/v1/completions", content=b"a" * (20 << 20),
                      headers={"content-type": "application/json"}, timeout=60)
    _error(resp, 413)
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200


def test_models_shows_the_model_as_given_and_no_other_path(url, serve_model):
    card = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert card["root"] == card["id"] == str(serve_model)  # what the app was given, as vLLM
    # Nothing else the server resolved (a cache entry, a prepared directory) leaks out.
    paths = re.findall(r'"(/[^"]*)"', json.dumps(card).replace("\\/", "/"))
    assert set(paths) == {str(serve_model)}


def test_still_serving_after_the_catalogue(url):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3,
                                                 "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{url}/health").status_code == 200
