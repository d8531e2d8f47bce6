"""vLLM's own OpenAI-API tests that use a LoRA adapter, ported to a real pagedserve Serve app
(issue 58's acceptance). Each test names the vLLM test it comes from
(tests/entrypoints/openai/lora/<file>::<test>); its body keeps vLLM's requests and
assertions, and says where it must differ and why.

vLLM's setup, and this one:

    vLLM                                        here
    HuggingFaceH4/zephyr-7b-beta                the tiny random Llama, served under that name
    typeof/zephyr-7b-beta-lora (downloaded)     a random PEFT adapter built by _lora_helpers
    --lora-modules zephyr-lora=... (or JSON     the same: zephyr-lora in the JSON form with its
      with base_model_name), zephyr-lora2=...     base_model_name, zephyr-lora2=<the same files>
    --max-lora-rank 64 --max-cpu-loras 2        the same; --max-loras left at vLLM's default, 1
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True       the same, where the app is built

vLLM starts one server per test file; one app serves all of them here (the union of their
flags), so adapters loaded by one test stay listed for the next, as within one vLLM file.
What differs, named where it does: counts of prompt tokens (vLLM hard-codes zephyr's: 6 and
37; here the server's own /tokenize counts them); usage's prompt_tokens_details, which
pagedserve always sends (cached_tokens: its routing tests and benches read it) and vLLM only
with --enable-prompt-tokens-details, so the expected usage takes the response's; EOS at
temperature 1 (this tiny random model samples its EOS within a few tokens, zephyr does not:
ignore_eos where vLLM counts every sample's tokens); and zephyr-lora2's added tokens (vLLM
V0's LoRA tokenizers, see below).

Not ported:
- lora/test_completion.py::test_added_lora_tokens: an adapter directory's tokenizer with
  added tokens (ids past the base vocabulary, given embeddings by the adapter). That file runs
  vLLM V0 (it sets VLLM_USE_V1=0); V1 dropped LoRA's extra vocabulary, and pagedserve does not
  serve it either: zephyr-lora2 here is vLLM's earlier form, the same files under a second name.
  Its twin for the base model (the added ids are refused as out of vocabulary) is ported.
- lora/test_completion_with_prompt_embeds.py: its adapter is opt125m-lora on OPT (not
  zephyr-lora), and pagedserve does not take prompt_embeds.
- lora/test_lora_resolvers.py, lora/test_default_mm_loras.py: resolver plugins on a mocked
  engine, and multimodal adapters; no zephyr-lora served over HTTP.
- Tests of those files that never name an adapter (structured outputs, logit_bias,
  /invocations, prompt logprobs of the base model): the rest of the suite covers them.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from contextlib import suppress

import httpx
import openai
import pytest

from _lora_helpers import lora_app, make_random_adapter

# Its Serve app and 52 cases take long: under -m scenarios (pyproject.toml), not the default
# run; tests/test_lora_serve.py keeps LoRA over HTTP in it.
pytestmark = pytest.mark.scenarios

MODEL_NAME = "HuggingFaceH4/zephyr-7b-beta"  # the name served; the weights are the tiny random Llama
# No queue-delay door (vLLM has none): test_multiple_lora_adapters sends 20 requests at once.
ENGINE = dict(max_model_len=1024, num_gpu_blocks_override=256, max_num_seqs=8, max_waiting_requests=64,
              max_queue_delay_s=None, dtype="float32", seed=0)

BADREQUEST_CASES = [  # lora/test_lora_adapters.py's, verbatim
    ("test_rank", {"r": 1024}, "is greater than max_lora_rank"),
    ("test_dora", {"use_dora": True}, "does not yet support DoRA"),
    ("test_modules_to_save", {"modules_to_save": ["lm_head"]}, "only supports modules_to_save being None"),
]


@pytest.fixture(scope="module")
def zephyr_lora_files(serve_model, tmp_path_factory):
    return make_random_adapter(serve_model, tmp_path_factory.mktemp("zephyr") / "zephyr-lora", r=16, alpha=16,
                               seed=7)


@pytest.fixture(scope="module")
def server(serve_url, serve_model, zephyr_lora_files):
    from pagedserve.config import EngineConfig

    lora_module_1 = {"name": "zephyr-lora", "path": zephyr_lora_files, "base_model_name": MODEL_NAME}
    cfg = EngineConfig(model=serve_model, served_model_name=MODEL_NAME, enable_lora=True,
                       lora_modules=[json.dumps(lora_module_1), f"zephyr-lora2={zephyr_lora_files}"],
                       max_lora_rank=64, max_cpu_loras=2, **ENGINE)
    with lora_app(serve_url, cfg, "vllm-lora") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def run_async(server, body):
    """``body(client)`` on an AsyncOpenAI client (vLLM's tests are async; these run them so)."""
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await body(client)
    return asyncio.run(main())


def count_tokens(server, **body) -> int:
    """The prompt tokens of a prompt or conversation, as the server counts them (/tokenize)."""
    r = httpx.post(f"{server}/tokenize", json={"model": MODEL_NAME, **body}, timeout=60)
    r.raise_for_status()
    return r.json()["count"]


def load(client, name, path):
    return client.post("load_lora_adapter", cast_to=str, body={"lora_name": name, "lora_path": str(path)})


# ---------------------------------------------------------------- lora/test_models.py

def test_check_models(client, zephyr_lora_files, serve_model):
    """lora/test_models.py::test_check_models. vLLM's root is --model as given (the hub name
    there); here --model is the test model's directory."""
    models = client.models.list().data
    served_model = models[0]
    lora_models = models[1:]
    assert served_model.id == MODEL_NAME
    assert served_model.root == str(serve_model)
    assert all(lora_model.root == zephyr_lora_files for lora_model in lora_models)
    assert lora_models[0].id == "zephyr-lora"


# ---------------------------------------------------------------- lora/test_lora_adapters.py

def test_static_lora_lineage(client, zephyr_lora_files, serve_model):
    """lora/test_lora_adapters.py::test_static_lora_lineage (root: as test_check_models)."""
    models = client.models.list().data
    served_model = models[0]
    lora_models = models[1:]
    assert served_model.id == MODEL_NAME
    assert served_model.root == str(serve_model)
    assert served_model.parent is None
    assert all(lora_model.root == zephyr_lora_files for lora_model in lora_models)
    assert all(lora_model.parent == MODEL_NAME for lora_model in lora_models)
    assert lora_models[0].id == "zephyr-lora"


def test_dynamic_lora_lineage(client, zephyr_lora_files):
    """lora/test_lora_adapters.py::test_dynamic_lora_lineage."""
    response = load(client, "zephyr-lora-3", zephyr_lora_files)
    # Ensure adapter loads before querying /models
    assert "success" in response
    models = client.models.list().data
    dynamic_lora_model = models[-1]
    assert dynamic_lora_model.root == zephyr_lora_files
    assert dynamic_lora_model.parent == MODEL_NAME
    assert dynamic_lora_model.id == "zephyr-lora-3"


def test_dynamic_lora_not_found(client):
    """lora/test_lora_adapters.py::test_dynamic_lora_not_found."""
    with pytest.raises(openai.NotFoundError):
        load(client, "notfound", "/not/an/adapter")


def test_dynamic_lora_invalid_files(client, tmp_path):
    """lora/test_lora_adapters.py::test_dynamic_lora_invalid_files."""
    invalid_files = tmp_path / "invalid_files"
    invalid_files.mkdir()
    (invalid_files / "adapter_config.json").write_text("this is not json")
    with pytest.raises(openai.BadRequestError):
        load(client, "invalid-json", invalid_files)


@pytest.mark.parametrize("test_name,config_change,expected_error", BADREQUEST_CASES)
def test_dynamic_lora_badrequests(client, tmp_path, zephyr_lora_files, test_name, config_change, expected_error):
    """lora/test_lora_adapters.py::test_dynamic_lora_badrequests."""
    test_dir = tmp_path / test_name
    shutil.copytree(zephyr_lora_files, test_dir)
    config_path = test_dir / "adapter_config.json"
    with open(config_path) as f:
        adapter_config = json.load(f)
    adapter_config.update(config_change)
    with open(config_path, "w") as f:
        json.dump(adapter_config, f)
    with pytest.raises(openai.BadRequestError, match=expected_error):
        load(client, test_name, test_dir)


def test_multiple_lora_adapters(server, zephyr_lora_files):
    """lora/test_lora_adapters.py::test_multiple_lora_adapters: 10 adapters loaded and used at
    once, past --max-cpu-loras 2 (the LRU) and --max-loras 1 (one slot: they take turns).
    vLLM checks ``isinstance(task, Exception)``, never true of a Task; here each task's
    exception is checked."""
    async def body(client):
        async def load_and_run_adapter(adapter_name: str):
            await client.post("load_lora_adapter", cast_to=str,
                              body={"lora_name": adapter_name, "lora_path": str(zephyr_lora_files)})
            for _ in range(3):
                await client.completions.create(model=adapter_name, prompt=["Hello there", "Foo bar bazz buzz"],
                                                max_tokens=5)

        lora_tasks = [asyncio.create_task(load_and_run_adapter(f"adapter_{i}")) for i in range(10)]
        results, _ = await asyncio.wait(lora_tasks)
        for r in results:
            assert r.exception() is None, f"Got exception {r.exception()!r}"

    run_async(server, body)


def test_loading_invalid_adapters_does_not_break_others(server, tmp_path, zephyr_lora_files):
    """lora/test_lora_adapters.py::test_loading_invalid_adapters_does_not_break_others."""
    invalid_files = tmp_path / "invalid_files"
    invalid_files.mkdir()
    (invalid_files / "adapter_config.json").write_text("this is not json")

    async def body(client):
        stop_good_requests_event = asyncio.Event()

        async def run_good_requests(client):
            results = []
            while not stop_good_requests_event.is_set():
                try:
                    batch = await client.completions.create(model="zephyr-lora",
                                                            prompt=["Hello there", "Foo bar bazz buzz"],
                                                            max_tokens=5)
                    results.append(batch)
                except Exception as e:
                    results.append(e)
            return results

        good_task = asyncio.create_task(run_good_requests(client))
        for _ in range(25):
            with suppress(openai.NotFoundError):
                await client.post("load_lora_adapter", cast_to=str,
                                  body={"lora_name": "notfound", "lora_path": "/not/an/adapter"})
        for _ in range(25):
            with suppress(openai.BadRequestError):
                await client.post("load_lora_adapter", cast_to=str,
                                  body={"lora_name": "invalid", "lora_path": str(invalid_files)})
        stop_good_requests_event.set()
        results = await good_task
        assert results  # at least the one in flight when the bad loads ended
        for r in results:
            assert not isinstance(r, Exception), f"Got exception {r}"
        # Ensure we can load another adapter and run it
        await client.post("load_lora_adapter", cast_to=str,
                          body={"lora_name": "valid", "lora_path": str(zephyr_lora_files)})
        await client.completions.create(model="valid", prompt=["Hello there", "Foo bar bazz buzz"], max_tokens=5)

    run_async(server, body)


def test_beam_search_with_lora_adapters(server, zephyr_lora_files):
    """lora/test_lora_adapters.py::test_beam_search_with_lora_adapters. vLLM reuses the names
    adapter_0..2 of test_multiple_lora_adapters on the same server, so its loads fail as
    already loaded, unseen (its check looks at Task objects); here they get names of their
    own and each task's exception is checked."""
    async def body(client):
        async def load_and_run_adapter(adapter_name: str):
            await client.post("load_lora_adapter", cast_to=str,
                              body={"lora_name": adapter_name, "lora_path": str(zephyr_lora_files)})
            for _ in range(3):
                await client.completions.create(model=adapter_name, prompt=["Hello there", "Foo bar bazz buzz"],
                                                max_tokens=5, extra_body=dict(use_beam_search=True))

        lora_tasks = [asyncio.create_task(load_and_run_adapter(f"beam_adapter_{i}")) for i in range(3)]
        results, _ = await asyncio.wait(lora_tasks)
        for r in results:
            assert r.exception() is None, f"Got exception {r.exception()!r}"

    run_async(server, body)


# ---------------------------------------------------------------- lora/test_completion.py

@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora", "zephyr-lora2"])
def test_single_completion(server, client, model_name):
    """lora/test_completion.py::test_single_completion (prompt_tokens: the server's count,
    where vLLM writes zephyr's 6)."""
    completion = client.completions.create(model=model_name, prompt="Hello, my name is", max_tokens=5,
                                           temperature=0.0)
    assert completion.id is not None
    assert completion.choices is not None and len(completion.choices) == 1
    choice = completion.choices[0]
    assert len(choice.text) >= 5
    assert choice.finish_reason == "length"
    n = count_tokens(server, prompt="Hello, my name is")
    assert completion.usage == openai.types.CompletionUsage(
        completion_tokens=5, prompt_tokens=n, total_tokens=n + 5,
        prompt_tokens_details=completion.usage.prompt_tokens_details)  # see the module doc
    # test using token IDs
    completion = client.completions.create(model=model_name, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0)
    assert len(completion.choices[0].text) >= 1
    assert completion.choices[0].prompt_logprobs is None


def test_added_lora_tokens_base_model(client, serve_model):
    """lora/test_completion.py::test_added_lora_tokens_base_model: ids past the base model's
    vocabulary (zephyr's 32000..32002 there; this model's vocabulary size and on here)."""
    import transformers

    vocab = transformers.AutoConfig.from_pretrained(serve_model).vocab_size
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.completions.create(model=MODEL_NAME, prompt=[0, 0, vocab, vocab + 1, vocab + 2], echo=True,
                                  max_tokens=5, temperature=0.0)


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora", "zephyr-lora2"])
def test_no_logprobs(client, model_name):
    """lora/test_completion.py::test_no_logprobs."""
    completion = client.completions.create(model=model_name, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=None)
    assert completion.choices[0].logprobs is None


def _top_logprobs(client, model_name, logprobs):
    """The body both of vLLM's test_zero_logprobs and test_some_logprobs share."""
    completion = client.completions.create(model=model_name, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=logprobs)
    choice = completion.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs is not None
    assert choice.logprobs.top_logprobs is not None
    return choice.logprobs.top_logprobs[0]


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora"])
def test_zero_logprobs(client, model_name):
    """lora/test_completion.py::test_zero_logprobs."""
    assert len(_top_logprobs(client, model_name, 0)) == 1


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora"])
def test_some_logprobs(client, model_name):
    """lora/test_completion.py::test_some_logprobs."""
    assert 5 <= len(_top_logprobs(client, model_name, 5)) <= 6


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora"])
def test_too_many_completion_logprobs(client, model_name):
    """lora/test_completion.py::test_too_many_completion_logprobs."""
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.completions.create(model=model_name, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0,
                                  logprobs=21)
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        stream = client.completions.create(model=model_name, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=30, stream=True)
        for _ in stream:
            ...
    # the server should still work afterwards
    completion = client.completions.create(model=model_name, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0)
    assert len(completion.choices[0].text) >= 0


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora"])
def test_completion_streaming(client, model_name):
    """lora/test_completion.py::test_completion_streaming."""
    prompt = "What is an LLM?"
    single_completion = client.completions.create(model=model_name, prompt=prompt, max_tokens=5,
                                                  temperature=0.0)
    single_output = single_completion.choices[0].text
    stream = client.completions.create(model=model_name, prompt=prompt, max_tokens=5, temperature=0.0,
                                       stream=True)
    chunks: list[str] = []
    finish_reason_count = 0
    for chunk in stream:
        chunks.append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason is not None:
            finish_reason_count += 1
    # finish reason should only return in last block
    assert finish_reason_count == 1
    assert chunk.choices[0].finish_reason == "length"
    assert chunk.choices[0].text
    assert "".join(chunks) == single_output


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora"])
def test_parallel_streaming(client, model_name):
    """lora/test_completion.py::test_parallel_streaming."""
    prompt = "What is an LLM?"
    n = 3
    max_tokens = 5
    stream = client.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens, n=n, stream=True,
                                       extra_body={"ignore_eos": True,  # see the module doc
                                                   "return_token_ids": True})
    chunks: list[list[str]] = [[] for _ in range(n)]
    tokens = [0] * n
    finish_reason_count = 0
    for chunk in stream:
        index = chunk.choices[0].index
        chunks[index].append(chunk.choices[0].text)
        tokens[index] += len(chunk.choices[0].token_ids)
        if chunk.choices[0].finish_reason is not None:
            finish_reason_count += 1
    assert finish_reason_count == n
    # vLLM's test wants one chunk per token. A stream the client reads slower than the steps
    # come gets several tokens merged into one chunk (vLLM's output collector merges deltas
    # alike); on a busy 2-core machine that happens, so: every token in some chunk, at most
    # one chunk per token.
    assert tokens == [max_tokens] * n
    for chunk in chunks:
        assert 1 <= len(chunk) <= max_tokens


