"""Tokenization off the engine thread, behind a size check that costs nothing.

    generate(prompt) ──▶ len(prompt) > max_prompt_chars ? ──yes──▶ 400 at once (O(1))
                              │ no
                              ▼
                         tokenizer pool thread (its own tokenizer copy): chat template,
                         encode, length check against max_model_len ──▶ token ids
                              │
                              ▼
                         engine thread: admission + add_request (ids only, O(prompt))

The engine thread runs every step; a prompt tokenized there delays every request in
the batch by as long as it takes (seconds for a prompt of many MB). Here it delays nobody but
itself. Each pool thread has its own deep copy of the tokenizer: a Rust tokenizer
shared across threads can fail with "Already borrowed" when one call reconfigures it
(truncation/padding) while another encodes, and the engine thread keeps the original
for detokenization.

Why ``max_prompt_chars`` is safe (never refuses a prompt that fits):
a token stands for at most ``L`` characters of normalized text, where ``L`` is the
longest vocabulary entry (byte-level BPE spells each byte as one character, so an
entry's length is its byte count, which bounds the characters it decodes to; added
and special tokens match their own text). So ``tokens >= normalized_chars / L``. The
normalizers of Llama-family tokenizers never delete characters; the only ones that
shrink text are Unicode compositions (NFC/NFKC), and one composed character stands
for at most 4 code points (the longest canonical decomposition, e.g. U+1FA2). Hence a
prompt of more than ``4 * L * max_model_len`` characters has more than max_model_len
tokens. A tokenizer whose normalizer may delete characters (strip, BERT clean-up,
SentencePiece's precompiled maps, ...) gets no bound: its prompts are tokenized in the
pool and checked exactly.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from pagedserve.cluster.text.chat_template import adapt_messages, renders_tools, template_kwargs

logger = logging.getLogger("pagedserve")

# One composed character stands for at most this many code points (see above).
COMPOSITION_SLACK = 4
# Normalizers that never delete characters (they keep, expand or compose them).
_SAFE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace"}


def load_tokenizer(path: str):
    """The HF tokenizer of a model directory (or a tokenizer's own), from local files only."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool | str = True,
                tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> str:
    """The model's chat template, or a plain "role: content" transcript when the
    tokenizer has none (tiny test models ship without one). Tool turns are fitted to
    what the template renders first (tool_choice.adapt_messages); ``tools`` go to a
    template that renders them and nowhere else. ``add_generation_prompt`` "continue" is
    vLLM's continue_final_message: the last message is left open (no end-of-turn after
    it, no generation prompt), so the model carries on writing it. ``chat_template_kwargs``:
    more variables for the template (vLLM's, e.g. {"enable_thinking": False}), those it reads."""
    messages = adapt_messages(messages, tokenizer)
    cont = add_generation_prompt == "continue"
    if getattr(tokenizer, "chat_template", None):
        extra = template_kwargs(tokenizer, chat_template_kwargs)
        if tools and renders_tools(tokenizer):
            extra["tools"] = tools
        if cont:  # only when asked: not every tokenizer takes the keyword
            extra["continue_final_message"] = True
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=not cont and bool(add_generation_prompt),
                                             **extra)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    if cont:
        return text[:-1]
    return text + ("assistant:" if add_generation_prompt else "")


def _normalizer_keeps_chars(spec) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_normalizer_keeps_chars(n) for n in spec.get("normalizers", ()))
    if kind == "Replace":  # deletes when it replaces with nothing
        return bool(spec.get("content"))
    return kind in _SAFE_NORMALIZERS


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """Characters above which a text prompt surely exceeds ``max_model_len`` tokens, or
    None when this tokenizer admits no such bound (see the module docstring)."""
    try:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not _normalizer_keeps_chars(json.loads(backend.to_str()).get("normalizer")):
            return None
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # an unusual tokenizer: no bound, the exact check still applies
        logger.debug("no character bound for this tokenizer", exc_info=True)
        return None
    return COMPOSITION_SLACK * max(longest, 1) * max_model_len


class TokenizerPool:
    def __init__(self, tokenizer, max_model_len: int, num_threads: int = 2) -> None:
        self._tokenizer = tokenizer
        self._local = threading.local()
        self._copy_lock = threading.Lock()  # deepcopy reads the original's state
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenize")
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_prompt_chars(tokenizer, max_model_len)

    def _tok(self):
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._copy_lock:
                tok = self._local.tokenizer = copy.deepcopy(self._tokenizer)
        return tok

    def check_chars(self, text: str) -> None:
        """O(1): refuse a text prompt that cannot fit, before any work is done on it."""
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the "
                f"prompt has {len(text)} characters: more than any prompt of that many tokens "
                f"can have (at most {limit}). Please reduce the prompt.")

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -------------------------------------------------- bodies (pool threads)
    def encode_prompt(self, prompt: str | None, messages: list[dict] | None,
                      add_generation_prompt: bool, tools: list[dict] | None = None,
                      chat_template_kwargs: dict | None = None) -> list[int]:
        """The prompt ids of a generation request (what ``LLMEngine.tokenize`` gives)."""
        tok = self._tok()
        if messages is not None:
            prompt = render_chat(tok, messages, add_generation_prompt, tools, chat_template_kwargs)
            self.check_chars(prompt)
            # The template holds BOS etc. itself (vLLM's chat default): encoding with special
            # tokens gave a template that starts with {{ bos_token }} two BOS.
            return tok.encode(prompt, add_special_tokens=False)
        return tok.encode(prompt)

    def tokenize(self, prompt: str | None, messages: list[dict] | None,
                 add_special_tokens: bool | None, add_generation_prompt: bool | str,
                 tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
        """/tokenize's ids. ``add_special_tokens`` None: vLLM's defaults, True for a prompt
        and False for messages (the chat template writes BOS itself)."""
        tok = self._tok()
        if messages is not None:
            prompt = render_chat(tok, messages, add_generation_prompt, tools, chat_template_kwargs)
        if add_special_tokens is None:
            add_special_tokens = messages is None
        prompt = prompt or ""
        self.check_chars(prompt)
        return tok.encode(prompt, add_special_tokens=add_special_tokens)

    def token_strs(self, tokens: list[int]) -> list[str]:
        """The tokens as the vocabulary spells them (vLLM's ``return_token_strs``)."""
        return self._tok().convert_ids_to_tokens(tokens)

    def detokenize(self, tokens: list[int], vocab_size: int, skip_special_tokens: bool = False) -> str:
        if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in tokens):
            raise ValueError(f"token ids must be integers in [0, {vocab_size}).")
        return self._tok().decode(tokens, skip_special_tokens=skip_special_tokens)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
