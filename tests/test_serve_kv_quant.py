"""A server with a quantised KV cache (``--kv-cache-dtype int8``), over real HTTP with the
openai client: its greedy tokens are the offline engine's on the same cache format, streamed
and not, from concurrent clients; /metrics reports the 1-byte values and the 1-byte scales per
token; and every block comes back to the pool once the requests are done."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import SERVE_ENGINE, delete_app
from test_api_surface import _scrape

MODEL = "kvq-int8"
# The same GEMM in the server's replica and the offline engine. The default probe picks one
# per process by timing, and two GEMMs round K/V differently in the last bit, which an int8
# code at a rounding boundary turns into a step (a random model has near ties). oneDNN's
# packed GEMM gives the same bits at any batch size.
ENGINE = dict(SERVE_ENGINE, max_waiting_requests=None, kv_cache_dtype="int8", cpu_linear="onednn")
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Paged attention keeps a block table",
           "one two three four five six seven", "A quantised cache holds twice the tokens"]


@pytest.fixture(scope="module")
def url(serve_url, serve_model):
    from ray import serve

    from pagedserve.cluster.app import build_app
    from pagedserve.config import EngineConfig

    cfg = EngineConfig(model=serve_model, served_model_name=MODEL, **ENGINE)
    serve.run(build_app(cfg, name_prefix="kvq-"), name="kv-quant", route_prefix="/kvq")
    yield f"{serve_url}/kvq"
    delete_app("kv-quant")


@pytest.fixture(scope="module")
def offline(serve_model):
    """Greedy token ids of PROMPTS from the offline engine on an int8 cache (no Ray, no HTTP)."""
    from pagedserve.cluster.llm import LLM
    from pagedserve.scheduler.sampling_params import SamplingParams

    llm = LLM(model=serve_model, max_model_len=1024, num_gpu_blocks_override=64, dtype="float32",
              kv_cache_dtype="int8", cpu_linear=ENGINE["cpu_linear"])
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_int8_cache_serves_the_offline_engines_tokens_to_concurrent_clients(url, offline):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    def plain(prompt: str) -> list[int]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        return list(r.choices[0].token_ids)

    def streamed(prompt: str) -> list[int]:
        ids: list[int] = []
        for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True}):
            if c.choices:
                ids += c.choices[0].token_ids or []
        return ids

    with ThreadPoolExecutor(8) as pool:
        got_plain = list(pool.map(plain, PROMPTS))
        got_streamed = list(pool.map(streamed, PROMPTS))
    assert got_plain == offline
    assert got_streamed == offline


def test_metrics_report_the_quantised_bytes_and_the_pool_comes_back(url, offline, serve_model):
    from pagedserve.scheduler.kv.kv_cache_dtype import kv_cache_bytes_per_token
    from pagedserve.worker.model_config import ModelConfig

    deadline = time.monotonic() + 10
    while True:  # replica stats are pushed every 0.1 s; the last request's blocks free at its end
        m = _scrape(url)[1]
        if m["pagedserve:num_free_blocks"] == ENGINE["num_gpu_blocks_override"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert m["pagedserve:num_free_blocks"] == m["pagedserve:num_gpu_blocks"] == ENGINE["num_gpu_blocks_override"]
    cfg = ModelConfig.from_pretrained(str(serve_model))
    per_token = kv_cache_bytes_per_token(cfg.num_hidden_layers, cfg.get_num_kv_heads(1), cfg.head_dim, "int8", 4)
    # 2 (K, V) x layers x KV heads x (head_dim values + 1 scale byte)
    assert per_token == 2 * cfg.num_hidden_layers * cfg.get_num_kv_heads(1) * (cfg.head_dim + 1)
    assert m["pagedserve:kv_cache_bytes_per_token|kv_cache_dtype=int8"] == per_token
    assert m["pagedserve:kv_cache_scale_bytes_per_token|kv_cache_dtype=int8"] == (
        2 * cfg.num_hidden_layers * cfg.get_num_kv_heads(1))
