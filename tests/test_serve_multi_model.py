"""Several models in one app (Ray Serve LLM's ``llm_configs``), over real HTTP.

deploy/serve_config.multi.yaml's two models, "chat" (a generating model) and "embed" (the
demo model under the pooling runner), each its own engine deployment behind one ingress.
The Serve app of this module is built by the real builder (app.py ``app_builder``) from
that file's args, with chat's weights swapped for the suite's tiny random Llama and a LoRA
adapter "sql" of it (the demo model is no transformers checkpoint to make one for).

A user sees: /v1/models lists both and the adapter under its parent; every route (completions,
chat, embeddings, Responses, Anthropic messages, tokenize/detokenize) reaches the model its
``model`` names, which the wrong-route 400s of each engine show (chat asked of "embed" is the
pooling engine's refusal); an unknown model is a 404 listing the served names (Anthropic's
error shape on /v1/messages) and a body without ``model`` Ray Serve LLM's 400; an adapter
loaded at run time names its base model; /metrics carries every model's series under its
``model_name``. Without Ray: the file's args build
two engine deployments with their own options, and mistakes in an entry are refused by name.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from _lora_helpers import make_random_adapter
from conftest import delete_app

MULTI_CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "serve_config.multi.yaml"
PROMPT = [17, 230, 5, 99, 310, 42, 7, 128, 64, 255, 3, 411]


def _args() -> dict:
    return yaml.safe_load(MULTI_CONFIG.read_text())["applications"][0]["args"]


# ------------------------------------------------------------------ without Ray: the builder

def test_the_multi_model_config_builds_one_engine_deployment_per_model():
    from ray.serve.schema import ServeDeploySchema

    from pagedserve.cluster.app import app_builder

    ServeDeploySchema.model_validate(yaml.safe_load(MULTI_CONFIG.read_text()))  # what `serve run` parses
    ingress = app_builder(_args())._bound_deployment
    engines, stats, config = ingress.init_args
    assert ingress.name == "OpenAIIngress" and len(engines) == len(stats) == 2
    chat, embed = (e._bound_deployment for e in engines)
    assert [chat.name, embed.name] == ["EngineDeployment:chat", "EngineDeployment:embed"]
    assert [s._bound_deployment.name for s in stats] == ["StatsAggregator:chat", "StatsAggregator:embed"]
    chat_cfg, embed_cfg = chat.init_args[0], embed.init_args[0]
    assert (chat_cfg.served_model_name, chat_cfg.model, chat_cfg.runner) == ("chat", "pagedserve-demo", "auto")
    assert (embed_cfg.served_model_name, embed_cfg.runner, embed_cfg.max_model_len) == ("embed", "pooling", 512)
    scaling = chat._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (1, 2, 16)
    assert embed._deployment_config.autoscaling_config is None and embed._deployment_config.num_replicas == 1
    # chat may run two replicas: the KV router, which needs the front to tokenize; embed one.
    assert config.tokenize_for_router == (True, False)


def test_llm_configs_in_ray_serve_llms_words():
    from pagedserve.cluster.app import split_llm_config

    cfg, opts = split_llm_config({
        "model_loading_config": {"model_id": "m", "model_source": "pagedserve-demo"},
        "engine_kwargs": {"max-model-len": 256},
        "deployment_config": {"num_replicas": 2, "max_ongoing_requests": 64,
                              "ray_actor_options": {"num_cpus": 0.5}, "request_router": "pow2"},
        "lora_config": {"dynamic_lora_loading_path": "/adapters", "max_num_adapters_per_replica": 4}})
    assert (cfg.served_model_name, cfg.model, cfg.max_model_len) == ("m", "pagedserve-demo", 256)
    assert (cfg.enable_lora, cfg.dynamic_lora_loading_path, cfg.max_cpu_loras) == (True, "/adapters", 4)
    assert opts == dict(min_replicas=2, max_replicas=2, max_ongoing_requests=64, engine_num_cpus=0.5,
                        request_router="pow2")
    cfg, _ = split_llm_config({"model_loading_config": {"model_id": "pagedserve-demo"}})
    assert cfg.model == cfg.served_model_name == "pagedserve-demo"  # model_source defaults to model_id


def test_the_python_builder_takes_the_same_entries():
    from pagedserve.cluster.app import build_openai_app

    engines = build_openai_app(_args()["llm_configs"], name_prefix="x-")._bound_deployment.init_args[0]
    assert [e._bound_deployment.name for e in engines] == ["x-EngineDeployment:chat", "x-EngineDeployment:embed"]


@pytest.mark.parametrize("change, words", [
    (lambda a: a["llm_configs"][0].update(llm_engine="SGLang"), "['llm_engine'] not supported"),
    (lambda a: a["llm_configs"][0]["engine_kwargs"].update(no_such_flag=1), "engine_kwargs: ['no_such_flag']"),
    (lambda a: a["llm_configs"][0]["engine_kwargs"].update(model="x"), "engine_kwargs: ['model']"),
    (lambda a: a["llm_configs"][0]["deployment_config"]["autoscaling_config"].update(initial_replicas=2),
     "autoscaling_config: ['initial_replicas']"),
    (lambda a: a.update(max_num_seqs=4), "args beside llm_configs"),
    (lambda a: a["llm_configs"][1]["model_loading_config"].update(model_id="chat"), "its own model_id"),
    (lambda a: a["llm_configs"][1]["model_loading_config"].pop("model_id"), "model_id is required"),
    (lambda a: a.update(llm_configs=[]), "at least one model"),
])
def test_llm_configs_mistakes_are_named(change, words):
    from pagedserve.cluster.app import app_builder

    args = copy.deepcopy(_args())
    change(args)
    with pytest.raises(ValueError) as e:
        app_builder(args)
    assert words in str(e.value)


# ------------------------------------------------------------------ a real two-model app

@pytest.fixture(scope="module")
def app_root(serve_url, serve_model, tmp_path_factory):
    from ray import serve

    from pagedserve.cluster.app import app_builder

    root = tmp_path_factory.mktemp("multi-lora")
    sql = make_random_adapter(serve_model, root / "sql", r=8, alpha=16, seed=3)
    make_random_adapter(serve_model, root / "late", r=4, alpha=8, seed=4)  # loaded at run time
    args = _args()
    chat, embed = args["llm_configs"]
    chat["model_loading_config"]["model_source"] = str(serve_model)
    chat["engine_kwargs"].update(enable_lora=True, lora_modules=[f"sql={sql}"], max_num_seqs=4,
                                 num_gpu_blocks_override=128, dtype="float32", seed=0)
    embed["engine_kwargs"].update(num_gpu_blocks_override=64, max_num_seqs=4, seed=0)
    for entry in (chat, embed):  # room for both beside the suite's other apps
        entry["deployment_config"]["ray_actor_options"] = {"num_cpus": 0.5}
    before = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # read where the app is built
    try:
        app = app_builder(args)
    finally:
        if before is None:
            del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = before
    serve.run(app, name="multi-model", route_prefix="/multi")
    yield f"{serve_url}/multi", root
    delete_app("multi-model")


@pytest.fixture(scope="module")
def url(app_root):
    return app_root[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.scenarios
def test_models_lists_every_model_and_its_adapters(client):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["chat", "sql", "embed"]
    assert cards["sql"].parent == "chat" and cards["chat"].max_model_len == 1024
    assert cards["embed"].max_model_len == 512 and cards["embed"].root == "pagedserve-demo"


@pytest.mark.scenarios
def test_each_route_reaches_the_model_it_names(url, client):
    c = client.completions.create(model="chat", prompt=PROMPT, max_tokens=4, temperature=0)
    assert c.model == "chat" and c.usage.completion_tokens == 4
    r = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.model == "chat" and r.choices[0].message.role == "assistant"
    e = client.embeddings.create(model="embed", input=["hello world", "paged attention"], encoding_format="float")
    assert e.model == "embed" and [len(d.embedding) for d in e.data] == [256, 256]  # the demo's hidden size
    resp = client.responses.create(model="chat", input="hello", max_output_tokens=3)
    assert resp.model == "chat" and resp.status in ("completed", "incomplete")
    m = httpx.post(f"{url}/v1/messages", json={"model": "chat", "max_tokens": 3,
                                               "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert m.status_code == 200 and m.json()["type"] == "message" and m.json()["model"] == "chat"
    # Each engine refuses the other's API: the request reached the one it named.
    with pytest.raises(openai.BadRequestError, match="does not support Chat Completions API"):
        client.chat.completions.create(model="embed", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="does not support Embeddings API"):
        client.embeddings.create(model="chat", input="hi")


@pytest.mark.scenarios
def test_tokenize_and_detokenize_per_model(url):
    got = {name: httpx.post(f"{url}/tokenize", json={"model": name, "prompt": "hello world"}).json()
           for name in ("chat", "embed")}
    assert (got["chat"]["max_model_len"], got["embed"]["max_model_len"]) == (1024, 512)
    for name, t in got.items():
        back = httpx.post(f"{url}/detokenize", json={"model": name, "tokens": t["tokens"]}).json()
        assert "hello world" in back["prompt"], (name, back)
    infos = {name: httpx.get(f"{url}/tokenizer_info", params={"model": name}) for name in ("chat", "embed")}
    assert all(r.status_code == 200 for r in infos.values()) and infos["chat"].json() != infos["embed"].json()
    assert httpx.get(f"{url}/tokenizer_info").status_code == 400  # which model's: not said


@pytest.mark.scenarios
def test_a_lora_adapter_of_one_model(client):
    base = client.completions.create(model="chat", prompt=PROMPT, max_tokens=10, temperature=0)
    sql = client.completions.create(model="sql", prompt=PROMPT, max_tokens=10, temperature=0)
    ray_form = client.completions.create(model="chat:sql", prompt=PROMPT, max_tokens=10, temperature=0)
    assert sql.model == ray_form.model == "sql"
    assert sql.choices[0].text == ray_form.choices[0].text != base.choices[0].text


@pytest.mark.scenarios
def test_an_adapter_loaded_at_run_time_names_its_base_model(app_root, client):
    url, root = app_root
    late = {"lora_name": "late", "lora_path": str(root / "late")}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=late)
    assert r.status_code == 400 and "base_model_name" in r.text and "'embed'" in r.text
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={**late, "base_model_name": "chat"})
    assert r.status_code == 200, r.text
    assert {m.id: m.parent for m in client.models.list().data}["late"] == "chat"
    assert client.completions.create(model="chat:late", prompt=PROMPT, max_tokens=2).model == "late"
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=2)


@pytest.mark.scenarios
def test_unknown_or_missing_model_lists_the_served_ones(url, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    err = e.value.body
    assert err["param"] == "model" and all(f"`{n}`" in err["message"] for n in ("chat", "sql", "embed"))
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="embed:nope-adapter-of-nothing", input="hi")  # embed has no adapters
    for path in ("/v1/completions", "/v1/embeddings", "/tokenize"):
        body = {"prompt": "hi"} if path != "/v1/embeddings" else {"input": "hi"}
        r = httpx.post(f"{url}{path}", json=body)
        assert r.status_code == 400, (path, r.text)
        assert "Model parameter is required" in r.json()["error"]["message"] and "'embed'" in r.json()["error"]["message"]
    m = httpx.post(f"{url}/v1/messages", json={"model": "nope", "max_tokens": 3,
                                               "messages": [{"role": "user", "content": "hi"}]})
    assert m.status_code == 404
    assert m.json()["type"] == "error" and m.json()["error"]["type"] == "not_found_error"
    assert "`chat`" in m.json()["error"]["message"] and "`embed`" in m.json()["error"]["message"]


@pytest.mark.scenarios
def test_metrics_label_every_model(url, client):
    client.completions.create(model="chat", prompt=PROMPT, max_tokens=2)
    client.embeddings.create(model="embed", input="hi")
    assert httpx.get(f"{url}/health").status_code == 200
    text = httpx.get(f"{url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}  # parses: each family once
    for name in ("vllm:num_requests_running", "vllm:request_success", "vllm:e2e_request_latency_seconds"):
        labels = {s.labels.get("model_name") for s in families[name].samples}
        assert labels == {"chat", "embed"}, (name, labels)
    done = {s.labels["model_name"]: s.value for s in families["vllm:request_success"].samples
            if s.name.endswith("_total") and s.labels.get("finished_reason") == "length"}
    assert done["chat"] >= 1
