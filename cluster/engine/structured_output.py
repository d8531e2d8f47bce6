"""Structured outputs with xgrammar, on the engine side (vLLM V1's design).

    admission (a tokenizer-pool thread, or add_request for the offline LLM)
        StructuredOutputsParams ──compile()──▶ CompiledGrammar   (cached by spec)
    add_request: one GrammarMatcher per sample (n > 1: n matchers, one grammar)
    every step, engine thread:
        plan = schedule() ──fill_bitmask(plan)──▶ plan.grammar_bitmask (bytes, one row
              per constrained request that samples this step) ──▶ workers mask those rows
        result ──▶ accept(req_id, token ids) advances that request's matcher; a matcher
              that terminated ends the request with finish_reason "stop"

With a reasoning parser (cluster/text/reasoning.py) a chat answer's grammar waits for the
thinking to end (vLLM's reasoning_ended): its matcher is made at add_request but gets no
bitmask row, and is fed nothing, until the end-of-thinking token is sampled; the tokens
after that one in the same step are its first (the thinking is free text, the answer after
it is what the grammar holds).

The matchers live here, not in the workers: every TP rank then applies the same
bitmask (no rank can drift), and preemption costs nothing: a recomputed request keeps
its matcher, which has accepted exactly the tokens the request holds, so nothing is
re-fed; its recompute prefill samples under the matcher's current bitmask.
xgrammar is imported on first use, so an engine that never sees a constraint never
loads it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

from pagedserve.scheduler.sampling_params import StructuredOutputsParams

logger = logging.getLogger("pagedserve")

# Compiled grammars kept (LRU). A JSON-schema grammar over a large vocabulary is not small.
CACHE_SIZE = 256


def _key(so: StructuredOutputsParams) -> tuple[str, str]:
    kind = so.kind
    if kind == "json":
        spec = so.json if isinstance(so.json, str) else json.dumps(so.json, sort_keys=True)
    elif kind == "choice":
        spec = json.dumps(so.choice)
    elif kind == "json_object":
        spec = ""
    else:
        spec = getattr(so, kind)
    return kind, spec


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings (a JSON string literal is a valid
    EBNF string literal in xgrammar, escapes included)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar 0.2.9 spells a character of a length-bounded string (minLength / maxLength) as
# this class, which lets raw control characters (U+0000-U+001F) through: JSON forbids
# them unescaped, so such output would not parse, and random weights emit one often.
# The class of its unbounded strings excludes them; we use that.
_XGR_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def json_schema_grammar(schema: str | dict, strict: bool = True):
    """The xgrammar Grammar of a JSON schema: fixed separators (no free whitespace: a
    small model may otherwise emit whitespace until max_tokens, vLLM's
    disable_any_whitespace) and strings that are valid JSON (see _XGR_BOUNDED_CHAR).
    ``strict=False`` lets an object have properties the schema does not name."""
    import xgrammar as xgr

    text = schema if isinstance(schema, str) else json.dumps(schema)
    grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=strict)
    ebnf = str(grammar)
    if _XGR_BOUNDED_CHAR in ebnf:
        grammar = xgr.Grammar.from_ebnf(ebnf.replace(_XGR_BOUNDED_CHAR, _JSON_STRING_CHAR))
    return grammar


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        """``vocab_size``: the model's logits width (may exceed the tokenizer's vocabulary:
        padded rows are never allowed). ``stop_token_ids``: what ends a finished grammar
        (the model's EOS ids), so a completed constraint stops where EOS does."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()  # the compiler's creation and the cache
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.matchers: dict[str, object] = {}  # req_id -> xgrammar.GrammarMatcher
        # req_id -> the token its matcher waits for (the end of the thinking), until it comes
        self.waiting: dict[str, int] = {}

    # ------------------------------------------------------------ compile (any thread)
    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids or None)
                # Our own LRU below keys by spec; xgrammar's cache would hold a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def compile(self, so: StructuredOutputsParams):
        """The compiled grammar of ``so`` (cached). ValueError naming the problem for an
        invalid schema, regex or grammar (the HTTP layer answers 400)."""
        key = _key(so)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit = self._compile(so)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return hit

    def _compile(self, so: StructuredOutputsParams):
        compiler = self._get_compiler()
        kind = so.kind
        try:
            if kind == "json":
                return compiler.compile_grammar(json_schema_grammar(so.json))
            if kind == "json_object":
                # OpenAI's json_object is an object, not any JSON value (the builtin JSON
                # grammar let a random model answer "[3]"), no free whitespace, as the schemas.
                return compiler.compile_grammar(json_schema_grammar({"type": "object"}, strict=False))
            if kind == "regex":
                return compiler.compile_regex(so.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(so.choice))
            return compiler.compile_grammar(so.grammar)
        except Exception as e:  # xgrammar raises RuntimeError / its own types for bad specs
            what = {"json": "JSON schema", "json_object": "JSON grammar", "choice": "choice list"}.get(kind, kind)
            msg = str(e).strip().splitlines()
            raise ValueError(f"invalid {what} for structured outputs: "
                             f"{msg[-1] if msg else type(e).__name__}") from None

    # ------------------------------------------------------------ matchers (engine thread)
    def add_request(self, req_id: str, so: StructuredOutputsParams, grammar=None,
                    after_token: int | None = None) -> None:
        """``grammar``: ``so`` compiled already (EngineRequest.grammar), else compiled here.
        ``after_token``: the grammar applies only after this token (the end of the thinking)."""
        import xgrammar as xgr

        self.matchers[req_id] = xgr.GrammarMatcher(grammar if grammar is not None else self.compile(so))
        if after_token is not None:
            self.waiting[req_id] = after_token

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self.waiting.pop(req_id, None)

    def fill_bitmask(self, plan, get_request) -> None:
        """Bitmask rows for the constrained requests of ``plan`` that sample this step:
        those whose computed tokens reach their token count once this step ran (the
        scheduler has advanced ``num_computed_tokens`` already); partial prefill chunks
        sample nothing and get no row."""
        ids = []
        for rid in plan.num_scheduled_tokens:
            if rid in self.matchers and rid not in self.waiting:
                req = get_request(rid)
                if req is not None and req.num_computed_tokens >= req.num_tokens:
                    ids.append(rid)
        if not ids:
            return
        import torch

        # xgrammar fills a torch int32 tensor through DLPack; the plan gets its bytes.
        mask = torch.empty((len(ids), self.num_words), dtype=torch.int32)
        for i, rid in enumerate(ids):
            self.matchers[rid].fill_next_token_bitmask(mask, i)
        plan.structured_output_req_ids = ids
        plan.grammar_bitmask = mask.numpy().astype("<i4", copy=False).tobytes()

    def accept(self, req_id: str, token_ids: list[int]) -> bool:
        """Advance ``req_id``'s matcher; True when its grammar has terminated (a stop token
        was accepted after the grammar completed). RuntimeError for a token the grammar
        forbids, which only a bitmask that did not reach the sampler can cause."""
        m = self.matchers.get(req_id)
        if m is None:
            return False
        end = self.waiting.get(req_id)
        if end is not None:  # still thinking: the grammar starts after its end
            if end not in token_ids:
                return False
            del self.waiting[req_id]
            token_ids = token_ids[token_ids.index(end) + 1:]
        for t in token_ids:
            if m.is_terminated():
                break
            if not m.accept_token(t):
                raise RuntimeError(f"structured outputs: the sampler produced token {t}, which "
                                   f"the grammar of request {req_id} does not allow")
        return m.is_terminated()
