"""LoRA adapters through the real server, as a vLLM user drives it: the openai client names
an adapter as its model (``"sql"`` or Ray Serve LLM's ``"<base>:sql"``) and gets the tokens
of transformers with that adapter merged by peft; /v1/models lists the adapters with their
parent and root; an unknown adapter is vLLM's 404; with VLLM_ALLOW_RUNTIME_LORA_UPDATING an
adapter is loaded and unloaded at run time, and a bad one is refused with its reason.
"""

from __future__ import annotations

import os

import httpx
import openai
import pytest
import torch

from _lora_helpers import hf_greedy, lora_app, make_random_adapter, merged_model
from conftest import SERVE_ENGINE

BASE = "base-model"
PROMPT = [17, 230, 5, 99, 310, 42, 7, 128, 64, 255, 3, 411]
NUM_NEW = 10


@pytest.fixture(scope="module")
def adapters(serve_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-lora")
    return {"sql": make_random_adapter(serve_model, root / "sql", r=8, alpha=16, seed=3),
            "chat": make_random_adapter(serve_model, root / "chat", r=4, alpha=8, use_rslora=True,
                                        targets=["q_proj", "o_proj", "up_proj"], seed=4),
            "too-big": make_random_adapter(serve_model, root / "too-big", r=32, targets=["q_proj"], seed=5),
            # --dynamic-lora-loading-path: "dyn" (sql's weights: same settings and seed), and a
            # folder whose adapter_config.json is not JSON
            "dynamic": _dynamic_folder(serve_model, root / "dynamic")}


def _dynamic_folder(serve_model, folder) -> str:
    make_random_adapter(serve_model, folder / "dyn", r=8, alpha=16, seed=3)
    (folder / "broken").mkdir()
    (folder / "broken" / "adapter_config.json").write_text("this is not json")
    return str(folder)


@pytest.fixture(scope="module")
def url(serve_url, serve_model, adapters):
    from pagedserve.config import EngineConfig

    cfg = EngineConfig(model=serve_model, served_model_name=BASE, enable_lora=True, max_loras=2,
                       lora_modules=[f"sql={adapters['sql']}"], dynamic_lora_loading_path=adapters["dynamic"],
                       **SERVE_ENGINE)
    with lora_app(serve_url, cfg, "lora") as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oracle(serve_model, adapters):
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(serve_model, dtype=torch.float32).eval()
    ref = {None: hf_greedy(base, PROMPT, NUM_NEW)}
    for name in ("sql", "chat"):
        ref[name] = hf_greedy(merged_model(serve_model, adapters[name]), PROMPT, NUM_NEW)
    assert ref["sql"] != ref[None] and ref["chat"] != ref[None]
    return ref


def _tokens(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=NUM_NEW, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.model == model.split(":")[-1]  # the adapter's name, or the base model's (vLLM's)
    return r.choices[0].token_ids


def test_models_list_the_adapters_with_parent_and_root(client, adapters, serve_model):
    cards = {c.id: c for c in client.models.list().data}
    assert list(cards) == [BASE, "sql"]
    assert cards[BASE].root == str(serve_model) and cards[BASE].parent is None
    assert cards["sql"].root == adapters["sql"] and cards["sql"].parent == BASE


def test_an_adapter_by_name_gives_the_merged_models_tokens(client, oracle):
    assert _tokens(client, "sql") == oracle["sql"]
    assert _tokens(client, f"{BASE}:sql") == oracle["sql"]
    assert _tokens(client, BASE) == oracle[None]
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert chat.model == "sql" and chat.usage.completion_tokens == 4


def test_unknown_adapter_is_vllms_404(url, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    err = e.value.body
    assert err["code"] == 404 and "The model `nope` does not exist." in err["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": f"{BASE}:nope", "messages": [
        {"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_load_use_and_unload_at_run_time(url, client, adapters, oracle):
    load = lambda body: httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)  # noqa: E731
    r = load({"lora_name": "chat", "lora_path": adapters["chat"]})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' added successfully."
    assert [c.id for c in client.models.list().data] == [BASE, "sql", "chat"]
    assert _tokens(client, "chat") == oracle["chat"]
    assert _tokens(client, "sql") == oracle["sql"]  # two adapters, two slots: both still right
    again = load({"lora_name": "chat", "lora_path": adapters["chat"]})
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    big = load({"lora_name": "big", "lora_path": adapters["too-big"]})
    assert big.status_code == 400 and "rank 32" in big.json()["error"]["message"] \
        and "is greater than max_lora_rank 16" in big.json()["error"]["message"]
    missing = load({"lora_name": "gone", "lora_path": "/nonexistent/adapter"})  # vLLM's 404
    assert missing.status_code == 404 and "No adapter found for" in missing.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=60)
    assert r.status_code == 200 and "removed successfully" in r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", prompt="hi", max_tokens=2)
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'chat' cannot be found."


def test_an_adapter_in_the_dynamic_loading_path_loads_on_first_use(url, client, adapters, oracle):
    """--dynamic-lora-loading-path (Ray Serve LLM's): a request naming "dyn" loads the folder
    dyn there on first use (its tokens are the merged model's), and /v1/models lists it from
    then on; a folder there with a broken adapter is a 400 naming the problem; a name with no
    folder stays vLLM's 404, and a path is never taken as a name."""
    assert "dyn" not in [c.id for c in client.models.list().data]
    assert _tokens(client, "dyn") == oracle["sql"]  # sql's weights
    assert _tokens(client, f"{BASE}:dyn") == oracle["sql"]
    card = next(c for c in client.models.list().data if c.id == "dyn")
    assert card.root == os.path.join(adapters["dynamic"], "dyn") and card.parent == BASE
    with pytest.raises(openai.BadRequestError, match="is not valid JSON"):
        client.completions.create(model="broken", prompt="hi", max_tokens=2)
    for name in ("absent", "../dynamic/dyn", ".."):
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=name, prompt="hi", max_tokens=2)

