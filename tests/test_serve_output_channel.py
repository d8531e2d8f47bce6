"""The way outputs come back from the engine replica, over real HTTP with the openai
client: the output channel (one ZMQ message per step for all of an ingress's requests,
cluster/wire/output_channel.py). Greedy, from concurrent clients, with n=2 and logprobs:
streamed and plain answers agree, and their tokens are the offline engine's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import SERVE_ENGINE

PROMPTS = ["the quick brown fox", "one two three four five", "a b c", "hello"]


@pytest.fixture(scope="module")
def offline(serve_model):
    from pagedserve.cluster.llm import LLM
    from pagedserve.scheduler.sampling_params import SamplingParams

    llm = LLM(model=serve_model, **{**SERVE_ENGINE, "max_waiting_requests": None})
    try:
        tok = llm.get_tokenizer()
        outs = llm.generate([tok.encode(p) for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


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


def test_the_output_channel_gives_the_offline_engines_answers(openai_app, offline):
    plain, streamed = _answers(openai_app)
    assert all(len(ids) == 12 for answer in plain for _, ids, _, _ in answer)
    assert streamed == plain  # the SSE deltas add up to the whole answer
    assert [[ids for _, ids, _, _ in answer] for answer in plain] == [[ref, ref] for ref in offline]
