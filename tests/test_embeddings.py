"""The pooling runner (embeddings, issue 60 item 2), offline: ``LLM(..., runner="pooling")
.embed()`` against transformers' hidden states pooled by hand, fp32, on two tiny random
decoder embedding models written as sentence-transformers ships them:

    qwen3   Qwen3-Embedding's shape: the bare decoder's weights (no ``model.`` prefix, no
            lm_head) under config.json's Qwen3ForCausalLM, modules.json with LAST pooling
            and a Normalize module, ``is_matryoshka`` (``dimensions`` allowed)
    llama   the Llama causal-LM checkpoint (lm_head and all), MEAN pooling, no Normalize

through each of the engine's ways to run a prompt: batched together, chunked (a 16-token
budget: MEAN sums its chunks), from the prefix cache (LAST reads it; MEAN and CLS compute
every position instead), preempted and recomputed (a pool too small for the batch), and
with async scheduling. Then what is refused and how: dimensions on a model without
Matryoshka, an input over max_model_len unless truncate_prompt_tokens asks, generation on
an embedding engine and the reverse, a bare decoder asked to generate. sentence-transformers
is compared too where it is installed (it is not a dependency: the test is skipped without it).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedserve.cluster.llm import LLM
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.loading.model_cache import build_once
from pagedserve.worker.loading.random_models import make_random_embedder

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
MAX_MODEL_LEN = 96
LENS = [1, 5, 17, 40, 63]  # one token, inside a block, past one, several blocks, past a 16-token chunk x3


def embedder_path(name: str, root) -> str:
    """The two test models (see the module doc), built once per machine."""
    if name == "qwen3":
        make = lambda tmp: make_random_embedder(tmp, "qwen3", pooling="LAST", normalize=True, headless=True,
                                                config_updates={"is_matryoshka": True}, head_dim=32, **SMALL)
    else:
        make = lambda tmp: make_random_embedder(tmp, "llama", pooling="MEAN", normalize=False, headless=False,
                                                seed=3, **SMALL)
    return build_once(os.path.join(os.fspath(root), f"embed-{name}"), make)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "embed-models"
    return {name: embedder_path(name, root) for name in ("qwen3", "llama")}


def _prompts(lens=LENS, seed=11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(n)] for n in lens]


_HF: dict[str, torch.nn.Module] = {}


def reference(path: str, ids: list[int], pooling: str, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """transformers' last hidden states of ``ids`` (AutoModel: the bare decoder), pooled by hand."""
    import transformers

    if path not in _HF:
        _HF[path] = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        h = _HF[path](torch.tensor([ids])).last_hidden_state[0].float()
    vec = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling]
    if dimensions is not None:
        vec = vec[:dimensions]
    return F.normalize(vec, dim=-1) if normalize else vec


def _llm(path: str, **kw) -> LLM:
    args = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64, seed=0)
    args.update(kw)
    return LLM(model=path, **args)


EXPECTED = {"qwen3": ("LAST", True), "llama": ("MEAN", False)}


def _check(path: str, name: str, outs, prompts, dimensions=None, pooling=None, normalize=None):
    ptype, norm = EXPECTED[name]
    ptype, norm = pooling or ptype, norm if normalize is None else normalize
    assert len(outs) == len(prompts)
    for out, ids in zip(outs, prompts):
        assert out.prompt_token_ids == ids
        got = torch.tensor(out.outputs.embedding)
        want = reference(path, ids, ptype, norm, dimensions)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_embeddings_equal_transformers_pooled_by_hand(models, name):
    """Batched, then the same prompts again (LAST reads the prefix cache, MEAN computes every
    position), then chunked by a 16-token budget, and with async scheduling: the same vectors
    each time."""
    path = models[name]
    prompts = _prompts()
    llm = _llm(path)
    assert llm.engine.runner == "pooling"  # runner auto: the checkpoint's modules.json
    _check(path, name, llm.embed(prompts, use_tqdm=False), prompts)
    hits_before = llm.stats()["prefix_cache_hits"]
    _check(path, name, llm.embed(prompts, use_tqdm=False), prompts)
    hits = llm.stats()["prefix_cache_hits"] - hits_before
    if name == "qwen3":
        assert hits == sum((n - 1) // 16 * 16 for n in LENS)  # every full block but the last token's
    else:
        assert hits == 0  # MEAN needs every position's hidden state: no hit is read
    llm.shutdown()
    for kw in (dict(max_num_batched_tokens=16), dict(async_scheduling=True, max_num_batched_tokens=16)):
        llm = _llm(path, **kw)
        _check(path, name, llm.embed(prompts, use_tqdm=False), prompts)
        llm.shutdown()


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_a_prompt_preempted_mid_chunk_is_recomputed_exactly(models, name):
    """A pooling request ends as soon as its prompt has run, so a pool rarely has to preempt
    one; when it does (here by hand, after its first 16-token chunk), it restarts from
    position 0 (MEAN: its running sum starts over) and its vector is unchanged."""
    path = models[name]
    prompts = _prompts([40, 63])
    llm = _llm(path, max_num_batched_tokens=16, enable_prefix_caching=False)
    engine = llm.engine
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=None, detokenize=False), pooling=PoolingParams())
    engine.step()
    sched = engine.scheduler
    assert [r.num_computed_tokens for r in sched.running] == [16]
    sched._preempt(0)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert sched.num_preemptions == 1
    for i, ids in enumerate(prompts):
        out = outs[f"r{i}"]
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == []
        torch.testing.assert_close(torch.tensor(out.embedding), reference(path, ids, *EXPECTED[name]),
                                   atol=2e-5, rtol=1e-4)
    assert engine.executor.worker.runner._pool_partial == {}
    llm.shutdown()