def _assert_usage_chunk(final_chunk):
    """vLLM's checks of the usage-only chunk after the last choice (include_usage)."""
    assert final_chunk.usage is not None
    assert final_chunk.usage.prompt_tokens > 0
    assert final_chunk.usage.completion_tokens > 0
    assert final_chunk.usage.total_tokens == final_chunk.usage.prompt_tokens + final_chunk.usage.completion_tokens
    assert final_chunk.choices == []


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora"])
def test_completion_stream_options(client, model_name):
    """lora/test_completion.py::test_completion_stream_options."""
    prompt = "What is the capital of France?"
    kw = dict(model=model_name, prompt=prompt, max_tokens=5, temperature=0.0)

    stream = client.completions.create(**kw, stream=True,
                                       stream_options={"include_usage": False, "continuous_usage_stats": False})
    for chunk in stream:
        assert chunk.usage is None

    stream = client.completions.create(**kw, stream=True,
                                       stream_options={"include_usage": False, "continuous_usage_stats": True})
    for chunk in stream:
        assert chunk.usage is None

    stream = client.completions.create(**kw, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": False})
    for chunk in stream:
        if chunk.choices[0].finish_reason is None:
            assert chunk.usage is None
        else:
            assert chunk.usage is None
            _assert_usage_chunk(next(stream))

    stream = client.completions.create(**kw, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    for chunk in stream:
        assert chunk.usage is not None
        assert chunk.usage.prompt_tokens > 0
        assert chunk.usage.completion_tokens > 0
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        if chunk.choices[0].finish_reason is not None:
            _assert_usage_chunk(next(stream))

    for options in ({"include_usage": None}, {"include_usage": True}, {"continuous_usage_stats": None},
                    {"continuous_usage_stats": True}):
        with pytest.raises(openai.BadRequestError):  # stream_options without stream
            client.completions.create(**kw, stream=False, stream_options=options)


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora"])
def test_batch_completions(client, model_name):
    """lora/test_completion.py::test_batch_completions."""
    for prompts in (["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2):
        batch = client.completions.create(model=model_name, prompt=prompts, max_tokens=5, temperature=0.0)
        assert len(batch.choices) == 2
        assert batch.choices[0].text == batch.choices[1].text

        # test n = 2
        batch = client.completions.create(model=model_name, prompt=prompts, n=2, max_tokens=5, temperature=0.0,
                                          extra_body=dict(use_beam_search=True))
        assert len(batch.choices) == 4
        assert batch.choices[0].text != batch.choices[1].text, "beam search should be different"
        assert batch.choices[0].text == batch.choices[2].text, "two copies of the same prompt should be the same"
        assert batch.choices[1].text == batch.choices[3].text, "two copies of the same prompt should be the same"

        # test streaming
        batch = client.completions.create(model=model_name, prompt=prompts, max_tokens=5, temperature=0.0,
                                          stream=True)
        texts = [""] * 2
        for chunk in batch:
            assert len(chunk.choices) == 1
            choice = chunk.choices[0]
            texts[choice.index] += choice.text
        assert texts[0] == texts[1]


@pytest.mark.parametrize("logprobs_arg", [1, 0])
@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora", "zephyr-lora2"])
def test_echo_logprob_completion(client, serve_model, model_name, logprobs_arg):
    """lora/test_completion.py::test_echo_logprob_completion (re.escape: this tokenizer's
    text of token 0 has regex characters, zephyr's does not)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(serve_model)
    for prompt in ("Hello, my name is", [0, 0, 0, 0, 0]):
        completion = client.completions.create(model=model_name, prompt=prompt, max_tokens=5, temperature=0.0,
                                               echo=True, logprobs=logprobs_arg)
        prompt_text = tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
        assert re.search(r"^" + re.escape(prompt_text), completion.choices[0].text)
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None
        assert len(logprobs.text_offset) > 5
        assert len(logprobs.token_logprobs) > 5 and logprobs.token_logprobs[0] is None
        assert len(logprobs.top_logprobs) > 5 and logprobs.top_logprobs[0] is None
        for top_logprobs in logprobs.top_logprobs[1:]:
            assert max(logprobs_arg, 1) <= len(top_logprobs) <= logprobs_arg + 1
        assert len(logprobs.tokens) > 5


# ---------------------------------------------------------------- lora/test_chat.py

MESSAGES = [{"role": "system", "content": "you are a helpful assistant"},
            {"role": "user", "content": "what is 1+1?"}]


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora"])
def test_no_logprobs_chat(client, model_name):
    """lora/test_chat.py::test_no_logprobs_chat."""
    chat_completion = client.chat.completions.create(model=model_name, messages=MESSAGES,
                                                     max_completion_tokens=5, temperature=0.0, logprobs=False)
    assert chat_completion.choices[0].logprobs is None


def _top_logprobs_chat(client, model_name, top_logprobs):
    """The body both of vLLM's test_zero_logprobs_chat and test_some_logprobs_chat share."""
    chat_completion = client.chat.completions.create(model=model_name, messages=MESSAGES,
                                                     max_completion_tokens=5, temperature=0.0, logprobs=True,
                                                     top_logprobs=top_logprobs)
    choice = chat_completion.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.content is not None
    return choice.logprobs.content[0].top_logprobs


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora"])
def test_zero_logprobs_chat(client, model_name):
    """lora/test_chat.py::test_zero_logprobs_chat."""
    assert len(_top_logprobs_chat(client, model_name, 0)) == 0


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora"])
def test_some_logprobs_chat(client, model_name):
    """lora/test_chat.py::test_some_logprobs_chat."""
    assert len(_top_logprobs_chat(client, model_name, 5)) == 5


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora"])
def test_too_many_chat_logprobs(client, model_name):
    """lora/test_chat.py::test_too_many_chat_logprobs."""
    # Default max_logprobs is 20, so this should raise an error
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        stream = client.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=10,
                                                logprobs=True, top_logprobs=21, stream=True)
        for _ in stream:
            ...
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=10,
                                       logprobs=True, top_logprobs=30, stream=False)
    # the server should still work afterwards
    chat_completion = client.chat.completions.create(model=model_name, messages=MESSAGES,
                                                     max_completion_tokens=10, stream=False)
    message = chat_completion.choices[0].message
    assert message.content is not None and len(message.content) >= 0


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora"])
def test_single_chat_session(server, client, model_name):
    """lora/test_chat.py::test_single_chat_session (prompt_tokens: the server's count of the
    conversation, where vLLM writes zephyr's 37; ignore_eos: this samples at temperature 1,
    and the tiny random model draws its end-of-sequence token within 10 tokens now and then,
    where zephyr does not)."""
    messages = list(MESSAGES)
    chat_completion = client.chat.completions.create(model=model_name, messages=messages,
                                                     max_completion_tokens=10, logprobs=True, top_logprobs=5,
                                                     extra_body={"ignore_eos": True})
    assert chat_completion.id is not None
    assert len(chat_completion.choices) == 1
    choice = chat_completion.choices[0]
    assert choice.finish_reason == "length"
    n = count_tokens(server, messages=messages)
    assert chat_completion.usage == openai.types.CompletionUsage(
        completion_tokens=10, prompt_tokens=n, total_tokens=n + 10,
        prompt_tokens_details=chat_completion.usage.prompt_tokens_details)  # see the module doc
    message = choice.message
    assert message.content is not None and len(message.content) >= 10
    assert message.role == "assistant"
    messages.append({"role": "assistant", "content": message.content})
    # test multi-turn dialogue
    messages.append({"role": "user", "content": "express your result in json"})
    chat_completion = client.chat.completions.create(model=model_name, messages=messages,
                                                     max_completion_tokens=10)
    message = chat_completion.choices[0].message
    assert message.content is not None and len(message.content) >= 0


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora"])
def test_chat_streaming(client, model_name):
    """lora/test_chat.py::test_chat_streaming."""
    chat_completion = client.chat.completions.create(model=model_name, messages=MESSAGES,
                                                     max_completion_tokens=10, temperature=0.0)
    output = chat_completion.choices[0].message.content
    stop_reason = chat_completion.choices[0].finish_reason
    stream = client.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=10,
                                            temperature=0.0, stream=True)
    chunks: list[str] = []
    finish_reason_count = 0
    for chunk in stream:
        delta = chunk.choices[0].delta
        if delta.role:
            assert delta.role == "assistant"
        if delta.content:
            chunks.append(delta.content)
        if chunk.choices[0].finish_reason is not None:
            finish_reason_count += 1
    # finish reason should only return in last block
    assert finish_reason_count == 1
    assert chunk.choices[0].finish_reason == stop_reason
    assert delta.content
    assert "".join(chunks) == output


@pytest.mark.parametrize("model_name", [MODEL_NAME, "zephyr-lora"])
def test_chat_completion_stream_options(client, model_name):
    """lora/test_chat.py::test_chat_completion_stream_options."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    kw = dict(model=model_name, messages=messages, max_completion_tokens=10, temperature=0.0)

    stream = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": False})
    for chunk in stream:
        assert chunk.usage is None

    stream = client.chat.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": False})
    for chunk in stream:
        if chunk.choices[0].finish_reason is None:
            assert chunk.usage is None
        else:
            assert chunk.usage is None
            _assert_usage_chunk(next(stream))

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**kw, stream=False, stream_options={"include_usage": None})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**kw, stream=False, stream_options={"include_usage": True})

    stream = client.chat.completions.create(**kw, extra_body=dict(min_tokens=10), stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    last_completion_tokens = 0
    for chunk in stream:
        assert chunk.usage.prompt_tokens >= 0
        assert (last_completion_tokens == 0 or chunk.usage.completion_tokens > last_completion_tokens
                or (not chunk.choices and chunk.usage.completion_tokens == last_completion_tokens))
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        last_completion_tokens = chunk.usage.completion_tokens
    assert last_completion_tokens == 10
