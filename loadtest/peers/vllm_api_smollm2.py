"""Three of vLLM's own OpenAI-API tests on SmolLM2-135M-Instruct (the default model), against
``vllm serve`` and ``pagedserve serve`` one after the other (issue 60):

    test_chat.py::test_more_than_one_prompt_logprobs_chat
    test_return_token_ids.py::test_chat_completion_with_tool_use
    test_return_token_ids.py::test_comparison_with_prompt_logprobs_and_logprobs

Each is vLLM's request, and the assertion of it that fails, written here: vLLM runs them on
zephyr-7b-beta and Qwen2.5-1.5B-Instruct, whose output they read (the rank of a prompt token,
a Hermes tool call, an answer that does not end at once). tests/test_vllm_api.py runs all 13
of the issue's tests against pagedserve on a model shaped for them; this shows what vLLM itself
gives on the default model, with the same flags (``--enable-auto-tool-choice --tool-call-parser
hermes``; pagedserve parses Hermes blocks whenever the template renders tools).

    python -m pagedserve.loadtest.peers.vllm_api_smollm2 [--no-vllm] [--no-pagedserve]

Prints one line per (server, test): pass, or what failed; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Who won the world series in 2020?"},
            {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
            {"role": "user", "content": "Where was it played?"}]
WEATHER = [{"role": "system", "content": "You are a helpful assistant."},
           {"role": "user", "content": "What's the weather like in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "required": ["location"], "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]


def prompt_logprobs_entries(base: str, tok) -> tuple[bool, str]:
    """vLLM: the 4th prompt position's entry holds 1 key at prompt_logprobs 1, 2 at 2
    (zephyr's 4th token is its own top 1 there)."""
    sizes = []
    for n in (1, 2):
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120,
                       json={"model": MODEL, "messages": MESSAGES, "prompt_logprobs": n}).json()
        entry = r["prompt_logprobs"][3]
        sizes.append((len(entry), {k: v.get("rank") for k, v in entry.items()}))
    ok = [s for s, _ in sizes] == [1, 2]
    return ok, "" if ok else f"entry sizes {[s for s, _ in sizes]} (vLLM asserts [1, 2]); ranks {sizes[0][1]}"


def tool_use_token_ids(base: str, tok) -> tuple[bool, str]:
    """vLLM: tool_choice auto, return_token_ids; the answer's tokens decode to a Hermes call."""
    r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": WEATHER, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 100,
        "temperature": 0, "logprobs": True, "return_token_ids": True})
    if r.status_code != 200:
        return False, f"HTTP {r.status_code}: {r.text[:200]}"
    body = r.json()
    text = tok.decode(body["choices"][0]["token_ids"])
    ok = text.startswith('<tool_call>\n{"name": "get_weather"')
    return ok, "" if ok else f"the answer's tokens decode to {text[:80]!r}, not a <tool_call> block"


def prompt_and_output_logprobs(base: str, tok) -> tuple[bool, str]:
    """vLLM: echo + logprobs + return_token_ids: the answer's ids end the logprob tokens, fewer of
    them, and the completion's text ends with the answer's ids decoded."""
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Hello, world! How are you today?", "max_tokens": 20, "temperature": 0,
        "echo": True, "logprobs": 1, "return_token_ids": True, "return_tokens_as_token_ids": True,
        "prompt_logprobs": 1}).json()
    choice = r["choices"][0]
    ids = choice["token_ids"]
    lp_ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"] if t.startswith("token_id:")]
    if not (len(ids) < len(lp_ids) and lp_ids[-len(ids):] == ids):
        return False, f"token_ids {ids} against the logprobs' {lp_ids[-len(ids):]}"
    answer = tok.decode(ids)
    ok = choice["text"].endswith(answer)
    return ok, "" if ok else (f"the answer is {len(ids)} token(s), {ids}, decoded {answer!r}; the text "
                              f"ends {choice['text'][-30:]!r}")


TESTS = {"test_chat.py::test_more_than_one_prompt_logprobs_chat": prompt_logprobs_entries,
         "test_return_token_ids.py::test_chat_completion_with_tool_use": tool_use_token_ids,
         "test_return_token_ids.py::test_comparison_with_prompt_logprobs_and_logprobs": prompt_and_output_logprobs}


def run(server, tok) -> dict:
    out = {}
    with server:
        for name, test in TESTS.items():
            try:
                ok, why = test(server.base_url, tok)
            except Exception as e:  # a shape the test did not expect: its failure
                ok, why = False, f"{type(e).__name__}: {e}"
            out[name] = {"passed": ok, "why": why}
            print(f"  {server.name:10s} {name}: {'pass' if ok else 'FAIL: ' + why}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from pagedserve.loadtest.harness.servers import pagedserve_server
    from pagedserve.loadtest.peers.bench_vs_llama_cpp import default_gguf
    from pagedserve.worker.loading.model_source import prepare_gguf

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--no-pagedserve", action="store_true")
    p.add_argument("--log-dir", default=None)
    a = p.parse_args(argv)
    hf_dir = prepare_gguf(default_gguf())  # the GGUF as a Hugging Face directory (what vLLM loads)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    report = {}
    if not a.no_vllm:
        from pagedserve.loadtest.peers.vllm_cpu import setup_vllm, vllm_server

        setup_vllm()
        report["vllm"] = run(vllm_server(hf_dir, served_model_name=MODEL, max_model_len=2048, log_dir=a.log_dir,
                                         extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]),
                             tok)
    if not a.no_pagedserve:
        server = pagedserve_server(default_gguf(), served_model_name=MODEL, max_model_len=2048, log_dir=a.log_dir)
        report["pagedserve"] = run(server, tok)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