def test_text_prompts_dimensions_normalize_and_the_pooler_config(models):
    path = models["qwen3"]
    llm = _llm(path)
    texts = ["hello world", "paged attention keeps a block table for every request"]
    outs = llm.embed(texts, use_tqdm=False)
    tok = llm.get_tokenizer()
    assert [o.prompt_token_ids for o in outs] == [tok.encode(t) for t in texts]
    _check(path, "qwen3", outs, [tok.encode(t) for t in texts])
    # Matryoshka: the first 16 entries, renormalised (is_matryoshka in config.json).
    outs = llm.embed(texts, PoolingParams(dimensions=16), use_tqdm=False)
    _check(path, "qwen3", outs, [o.prompt_token_ids for o in outs], dimensions=16)
    outs = llm.embed(texts, PoolingParams(normalize=False), use_tqdm=False)
    _check(path, "qwen3", outs, [o.prompt_token_ids for o in outs], normalize=False)
    with pytest.raises(ValueError, match=r"dimensions in range \[1, 64\], got 65"):
        llm.embed(texts, PoolingParams(dimensions=65), use_tqdm=False)
    llm.shutdown()
    # The operator's pooler config over the checkpoint's: CLS (which reads no prefix hit either).
    llm = _llm(models["llama"], pooler_config={"pooling_type": "CLS", "normalize": True})
    prompts = _prompts([3, 40])
    _check(models["llama"], "llama", llm.embed(prompts, use_tqdm=False), prompts, pooling="CLS", normalize=True)
    _check(models["llama"], "llama", llm.embed(prompts, use_tqdm=False), prompts, pooling="CLS", normalize=True)
    assert llm.stats()["prefix_cache_hits"] == 0
    llm.shutdown()


