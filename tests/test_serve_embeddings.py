"""POST /v1/embeddings over real HTTP, on a Serve app of its own serving a Qwen3-Embedding-
shaped model (tests/test_embeddings.py builds it: LAST pooling, normalised, Matryoshka) by
the pooling runner, read with the openai SDK's ``client.embeddings.create`` (floats and the
SDK's default, base64), langchain-openai's ``OpenAIEmbeddings`` and litellm's ``embedding``.

Every answer is transformers' last hidden state pooled by hand (fp32); the base64 vectors
decode to the float ones; inputs as text, texts, token ids and lists of them; Matryoshka
``dimensions`` and ``truncate_prompt_tokens``; concurrent requests (scheduled in shared steps)
each get their own answer. Mistakes are 400s in the route's error shape: an input over
max_model_len, an empty one, dimensions past the model's size, a float16 ``embed_dtype``, and
the wrong route for the model (completions, chat, responses and messages asked of this one;
embeddings asked of the session's generation app). ``dimensions`` on a model without
Matryoshka support: tests/test_embeddings.py.
"""

from __future__ import annotations

import base64
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch

from conftest import delete_app
from test_embeddings import embedder_path, reference

pytestmark = pytest.mark.scenarios  # an app of its own deployed for the module: under -m scenarios

MODEL = "qwen3-embed"
MAX_MODEL_LEN = 64
TEXTS = ["hello world", "paged attention keeps a block table", "one two three four five six"]


@pytest.fixture(scope="module")
def url(serve_url, tmp_path_factory):
    from ray import serve

    from pagedserve.cluster.app import build_app
    from pagedserve.config import EngineConfig

    path = embedder_path("qwen3", tmp_path_factory.getbasetemp() / "embed-models")
    # --task embed: vLLM's older spelling of --runner pooling.
    cfg = EngineConfig(model=path, served_model_name=MODEL, task="embed", max_model_len=MAX_MODEL_LEN,
                       num_gpu_blocks_override=64, max_num_seqs=4, dtype="float32", seed=0)
    serve.run(build_app(cfg, name_prefix="emb-"), name="embeddings", route_prefix="/emb")
    yield f"{serve_url}/emb", path
    delete_app("embeddings")


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url[0]}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ids_of(url):
    """The token ids the server reads for a text (its /tokenize)."""
    def ids(text: str) -> list[int]:
        return httpx.post(f"{url[0]}/tokenize", json={"prompt": text}).json()["tokens"]

    return ids


def _assert_ref(path, vector, ids, dimensions=None):
    want = reference(path, ids, "LAST", True, dimensions)
    torch.testing.assert_close(torch.tensor(vector, dtype=torch.float32), want, atol=2e-5, rtol=1e-4)


def test_openai_sdk_float_and_base64(url, client, ids_of):
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == MODEL and [d.index for d in r.data] == [0, 1, 2]
    assert all(d.object == "embedding" and len(d.embedding) == 64 for d in r.data)
    ids = [ids_of(t) for t in TEXTS]
    for d, t in zip(r.data, ids):
        _assert_ref(url[1], d.embedding, t)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    # The SDK's default asks for base64 and decodes it (float32 little-endian). Another request
    # may share its steps with other rows than the first did: the same vector up to the GEMM's
    # rounding for another batch shape.
    b = client.embeddings.create(model=MODEL, input=TEXTS)
    np.testing.assert_allclose([d.embedding for d in b.data], [d.embedding for d in r.data], rtol=0, atol=1e-6)
    raw = httpx.post(f"{url[0]}/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (64,)
    np.testing.assert_allclose(vec, r.data[0].embedding, rtol=0, atol=1e-6)
    assert raw["id"].startswith("embd-") and set(raw["usage"]) == {"prompt_tokens", "total_tokens"}


def test_token_ids_dimensions_truncation_and_a_concurrent_batch(url, client, ids_of):
    ids = [ids_of(t) for t in TEXTS]
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    _assert_ref(url[1], one.data[0].embedding, ids[1])
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    np.testing.assert_allclose(many.data[1].embedding, one.data[0].embedding, rtol=0, atol=1e-6)
    small = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=16, encoding_format="float")
    assert len(small.data[0].embedding) == 16
    _assert_ref(url[1], small.data[0].embedding, ids[0], dimensions=16)
    long = list(range(10, 10 + MAX_MODEL_LEN + 8))
    cut = client.embeddings.create(model=MODEL, input=long, encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN})
    assert cut.usage.prompt_tokens == MAX_MODEL_LEN
    _assert_ref(url[1], cut.data[0].embedding, long[-MAX_MODEL_LEN:])
    # Eight clients at once (max_num_seqs 4: scheduled in shared steps and queued): each its own.
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: client.embeddings.create(model=MODEL, input=ids[i % 3],
                                                               encoding_format="float").data[0].embedding, range(8)))
    np.testing.assert_allclose(got, [many.data[i % 3].embedding for i in range(8)], rtol=0, atol=1e-6)


