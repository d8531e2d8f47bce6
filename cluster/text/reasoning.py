"""A reasoning model's thinking told apart from its answer (vLLM's ``--reasoning-parser``),
for the front (the message's ``reasoning``, the Responses API's reasoning item) and the
engine (structured outputs wait for the thinking to end).

    parser        thinking                                           its end
    deepseek_r1   from the first generated token (the template      </think>
                  writes <think>; one the model writes is dropped)
    qwen3         the same, unless chat_template_kwargs has          </think>
                  enable_thinking: false (then there is none)

As vLLM's parsers read the prompt: the output starts inside the thinking unless the prompt
already closed it, i.e. its last <think> / </think> tag is a </think> (Qwen3's template
with thinking off writes ``<think>\\n\\n</think>\\n\\n`` there); qwen3 looks back only into
the last turn (past <|im_start|> / <|im_end|> is another message). Both tags must be single
tokens of the vocabulary (vLLM refuses the parser otherwise): the engine reads them by id.

The text is split by ``ReasoningStream``, fed the deltas as they come: a tag that arrives
in pieces over several deltas (``"</thi"``, ``"nk>"``) is held back until it is whole, so a
stream and a whole answer (``split``, the same reader fed all at once) say the same.

    feed("<think>Let me") -> ("Let me", None)     feed(" see.</thi") -> (" see.", None)
    feed("nk>\\n\\nYes") -> (None, "\\n\\nYes")     finish() -> (None, None)

Imports: the standard library only (the tokenizer comes in as a value).
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
# --reasoning-parser's choices -> (start tag, end tag, the turn markers qwen3 stops at, whether
# chat_template_kwargs' enable_thinking turns the thinking off)
_PARSERS: dict[str, tuple[str, str, tuple[str, ...], bool]] = {
    "deepseek_r1": (THINK_START, THINK_END, (), False),
    "qwen3": (THINK_START, THINK_END, ("<|im_start|>", "<|im_end|>"), True),
}
REASONING_PARSERS = tuple(_PARSERS)


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in _PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}.")


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str
    end: str
    start_token_id: int
    end_token_id: int
    boundary_token_ids: tuple[int, ...] = ()
    honours_enable_thinking: bool = False

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer) -> ReasoningParser:
        """The parser ``name`` on this tokenizer's ids; ValueError when a tag is not one token."""
        check_reasoning_parser(name)
        start, end, boundaries, thinking_switch = _PARSERS[name]
        vocab = tokenizer.get_vocab()
        missing = [t for t in (start, end) if t not in vocab]
        if missing:
            raise ValueError(f"reasoning parser {name!r}: the tokenizer has no {' or '.join(missing)} token "
                             f"(the parser reads {start} ... {end}, each one token of the vocabulary, as vLLM's).")
        return cls(name, start, end, vocab[start], vocab[end],
                   tuple(vocab[b] for b in boundaries if b in vocab), thinking_switch)

    def describe(self) -> dict:
        """What an engine replica's info() tells the front (plain values)."""
        return dict(name=self.name, start=self.start, end=self.end, start_token_id=self.start_token_id,
                    end_token_id=self.end_token_id, boundary_token_ids=list(self.boundary_token_ids),
                    honours_enable_thinking=self.honours_enable_thinking)

    @classmethod
    def from_description(cls, d: dict) -> ReasoningParser:
        return cls(d["name"], d["start"], d["end"], d["start_token_id"], d["end_token_id"],
                   tuple(d["boundary_token_ids"]), d["honours_enable_thinking"])

    def thinking_off(self, chat_template_kwargs: dict | None) -> bool:
        """qwen3 with ``enable_thinking: false``: the answer has no thinking at all."""
        return self.honours_enable_thinking and (chat_template_kwargs or {}).get("enable_thinking", True) is False

    def starts_in_reasoning(self, prompt_token_ids, chat_template_kwargs: dict | None = None) -> bool:
        """Whether the output begins inside the thinking (see the module doc)."""
        if self.thinking_off(chat_template_kwargs):
            return False
        for t in reversed(prompt_token_ids):
            if t == self.end_token_id:
                return False
            if t == self.start_token_id:
                return True
            if t in self.boundary_token_ids:
                break
        return True

    def stream(self, in_reasoning: bool) -> ReasoningStream:
        return ReasoningStream(self.start, self.end, in_reasoning)

    def split(self, text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer, each None when empty."""
        s = self.stream(in_reasoning)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return ((r1 or "") + (r2 or "")) or None, ((c1 or "") + (c2 or "")) or None

    def reasoning_tokens(self, token_ids, in_reasoning: bool) -> int:
        """How many generated tokens were thinking (the tags themselves not counted)."""
        if not in_reasoning:
            return 0
        n = 0
        for t in token_ids:
            if t == self.end_token_id:
                break
            n += t != self.start_token_id
        return n


def _partial_tail(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``tags``."""
    for k in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        tail = text[-k:]
        if any(t.startswith(tail) and t != tail for t in tags):
            return k
    return 0


class ReasoningStream:
    """One choice's text, split as it arrives: ``feed(delta)`` -> (reasoning, content)
    deltas, each None when empty; ``finish()`` flushes what was held back."""

    def __init__(self, start: str, end: str, in_reasoning: bool) -> None:
        self.start, self.end = start, end
        self.in_reasoning = in_reasoning
        self._held = ""  # reasoning text that may be the start of a tag

    def feed(self, delta: str) -> tuple[str | None, str | None]:
        if not self.in_reasoning:
            return None, delta or None
        buf, self._held = self._held + delta, ""
        reasoning: list[str] = []
        while True:
            s, e = buf.find(self.start), buf.find(self.end)
            if s >= 0 and (e < 0 or s < e):  # a <think> inside the thinking: the tag is dropped
                reasoning.append(buf[:s])
                buf = buf[s + len(self.start):]
                continue
            if e >= 0:
                reasoning.append(buf[:e])
                self.in_reasoning = False
                return "".join(reasoning) or None, buf[e + len(self.end):] or None
            break
        keep = _partial_tail(buf, (self.start, self.end))
        reasoning.append(buf[:len(buf) - keep])
        self._held = buf[len(buf) - keep:]
        return "".join(reasoning) or None, None

    def finish(self) -> tuple[str | None, str | None]:
        """The held-back tail: thinking cut off inside what looked like a tag."""
        held, self._held = self._held, ""
        return held or None, None