def test_refusals(models, tmp_path):
    llm = _llm(models["llama"])
    with pytest.raises(ValueError, match="does not support Matryoshka embeddings; dimensions must be unset"):
        llm.embed("hello", PoolingParams(dimensions=8), use_tqdm=False)
    too_long = _prompts([MAX_MODEL_LEN + 1])[0]
    with pytest.raises(ValueError, match="maximum context length is 96 tokens.*truncate_prompt_tokens"):
        llm.embed([too_long], use_tqdm=False)
    # An input may fill max_model_len (nothing is generated after it); truncation keeps its last k.
    full = llm.embed([too_long[:MAX_MODEL_LEN]], use_tqdm=False)[0]
    assert len(full.prompt_token_ids) == MAX_MODEL_LEN
    cut = llm.embed([too_long], truncate_prompt_tokens=MAX_MODEL_LEN, use_tqdm=False)[0]
    assert cut.prompt_token_ids == too_long[-MAX_MODEL_LEN:]
    _check(models["llama"], "llama", [cut], [too_long[-MAX_MODEL_LEN:]])
    with pytest.raises(ValueError, match="does not support Completions API.*--runner generate"):
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
    # The same checkpoint served to generate (it has an LM head) refuses embeddings, saying how.
    gen = _llm(models["llama"], runner="generate")
    assert len(gen.generate(["hello"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
               .outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="does not support Embeddings API.*--runner pooling.*--task embed"):
        gen.embed("hello", use_tqdm=False)
    gen.shutdown()
    # --task embed is --runner pooling; a bare decoder (architectures ["Qwen3Model"]) pools by
    # default and cannot generate.
    from pagedserve.config import EngineConfig

    assert EngineConfig(task="embed").runner == "pooling"
    with pytest.raises(ValueError, match="task 'embed' means runner 'pooling'"):
        EngineConfig(task="embed", runner="generate")
    with pytest.raises(ValueError, match="LoRA adapters"):
        EngineConfig(runner="pooling", enable_lora=True)
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in os.listdir(models["qwen3"]):  # the same weights, no sentence-transformers files
        if f not in ("modules.json", "1_Pooling", "2_Normalize", "config.json"):
            os.symlink(os.path.join(models["qwen3"], f), bare / f)
    hf = json.loads((Path(models["qwen3"]) / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**hf, "architectures": ["Qwen3Model"]}))
    from pagedserve.worker.model_config import ModelConfig

    cfg = ModelConfig.from_pretrained(bare)
    assert (cfg.runner, cfg.pooler.pooling_type, cfg.pooler.normalize) == ("pooling", "LAST", True)
    with pytest.raises(ValueError, match="no LM head.*--runner pooling"):
        ModelConfig.from_pretrained(bare, runner="generate")
    # The checkpoint without modules.json and its weights named as transformers' AutoModel
    # writes them: pooled as vLLM's default for a decoder (LAST, normalised).
    llm = _llm(str(bare))
    prompts = _prompts([9])
    _check(models["qwen3"], "qwen3", llm.embed(prompts, use_tqdm=False), prompts)
    llm.shutdown()


def test_sentence_transformers_agrees(models):
    """Where sentence-transformers is installed (not a dependency), its encode() of each
    model equals ours: it reads the same modules.json and 1_Pooling config."""
    st = pytest.importorskip("sentence_transformers")
    texts = ["hello world", "the quick brown fox jumps over the lazy dog"]
    for name in ("qwen3", "llama"):
        llm = _llm(models[name])
        ours = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
        llm.shutdown()
        theirs = st.SentenceTransformer(models[name], device="cpu").encode(texts, convert_to_tensor=True).float()
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_pooler_config_parsing(tmp_path):
    from pagedserve.worker.pooler import resolve_pooler_config

    def write(modules, pool):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        (d / "1_Pooling").mkdir(parents=True)
        (d / "modules.json").write_text(json.dumps(modules))
        (d / "1_Pooling" / "config.json").write_text(json.dumps(pool))
        return str(d)

    tr = {"path": "", "type": "sentence_transformers.models.Transformer"}
    pool = {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    norm = {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
    cfg = resolve_pooler_config(write([tr, pool, norm], {"pooling_mode_cls_token": True}))
    assert (cfg.pooling_type, cfg.normalize) == ("CLS", True)
    cfg = resolve_pooler_config(write([tr, pool], {"pooling_mode": "mean"}))  # newer sentence-transformers
    assert (cfg.pooling_type, cfg.normalize) == ("MEAN", False)
    assert resolve_pooler_config(str(tmp_path / "none")).pooling_type == "LAST"  # no modules.json
    with pytest.raises(ValueError, match="pooling_mode_max_tokens is not supported"):
        resolve_pooler_config(write([tr, pool], {"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="Dense"):
        resolve_pooler_config(write([tr, pool, {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
                                    {"pooling_mode_lasttoken": True}))
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS"):
        resolve_pooler_config(write([tr, pool], {"pooling_mode_lasttoken": True}), {"pooling_type": "MAX"})


def test_the_request_body_takes_the_sdks_fields_and_refuses_what_it_does_not_do():
    import typing

    import pydantic
    from openai.types import embedding_create_params

    from pagedserve.cluster.front.embeddings.protocol import EmbeddingRequest

    sdk = set(typing.get_type_hints(embedding_create_params.EmbeddingCreateParams))
    assert sdk <= set(EmbeddingRequest.model_fields), sdk - set(EmbeddingRequest.model_fields)
    body = EmbeddingRequest.model_validate({"input": ["a", "b"], "embed_dtype": "float32", "x_custom": 1,
                                            "user": "u-1", "dimensions": 8, "use_activation": False})
    assert body.unknown_fields() == ["x_custom"] and body.inputs() == ["a", "b"]
    params, pooling = body.to_params()
    assert (pooling.dimensions, pooling.normalize, params.truncate_prompt_tokens) == (8, False, None)
    assert EmbeddingRequest.model_validate({"input": [1, 2]}).inputs() == [[1, 2]]
    for field, value in (("embed_dtype", "float16"), ("messages", []), ("endianness", "big")):
        with pytest.raises(pydantic.ValidationError, match=field):
            EmbeddingRequest.model_validate({"input": "x", field: value})
    for empty in ("", [], [""], [[]], ["a", ""]):
        with pytest.raises(ValueError, match="empty"):
            EmbeddingRequest.model_validate({"input": empty}).inputs()
    with pytest.raises(pydantic.ValidationError):
        EmbeddingRequest.model_validate({"input": "x", "encoding_format": "binary"})