def test_langchain_and_litellm(url, client):
    lc = pytest.importorskip("langchain_openai")
    want = [d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float").data]
    # check_embedding_ctx_length=False: langchain would otherwise send tiktoken's ids (OpenAI's vocabulary).
    emb = lc.OpenAIEmbeddings(model=MODEL, base_url=f"{url[0]}/v1", api_key="unused", check_embedding_ctx_length=False,
                              max_retries=0)
    np.testing.assert_allclose(emb.embed_documents(TEXTS), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(emb.embed_query(TEXTS[0]), want[0], rtol=0, atol=1e-6)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the cost map
    litellm = pytest.importorskip("litellm")
    r = litellm.embedding(model=f"openai/{MODEL}", api_base=f"{url[0]}/v1", api_key="unused", input=TEXTS,
                          num_retries=0, timeout=60)
    np.testing.assert_allclose([d["embedding"] for d in r.data], want, rtol=0, atol=1e-6)
    assert r.usage.prompt_tokens > 0


def _bad(call, status=400) -> dict:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    assert e.value.status_code == status
    return e.value.body


def test_mistakes_are_400s_naming_the_field(url, client, openai_app):
    too_long = _bad(lambda: client.embeddings.create(model=MODEL, input=list(range(10, 10 + MAX_MODEL_LEN + 1))))
    assert "maximum context length is 64" in too_long["message"] and "truncate_prompt_tokens" in too_long["message"]
    for empty in ("", [], [""], [[]]):
        body = _bad(lambda: client.embeddings.create(model=MODEL, input=empty))
        assert body["param"] == "input" and "empty" in body["message"], body
    body = _bad(lambda: client.embeddings.create(model=MODEL, input="x", dimensions=65))
    assert body["param"] == "dimensions" and "range [1, 64]" in body["message"]
    body = _bad(lambda: client.embeddings.create(model=MODEL, input="x", extra_body={"embed_dtype": "float16"}))
    assert "embed_dtype" in body["message"]
    # The wrong route for the model, both ways, in OpenAI's error shape.
    for call in (lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}]),
                 lambda: client.completions.create(model=MODEL, prompt="hi"),
                 lambda: client.responses.create(model=MODEL, input="hi")):
        body = _bad(call)
        assert "does not support" in body["message"] and "/v1/embeddings" in body["message"], body
    r = httpx.post(f"{url[0]}/v1/messages", json={"model": MODEL, "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "/v1/embeddings" in r.json()["error"]["message"]
    gen = openai.OpenAI(base_url=f"{openai_app}/v1", api_key="unused", max_retries=0, timeout=60)
    body = _bad(lambda: gen.embeddings.create(model=gen.models.list().data[0].id, input="hi"))
    assert body["type"] == "BadRequestError" and body["param"] == "model"
    assert "does not support Embeddings API" in body["message"] and "--runner pooling" in body["message"]
