"""The two ways outputs come back from the engine replica, over real HTTP with the openai
client: the default output channel (one ZMQ message per step, cluster/wire/output_channel.py)
and ``PAGEDSERVE_OUTPUT_CHANNEL=ray`` (one Ray stream item per request per step). Greedy,
on the same model: the same tokens, streamed or not, with n=2 and logprobs, from concurrent
clients."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import SERVE_ENGINE

PROMPTS = ["the quick brown fox", "one two three four five", "a b c", "hello"]


@pytest.fixture(scope="module")
def ray_url(serve_url, serve_model):
    from ray import serve

    from pagedserve.cluster.app import build_app
    from pagedserve.config import EngineConfig

    cfg = EngineConfig(model=serve_model, **SERVE_ENGINE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_OUTPUT_CHANNEL", "ray")  # read where the app is built
        app = build_app(cfg, name_prefix="raych-")
    serve.run(app, name="ray-channel", route_prefix="/raych")
    yield f"{serve_url}/raych"
    serve.delete("ray-channel")


def _answers(url: str) -> list:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=3, timeout=120)
    model = client.models.list().data[0].id
    kw = dict(model=model, max_tokens=12, temperature=0, n=2, logprobs=2,
              extra_body={"ignore_eos": True, "return_token_ids": True})

    def plain(prompt):
        r = client.completions.create(prompt=prompt, **kw)
        return [(c.index, list(c.token_ids), c.text, c.logprobs.tokens) for c in r.choices]

    def streamed(prompt):
        got: dict[int, list] = {}
        for chunk in client.completions.create(prompt=prompt, stream=True, **kw):
            for c in chunk.choices:
                entry = got.setdefault(c.index, [[], "", []])
                entry[0] += c.token_ids or []
                entry[1] += c.text or ""
                entry[2] += (c.logprobs.tokens if c.logprobs else []) or []
        return sorted((i, ids, text, toks) for i, (ids, text, toks) in got.items())

    with ThreadPoolExecutor(4) as pool:  # at once: several requests share each step's message
        return [list(pool.map(plain, PROMPTS)), list(pool.map(streamed, PROMPTS))]


def test_the_output_channel_and_the_ray_stream_give_the_same_answers(openai_app, ray_url):
    over_channel = _answers(openai_app)
    over_ray = _answers(ray_url)
    plain, streamed = over_channel
    assert all(len(ids) == 12 for answer in plain for _, ids, _, _ in answer)
    assert streamed == plain  # the SSE deltas add up to the whole answer
    assert over_ray == over_channel


def test_an_unknown_output_channel_is_refused_where_the_app_is_built(monkeypatch):
    from pagedserve.cluster.front.edge import IngressConfig

    monkeypatch.setenv("PAGEDSERVE_OUTPUT_CHANNEL", "pigeon")
    with pytest.raises(ValueError, match="PAGEDSERVE_OUTPUT_CHANNEL must be zmq or ray"):
        IngressConfig.from_options()
    monkeypatch.delenv("PAGEDSERVE_OUTPUT_CHANNEL")
    assert IngressConfig.from_options().output_channel == "zmq"
