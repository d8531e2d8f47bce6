"""A tiny "thinking" model whose greedy answers are known, for the reasoning tests
(tests/test_serve_reasoning.py): a random model never writes <think> ... </think>, so this
one is wired to.

It is a real Llama checkpoint that pagedserve and transformers load as any other, built so
that the next token depends only on the last one: the attention and MLP outputs are zero
(o_proj, down_proj), so the residual stream at the last position is that token's embedding,
and lm_head's row for token b is the embedding of each token a scripted to come before b
(random 128-d embeddings are nearly orthogonal: a's own row wins by a wide margin). A script
is a chain of tokens, each "from" token with one successor:

    "Ċ" (the prompt's end: "<|im_start|>assistant\\n")  -> THINKING, then <|im_end|>
    "\\n\\n" (the end with enable_thinking false)          -> ANSWER, then <|im_end|>
    "ait" (a continued assistant message "Wait")          -> "<" "/" "th" "in" "k" ">" "B" "y" "e"
                                                             (</think> spelled in 7 tokens), <|im_end|>

The tokenizer is the test models' byte-level BPE with <think>, </think> and "\\n\\n" added as
tokens (as Qwen3's vocabulary has them), and a Qwen3-shaped chat template that reads
enable_thinking (thinking off: ``<think>\\n\\n</think>\\n\\n`` after the generation prompt) and
renders tools Hermes-style in the system turn; given a ``reasoning_effort`` (vLLM passes the
request's) it writes "Reasoning: <effort>" in a first system turn, as gpt-oss's does.
"""

from __future__ import annotations

import json
import os

import torch

THINKING = "<think>The user says hi.</think>Hello there!"
REASONING, ANSWER = "The user says hi.", "Hello there!"
SPLIT_PREFIX, SPLIT_ANSWER = "Wait", "Bye"  # a continued "Wait": </think> in pieces, then "Bye"
IM_END_ID = 4  # tokenizer_build's <|im_end|>: this model's EOS

QWEN3_TEMPLATE = (
    "{%- if reasoning_effort is defined %}{{- '<|im_start|>system\\nReasoning: ' + reasoning_effort + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}{{- '# Tools\\n\\n<tools>' }}{%- for tool in tools %}"
    "{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def _tokenizer(out_dir: str):
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from pagedserve.worker.loading.tokenizer_build import BOS, IM_END, IM_START, PAD, build_tokenizer

    tok = build_tokenizer(509)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>", "\n\n")])
    assert tok.get_vocab_size() == 512
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=IM_END, pad_token=PAD,
                                   additional_special_tokens=[IM_START, IM_END], model_max_length=1024)
    fast.chat_template = QWEN3_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _chains(tok) -> list[list[int]]:
    """The scripted token chains (see the module doc), by id."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    nl, nn = enc("\n"), enc("\n\n")
    assert len(nl) == 1 and len(nn) == 1, (nl, nn)
    wait = enc(SPLIT_PREFIX)
    pieces = [tok.convert_tokens_to_ids(t) for t in ("<", "/", "th", "in", "k", ">")]
    assert tok.decode(pieces) == "</think>"
    return [nl + enc(THINKING) + [IM_END_ID],
            nn + enc(ANSWER) + [IM_END_ID],
            wait[-1:] + pieces + enc(SPLIT_ANSWER) + [IM_END_ID]]


def make_thinking_model(path: str | os.PathLike, hidden: int = 128, scale: float = 24.0, seed: int = 0) -> str:
    """Write the model and its tokenizer to ``path`` and return it."""
    import transformers as tf

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tok = _tokenizer(path)
    config = tf.LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=IM_END_ID,
                            pad_token_id=2)
    model = tf.LlamaForCausalLM(config).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(512, hidden, generator=g)
    emb = emb / emb.norm(dim=1, keepdim=True) * hidden ** 0.5  # RMS 1: the final norm leaves it as it is
    head = torch.zeros(512, hidden)
    nxt: dict[int, int] = {}
    for chain in _chains(tok):
        for a, b in zip(chain, chain[1:]):
            assert nxt.setdefault(a, b) == b, f"token {a} scripted to two successors"
    for a, b in nxt.items():
        head[b] += scale * emb[a] / hidden
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.eos_token_id = IM_END_ID
    model.generation_config.save_pretrained(path)
    with open(os.path.join(path, "chains.json"), "w") as f:  # for a test that wants the ids
        json.dump(_chains(tok), f)
    return path
