"""logit_bias and structured outputs (xgrammar), from the sampler up to the openai SDK.

    sampler      the bitmask masks exactly the forbidden tokens of the constrained rows
                 (same as xgrammar's own kernel), logit_bias shifts the rows that ask
    engine       preemption keeps a request's matcher (no token is fed twice); an ended
                 request frees its matcher; n > 1 gets one matcher per sample
    Serve        the openai SDK against the tiny random test model: json_object,
                 json_schema, regex, choice, grammar (also streamed) hold although the
                 weights are random; bad specs and out-of-vocab logit_bias ids -> 400;
                 constrained and unconstrained requests share a batch

SmolLM2-135M-Instruct behind Serve: tests/test_serve_real_model.py.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch

from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.worker.sampler import Sampler, apply_token_bitmask_, apply_token_bitmask_torch_
from pagedserve.worker.sampling_metadata import SamplingMetadata

SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["name", "age", "ok", "color"]}
REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.com"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'root ::= "(" [0-9] [0-9]? (" + " [0-9])? ")"'


# ---------------------------------------------------------------- sampler units
def _md(params, vocab, bitmask=None):
    n = len(params)
    return SamplingMetadata.build(params, [None] * n, [[1]] * n, [[]] * n, [set()] * n, vocab, "cpu",
                                  bitmask)


def test_bitmask_masks_exactly_the_forbidden_tokens_of_constrained_rows():
    xgr = pytest.importorskip("xgrammar")
    vocab = 100  # 4 words, the last one partly past the vocabulary
    bm = xgr.allocate_token_bitmask(3, vocab)  # one row per logits row; row 1 is free
    bm.fill_(-1)
    bm[0].zero_()
    bm[0, 1] = 1 << 5  # row 0 allows token 37 only
    bm[2, 0] = 0  # row 2 allows all but tokens 0..31
    logits = torch.randn(3, vocab)
    ours, plain = logits.clone(), logits.clone()
    apply_token_bitmask_(ours, [0, 2], bm)  # xgrammar's kernel
    apply_token_bitmask_torch_(plain, [0, 2], bm)  # the fallback without xgrammar
    assert torch.equal(ours, plain)
    assert torch.isinf(ours[0]).sum() == vocab - 1 and ours[0].argmax() == 37
    assert torch.equal(ours[1], logits[1])  # unconstrained row untouched
    assert torch.isinf(ours[2, :32]).all() and torch.equal(ours[2, 32:], logits[2, 32:])
    wide = torch.randn(1, 140)  # logits wider than the mask's 128 tokens: the tail is banned
    apply_token_bitmask_(wide, [0], bm[2:])
    assert torch.isinf(wide[0, 128:]).all() and not torch.isinf(wide[0, 32:128]).any()

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.0)]
    for _ in range(5):  # a random row too samples only allowed tokens
        out = Sampler()(logits, _md(params, vocab, [bm[0].numpy(), bm[0].numpy(), None]))
        assert out.sampled_token_ids[:2].tolist() == [37, 37]
        assert out.sampled_token_ids[2] == logits[2].argmax()


def test_logit_bias_forces_and_bans_greedy_and_random_rows():
    vocab = 50
    logits = torch.randn(3, vocab)
    top = logits.argmax(dim=-1)
    params = [SamplingParams(temperature=0.0, logit_bias={7: 100.0}),
              SamplingParams(temperature=0.0, logit_bias={int(top[1]): -100.0}),
              SamplingParams(temperature=1.0, seed=0, logit_bias={11: 100})]
    before = logits.clone()
    out = Sampler()(logits, _md(params, vocab)).sampled_token_ids.tolist()
    assert out[0] == 7 and out[1] != top[1] and out[2] == 11
    assert torch.equal(logits, before)  # the caller's logits are never written to


def test_params_validation():
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={3: 100.5})
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.kind == "regex"


# ---------------------------------------------------------------- engine
def test_engine_n_samples_preemption_and_freeing(serve_model):
    """n=3 under a KV pool so small that requests are preempted and recomputed: every
    sample matches the regex and equals its twin of a run without preemption (seeded), so
    the recompute kept each matcher's state and fed it no token twice; no matcher
    outlives its request; bad specs and ids are refused before anything is queued."""
    from pagedserve.cluster.llm import LLM

    so = StructuredOutputsParams(regex=r"([a-z]{2,3} ){4,6}[a-z]{2,3}\.")
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=40, structured_outputs=so)
    texts, preemptions = [], []
    for blocks in (10, 64):  # measured: 10 blocks of 4 tokens -> 8 preemptions
        llm = LLM(model=serve_model, max_model_len=64, block_size=4, num_gpu_blocks_override=blocks,
                  max_num_batched_tokens=32, enable_prefix_caching=False, dtype="float32")
        try:
            outs = llm.generate(["page memory cache block serve"] * 2, params, use_tqdm=False)
            preemptions.append(llm.stats()["num_preemptions"])
            texts.append([c.text for o in outs for c in o.outputs])
            for o in outs:
                for c in o.outputs:
                    assert c.finish_reason == "stop" and re.fullmatch(so.regex, c.text), c
            assert llm.engine.structured.matchers == {}
            if blocks == 64:
                # ignore_eos: the scheduler does not stop on EOS, the finished grammar does.
                [o] = llm.generate(["x"], SamplingParams(max_tokens=30, ignore_eos=True, min_tokens=5,
                                   structured_outputs=StructuredOutputsParams(choice=CHOICES)),
                                   use_tqdm=False)
                assert o.outputs[0].finish_reason == "stop" and o.outputs[0].text in CHOICES
                with pytest.raises(ValueError, match="invalid regex"):
                    llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(
                        regex="(a")), use_tqdm=False)
                with pytest.raises(ValueError, match="token id 512"):
                    llm.generate(["x"], SamplingParams(logit_bias={512: 1.0}), use_tqdm=False)
        finally:
            llm.shutdown()
    assert preemptions[0] > 0 and preemptions[1] == 0
    assert texts[0] == texts[1]


# ---------------------------------------------------------------- Serve + openai SDK
@pytest.fixture(scope="module")
def client(openai_app):
    return openai.OpenAI(base_url=f"{openai_app}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def _chat(client, model_name, **kw):
    kw.setdefault("max_tokens", 120)
    r = client.chat.completions.create(model=model_name, temperature=1.0, seed=kw.pop("seed", 0),
                                       messages=[{"role": "user", "content": "Give me data."}], **kw)
    return r.choices[0]


def test_json_schema_and_json_object_over_chat(client, model_name):
    for seed in range(3):
        c = _chat(client, model_name, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    c = _chat(client, model_name, response_format={"type": "json_object"}, max_tokens=200)
    assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict), c


def test_json_object_is_an_object_not_any_json_value(serve_model):
    """OpenAI's json_object: an object, with one separator style and no free whitespace.
    (The builtin JSON grammar took any JSON value: a random model answered "[3\t\n\t]".)"""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pagedserve.cluster.engine.structured_output import StructuredOutputManager

    tok = AutoTokenizer.from_pretrained(serve_model)
    grammar = StructuredOutputManager(tok, len(tok), [tok.eos_token_id]).compile(
        StructuredOutputsParams(json_object=True))
    for text in ("[3]", "3", '"x"', "{ }", '{\n"a": 1}'):
        assert not xgr.GrammarMatcher(grammar).accept_string(text), text
    m = xgr.GrammarMatcher(grammar)
    assert m.accept_string('{"a": [1, {"b": null}], "c": "d"}') and m.is_completed()


def test_regex_choice_grammar_over_completions_and_streamed(client, model_name):
    cases = [({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
             ({"choice": CHOICES}, lambda t: t in CHOICES),
             ({"grammar": GRAMMAR}, lambda t: re.fullmatch(r"\(\d\d?( \+ \d)?\)", t))]
    for so, ok in cases:
        r = client.completions.create(model=model_name, prompt="page memory", max_tokens=40,
                                      temperature=1.0, seed=1, extra_body={"structured_outputs": so})
        assert r.choices[0].finish_reason == "stop" and ok(r.choices[0].text), (so, r)
        chunks = list(client.completions.create(
            model=model_name, prompt="page memory", max_tokens=40, temperature=1.0, seed=1,
            stream=True, extra_body={"structured_outputs": so}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    # vLLM's older names are honoured too.
    r = client.completions.create(model=model_name, prompt="x", max_tokens=20,
                                  extra_body={"guided_choice": CHOICES})
    assert r.choices[0].text in CHOICES


def test_constrained_and_unconstrained_share_a_batch(openai_app, model_name):
    async def one(http, body):
        r = await http.post(f"{openai_app}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    base = dict(model=model_name, prompt="page memory cache", temperature=1.0, seed=5)
    free = dict(base, max_tokens=24, ignore_eos=True)

    async def main(bodies):
        async with httpx.AsyncClient() as http:
            return await asyncio.gather(*(one(http, b) for b in bodies))

    free1, free2, constrained = asyncio.run(main([free, free, dict(base, max_tokens=120, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})]))
    jsonschema.validate(json.loads(constrained["text"]), SCHEMA)
    # The mask touched the constrained row only: a seeded free row samples what it does alone.
    [alone] = asyncio.run(main([free]))
    assert free1["text"] == free2["text"] == alone["text"] and free1["finish_reason"] == "length"


def test_logit_bias_over_http(client, model_name, openai_app):
    r = client.completions.create(model=model_name, prompt="page memory", max_tokens=8,
                                  temperature=1.0, logit_bias={"300": 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    ids = httpx.post(f"{openai_app}/tokenize", json={"prompt": r.choices[0].text,
                                                     "add_special_tokens": False}).json()["tokens"]
    assert set(ids) == {300}
    greedy = dict(model=model_name, prompt="page memory", max_tokens=1, temperature=0.0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    top = client.completions.create(**greedy).choices[0].model_extra["token_ids"][0]
    banned = client.completions.create(logit_bias={str(top): -100}, **greedy)
    assert banned.choices[0].model_extra["token_ids"][0] != top


@pytest.mark.parametrize("body, needle", [
    ({"logit_bias": {"99999": 5}}, "token id 99999"),
    ({"logit_bias": {"abc": 5}}, "cannot be converted to integer token IDs"),
    ({"logit_bias": {"5": 101}}, "[-100, 100]"),
    ({"structured_outputs": {"regex": "(ab"}}, "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "invalid grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "invalid JSON schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "one output constraint"),
    ({"guided_whitespace_pattern": " *", "guided_json": {}}, "guided_whitespace_pattern"),
])
def test_bad_constraints_are_400_naming_the_problem(openai_app, model_name, body, needle):
    for route, extra in (("completions", {"prompt": "x"}),
                         ("chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = httpx.post(f"{openai_app}/v1/{route}", json={"model": model_name, **extra, **body}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert needle in err["message"] and err["type"] == "BadRequestError", err
