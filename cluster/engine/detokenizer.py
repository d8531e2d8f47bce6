"""Incremental detokenization with stop strings (OpenAI semantics). Pure Python: no ray.

Two problems, two offsets.

1. One character may span several tokens (byte-level BPE: "你" is 3 byte tokens), and
   some decoders depend on the previous token (leading spaces). So each new token is
   decoded inside a small window (the prefix/read offset technique of vLLM and TGI):

       token ids:  ... | prefix_offset ........ read_offset ........ | end
                         └ prefix_text = decode(ids[prefix:read]) ┘
                         └──────────── new_text = decode(ids[prefix:end]) ────────┘

   new_text[len(prefix_text):] is final once new_text does not end with U+FFFD (an
   incomplete UTF-8 sequence); then prefix_offset = read_offset, read_offset = end.
   The window stays a few tokens long, so an update costs O(new tokens), not O(output).

2. A stop string may span several tokens and must not be returned (unless
   include_stop_str_in_output), nor anything after it. Finalized text is held back only
   while its tail could still grow into a stop string: the longest suffix that is a
   proper prefix of some stop string (at most len(longest stop) - 1 chars).

       finalized text:  [ emitted .......... | held back ]
                                              └ "</" while stop = ["</s>"] ┘

When several stop strings appear in one update, the one that *ends* first wins: that is
what a character-by-character check would do, so the result does not depend on how the
text was split into tokens.
"""

from __future__ import annotations

from pagedserve.scheduler.sampling_params import SamplingParams

# Prompt tokens kept as left context for the first output token (vLLM uses 5).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5


def _decoder(tokenizer, skip_special_tokens: bool):
    """A ``ids -> str`` function equal to ``tokenizer.decode``. For a transformers fast
    tokenizer without space clean-up, call the Rust tokenizer directly: same text,
    without transformers' per-call overhead (this runs twice per token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def detokenize_all(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    return _decoder(tokenizer, skip_special_tokens)(list(token_ids))


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._decode = _decoder(tokenizer, params.skip_special_tokens)
        self._enabled = params.detokenize
        self.stop: list[str] = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.stop_reason: str | None = None
        # Window of token ids [prefix_offset:]; ``_read`` is read_offset - prefix_offset.
        self._window: list[int] = list(prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:])
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window) if self._window else ""
        self._text = ""  # finalized output text (after a stop match: cut at the stop)
        self._emitted = 0  # chars of _text already returned
        # With the stop string included in the output, a held-back prefix is returned
        # either way (as part of the stop or as plain text), so nothing is held back.
        hold = 0 if (not self.stop or self.include_stop_str_in_output) else max(map(len, self.stop)) - 1
        self._hold = hold
        self._stop_prefixes = {s[:k] for s in self.stop for k in range(1, len(s))} if hold else set()

    @property
    def output_text(self) -> str:
        """All text returned so far (the concatenation of the deltas). Held-back text
        joins it on a later update or at ``flush()``."""
        return self._text[: self._emitted]

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str:
        """Feeds newly sampled tokens; returns the newly finalized text (maybe "").

        ``stop_terminated``: the last token ended the request (EOS or one of
        ``stop_token_ids``). As in vLLM V1, its text is then not part of the output
        unless include_stop_str_in_output. The caller still calls ``flush()``."""
        if self.stop_reason is not None or not self._enabled:
            return ""
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        start = len(self._text)
        for token_id in new_token_ids:
            self._window.append(token_id)
            new_text = self._decode(self._window)
            if len(new_text) > len(self._prefix_text) and not new_text.endswith("\ufffd"):
                self._text += new_text[len(self._prefix_text):]
                self._advance()
        return self._release(start, final=False)

    def flush(self) -> str:
        """At finish: returns what is still held back, incomplete characters included
        (as U+FFFD, as ``tokenizer.decode`` would), never text past a matched stop."""
        if self.stop_reason is not None or not self._enabled:
            return ""
        start = len(self._text)
        if len(self._window) > self._read:
            new_text = self._decode(self._window)
            if len(new_text) > len(self._prefix_text):
                self._text += new_text[len(self._prefix_text):]
            self._advance()
        return self._release(start, final=True)

    def _advance(self) -> None:
        # prefix_offset = read_offset; read_offset = end. The decode of the new prefix
        # is cached: it only changes here.
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)

    def _release(self, start: int, final: bool) -> str:
        """Checks the text added since ``start`` for stop strings and returns what can
        be emitted now."""
        if len(self._text) > start and self.stop:
            self._match_stop(start)
        end = len(self._text)
        if self.stop_reason is None and not final and self._hold:
            end -= self._held_back(end)
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta

    def _match_stop(self, start: int) -> None:
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self.stop:
            # A new match must end in the new text: begin the search len(s) - 1 before it.
            i = self._text.find(s, max(0, start - len(s) + 1))
            if i != -1 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        if best is None:
            return
        end, neg_len, s = best
        self.stop_reason = s
        cut = end if self.include_stop_str_in_output else end + neg_len
        # Held back text never reached the emitted part, so the cut cannot precede it.
        assert cut >= self._emitted, (cut, self._emitted)
        self._text = self._text[:cut]

    def _held_back(self, end: int) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop
        string (0 if none), capped at what is not yet emitted."""
        for k in range(min(self._hold, end - self._emitted), 0, -1):
            if self._text[end - k:end] in self._stop_prefixes:
                return k
        return 0


def token_texts(out, tokenizer) -> dict[int, str] | None:
    """The text of every token id an output's new logprobs (and prompt logprobs) name,
    for the response encoders; None when there are none."""
    ids = {t for c in out.outputs for lp in (c.delta_logprobs or ()) for t in lp.token_ids}
    if out.prompt_logprobs is not None:  # echo shows the first prompt token too
        ids.update(t for lp in out.prompt_logprobs[1:] for t in (lp.token_ids if lp else ()))
        ids.add(out.prompt_token_ids[0])
    if not ids:
        return None
    return {t: tokenizer.decode([t]) for t in ids}
