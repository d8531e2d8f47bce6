"""Multi-LoRA serving against its oracle: transformers with the adapter merged by ``peft``.

The story: on a tiny random Llama, two random PEFT adapters (one plain LoRA on every module,
one rsLoRA on three modules with another rank) and the base model run in one engine, mixed in
the same steps; every request's greedy tokens equal those of transformers' merged model run
alone on its prompt, with plain prefill, chunked prefill, and preemption (a pool too small
for all of them). The adapters change the tokens (the oracle would be vacuous otherwise), the
slots hold fewer adapters than the batch uses (they are refilled, LRU), and an adapter that
cannot be served is refused with its reason named.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from _lora_helpers import hf_greedy, make_random_adapter, merged_model
from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.worker.loading.random_models import make_test_model
from pagedserve.worker.lora.manager import LoRAManager
from pagedserve.worker.lora.peft_adapter import LoRAError, check_peft_adapter, load_peft_adapter
from pagedserve.worker.model_config import ModelConfig

NUM_NEW = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_test_model("llama-gqa2-hd64", tmp_path_factory.getbasetemp() / "lora-models")
    plain = make_random_adapter(base, root / "plain", r=8, alpha=16, seed=1)
    rs = make_random_adapter(base, root / "rslora", r=4, alpha=8, use_rslora=True,
                             targets=["q_proj", "v_proj", "down_proj"], seed=2)
    return base, {"plain": plain, "rslora": rs}


@pytest.fixture(scope="module")
def oracle(models):
    """Each adapter's (and the base model's) greedy tokens from transformers, one prompt at a time."""
    base, adapters = models
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (37, 9, 21)]
    hf = {None: transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()}
    hf.update({name: merged_model(base, path) for name, path in adapters.items()})
    ref = {name: [hf_greedy(m, p, NUM_NEW) for p in prompts] for name, m in hf.items()}
    assert ref["plain"] != ref[None] and ref["rslora"] != ref[None]  # the adapters change the tokens
    return prompts, ref


# plain: the whole batch prefills in one step; chunked: a 16-token budget cuts every prompt;
# preempted: 12 blocks of 8 tokens for 9 requests of up to 49 tokens.
CASES = {"plain": dict(num_gpu_blocks_override=128),
         "chunked": dict(num_gpu_blocks_override=128, max_num_batched_tokens=16),
         "preempted": dict(num_gpu_blocks_override=12)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mixed_batch_equals_peft_merged(models, oracle, case):
    """Base, plain and rsLoRA requests of three prompts, all in one engine with two slots:
    each request's greedy tokens are transformers' (merged adapter, prompt alone)."""
    base, adapters = models
    prompts, ref = oracle
    llm = LLM(model=base, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32", max_model_len=256,
              block_size=8, **CASES[case])
    loras = {None: None, "plain": LoRARequest("plain", 1, adapters["plain"]),
             "rslora": LoRARequest("rslora", 2, adapters["rslora"])}
    names = [None, "plain", "rslora"]
    order = [(n, i) for i in range(len(prompts)) for n in names]  # interleaved: mixed in every step
    outs = llm.generate([prompts[i] for _, i in order], SamplingParams(temperature=0, max_tokens=NUM_NEW,
                                                                     ignore_eos=True),
                        use_tqdm=False, lora_request=[loras[n] for n, _ in order])
    for (n, i), out in zip(order, outs):
        assert out.outputs[0].token_ids == ref[n][i], (n, i)
    if case == "preempted":
        assert llm.stats()["num_preemptions"] > 0
    llm.shutdown()


def test_one_slot_serves_two_adapters_in_turn(models, oracle):
    """max_loras=1: the scheduler runs one adapter at a time (and the base beside it), the
    worker refills its one slot; still every request gets its own tokens."""
    base, adapters = models
    prompts, ref = oracle
    llm = LLM(model=base, enable_lora=True, max_loras=1, max_lora_rank=8, dtype="float32", max_model_len=256,
              num_gpu_blocks_override=128)
    plain, rs = LoRARequest("plain", 1, adapters["plain"]), LoRARequest("rslora", 2, adapters["rslora"])
    outs = llm.generate(prompts * 3, SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True),
                        use_tqdm=False, lora_request=[plain] * 3 + [rs] * 3 + [None] * 3)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == ref["plain"] + ref["rslora"] + ref[None]
    pool = llm.engine.executor.worker.runner.lora.pool
    assert pool.num_fills == 2  # plain, then rslora: each copied in once
    # What the replica publishes to the fronts' routers: the adapters on the worker's host
    # (max_cpu_loras defaults to max_loras, 1: the last one read) and a measured read time
    # (cluster/wire/kv_events.py).
    from pagedserve.cluster.replica.step_rates import StepRates
    from pagedserve.cluster.wire.kv_events import replica_stats

    stats = replica_stats(llm.engine.scheduler, StepRates(), llm.engine.loras)
    assert stats.lora_adapters == (2,) and 0 < stats.lora_load_s < 10
    llm.shutdown()


def _manager(base, **kw):
    cfg = ModelConfig.from_pretrained(base, dtype="float32")
    return LoRAManager(cfg, max_loras=kw.pop("max_loras", 1), max_lora_rank=8, device=torch.device("cpu"), **kw)


def test_slots_and_host_cache_are_lru(models):
    """One slot, two adapters on the host: a step of one adapter keeps its slot; the third
    adapter evicts the least recently used from the host, which is read again when needed."""
    base, adapters = models
    mgr = _manager(base, max_cpu_loras=2)
    a, b = LoRARequest("plain", 1, adapters["plain"]), LoRARequest("rslora", 2, adapters["rslora"])
    c = LoRARequest("plain-again", 3, adapters["plain"])
    # Each step's report: the adapters on the host when that changed (LRU first), one read
    # time per read from disk.
    for lora, fills, loads, resident in ((a, 1, 1, (1,)), (a, 1, 1, None), (b, 2, 2, (1, 2)), (a, 3, 2, None),
                                         (c, 4, 3, (1, 3))):
        mgr.begin_step([(None, 2), (lora, 3)])
        assert mgr.ctx.step[0][1] == [(2, 5)]  # its run of rows
        mgr.end_step()
        assert (mgr.pool.num_fills, mgr.host.num_loads) == (fills, loads)
        got, load_s = mgr.host.report()
        assert got == resident and len(load_s) == (resident is not None) and all(s > 0 for s in load_s)
    assert 2 not in mgr.host and 1 in mgr.host  # b was least recently used
    mgr.begin_step([(None, 4)])
    assert mgr.ctx.step is None  # no adapter in the step: the layers' hooks return at once


def test_runs_of_rows_per_adapter(models):
    base, adapters = models
    mgr = _manager(base, max_loras=2)
    a, b = LoRARequest("plain", 1, adapters["plain"]), LoRARequest("rslora", 2, adapters["rslora"])
    # decode rows a, a, base, b then chunks a (5 tokens), b (3 tokens)
    mgr.begin_step([(a, 1), (a, 1), (None, 1), (b, 1), (a, 5), (b, 3)])
    assert [runs for _, runs in mgr.ctx.step] == [[(0, 2), (4, 9)], [(3, 4), (9, 12)]]


# ---------------------------------------------------------------- bad adapters
def _edit_config(path, **changes):
    cfg_path = os.path.join(path, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def bad_adapters(models, tmp_path_factory):
    base, _ = models
    root = tmp_path_factory.mktemp("bad-lora")
    big = make_random_adapter(base, root / "rank16", r=16, alpha=16, targets=["q_proj"])
    head = make_random_adapter(base, root / "lm-head", r=4, targets=["q_proj", "lm_head"])
    dora = make_random_adapter(base, root / "dora", r=4, targets=["q_proj"], use_dora=True)
    foreign = make_random_adapter(base, root / "foreign-target", r=4, targets=["q_proj"])
    _edit_config(foreign, target_modules=["q_proj", "c_attn"])
    corrupt = make_random_adapter(base, root / "corrupt", r=4, targets=["q_proj"])
    weights = os.path.join(corrupt, "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    empty = root / "empty"
    empty.mkdir()
    return {"rank16": (big, "rank 16 (adapter_config.json): LoRA rank 16 is greater than max_lora_rank 8"),
            "lm-head": (head, "'lm_head', which is not adapted here"),
            "dora": (dora, "use_dora=True is not supported (pagedserve does not yet support DoRA)"),
            "foreign-target": (foreign, "targets module 'c_attn', which the model does not have"),
            "corrupt": (corrupt, "adapter_model.safetensors cannot be read"),
            "empty": (str(empty), "has no adapter_config.json"),
            "missing": (str(root / "nowhere"), "No adapter found for")}


@pytest.mark.parametrize("name", ["rank16", "lm-head", "dora", "foreign-target", "corrupt", "empty", "missing"])
def test_bad_adapter_is_refused_naming_the_problem(models, bad_adapters, name):
    base, _ = models
    path, message = bad_adapters[name]
    cfg = ModelConfig.from_pretrained(base, dtype="float32")
    with pytest.raises(LoRAError, match=f"LoRA adapter '{name}'.*") as e:
        load_peft_adapter(LoRARequest(name, 1, path), cfg, max_lora_rank=8)
    assert message in str(e.value)
    # The engine's check (the header, not the weights) refuses it with the same words.
    with pytest.raises(LoRAError, match=f"LoRA adapter '{name}'.*") as e:
        check_peft_adapter(LoRARequest(name, 1, path), cfg, max_lora_rank=8)
    assert message in str(e.value)


def test_engine_check_reads_the_header_and_the_worker_the_weights(models, tmp_path):
    """An adapter whose weights are NaN passes the header check and fails the worker's read,
    which alone reads the tensors."""
    from safetensors.torch import load_file, save_file

    base, adapters = models
    nan = tmp_path / "nan"
    nan.mkdir()
    for f in os.listdir(adapters["plain"]):
        src = os.path.join(adapters["plain"], f)
        if f == "adapter_model.safetensors":
            save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(src).items()}, nan / f)
        else:
            (nan / f).write_bytes(open(src, "rb").read())
    cfg = ModelConfig.from_pretrained(base, dtype="float32")
    check_peft_adapter(LoRARequest("nan", 1, str(nan)), cfg, max_lora_rank=8)
    with pytest.raises(LoRAError, match="holds non-finite weights"):
        load_peft_adapter(LoRARequest("nan", 1, str(nan)), cfg, max_lora_rank=8)


def test_engine_refuses_bad_modules_at_start_and_bad_requests_alone(models, bad_adapters):
    """A bad --lora-modules entry stops the engine before it starts, naming the adapter; a
    request naming a bad adapter, a base model that is not this one, or LoRA while it is off
    is refused alone (ValueError: a 400), and the engine goes on serving."""
    base, adapters = models
    with pytest.raises(ValueError, match="LoRA adapter 'rank16' has rank 16"):
        LLM(model=base, enable_lora=True, max_lora_rank=8, lora_modules=[f"rank16={bad_adapters['rank16'][0]}"],
            dtype="float32", max_model_len=128, num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match="lora_modules need enable_lora"):
        LLM(model=base, lora_modules=[f"plain={adapters['plain']}"], max_model_len=128)
    llm = LLM(model=base, enable_lora=True, max_lora_rank=8, dtype="float32", max_model_len=128,
              num_gpu_blocks_override=32,
              lora_modules=[json.dumps({"name": "plain", "path": adapters["plain"], "base_model_name": base})])
    assert list(llm.engine.loras.static) == ["plain"]
    sp = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match="cannot be read"):
        llm.generate([[5, 6, 7]], sp, use_tqdm=False, lora_request=LoRARequest("corrupt", 9,
                                                                               bad_adapters["corrupt"][0]))
    with pytest.raises(ValueError, match="is for base model 'other/model', but this server serves"):
        llm.generate([[5, 6, 7]], sp, use_tqdm=False,
                     lora_request=LoRARequest("plain2", 10, adapters["plain"], base_model_name="other/model"))
    out = llm.generate([[5, 6, 7]], sp, use_tqdm=False, lora_request=llm.engine.loras.static["plain"])
    assert len(out[0].outputs[0].token_ids) == 2
    llm.shutdown()
    off = LLM(model=base, dtype="float32", max_model_len=128, num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        off.generate([[5, 6, 7]], sp, use_tqdm=False, lora_request=LoRARequest("plain", 1, adapters["plain"]))
    off.shutdown()
