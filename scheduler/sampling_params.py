"""Sampling parameters with the OpenAI / vLLM field names.

A plain dataclass (it crosses the scheduler -> worker boundary inside the step
plan), validated in ``__post_init__`` so that every user mistake becomes one
``ValueError`` with a message that names the field and the allowed range. The
HTTP layer turns that ``ValueError`` into an OpenAI-style 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Below this temperature sampling is treated as greedy (argmax), as in vLLM.
_GREEDY_EPS = 1e-5
# OpenAI's ``seed`` is an int64. torch's generators take [-2**63, 2**64) and raise past
# it, inside the step: a seed outside int64 must be refused here, before it is queued.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of an ``n > 1`` request: ``seed + index``, wrapped
    into int64 so that ``seed = 2**63 - 1, n = 2`` stays a valid seed (not an overflow)."""
    return (seed + index - SEED_MIN) % 2**64 + SEED_MIN


# OpenAI's bound on a logit_bias value ("-100 bans, +100 forces in practice").
LOGIT_BIAS_MAX = 100.0
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class StructuredOutputsParams:
    """What the output must match; exactly one field is set (vLLM's names). Only its
    shape is checked here: whether a schema, regex or grammar compiles is the engine's
    check (cluster/engine/structured_output.py), done before the request is queued."""

    json: str | dict | None = None  # a JSON schema (text or parsed)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF / GBNF
    json_object: bool | None = None  # any JSON object (OpenAI's response_format json_object)

    def __post_init__(self) -> None:
        given = [k for k in _SO_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs need exactly one of json, regex, choice, grammar "
                             f"or json_object; got {', '.join(given) or 'none'}.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured outputs: json must be a JSON schema (an object or its text).")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs: {name} must be a non-empty string.")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                raise ValueError("structured outputs: choice must be a non-empty list of non-empty strings.")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured outputs: json_object must be true when given.")

    @property
    def kind(self) -> str:
        return next(k for k in _SO_KINDS if getattr(self, k) not in (None, False))


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    # vLLM V0: draw best_of samples, return the n with the highest cumulative logprob.
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # top-N logprobs per sampled token (0: only the sampled one; -1: the whole vocabulary,
    # resolved by the engine, which also bounds N by --max-logprobs: vocab_limits.py)
    logprobs: int | None = None
    # vLLM's: with logprobs, each sampled token's entry holds these ids' logprobs (after the
    # sampled one's) instead of the top N.
    logprob_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    # token id -> added to its logit before sampling (OpenAI's logit_bias), greedy too.
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's prompt logprobs: top-N per prompt position (0: only the prompt's own token).
    # A request that asks computes its whole prompt: prefix-cache hits would skip rows.
    prompt_logprobs: int | None = None
    # Keep only k prompt tokens (-1: max_model_len), applied after tokenizing: the last k
    # ("left", cutting the start, as vLLM by default) or the first k ("right").
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._verify()

    def _verify(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}.")
        if self.n > 128:
            bad(f"n must be <= 128, got {self.n}.")
        if self.best_of is not None and (not isinstance(self.best_of, int)
                                         or not self.n <= self.best_of <= 128):
            bad(f"best_of must be an integer in [n={self.n}, 128], got {self.best_of!r}.")
        if not self.temperature >= 0.0:  # also rejects NaN
            bad(f"temperature must be >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be -1 (disable), 0 (disable) or a positive integer, got {self.top_k!r}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be at least 1, got {self.max_tokens!r}.")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < -1):
            bad(f"logprobs must be -1 (the whole vocabulary) or >= 0, got {self.logprobs!r}.")
        if self.logprob_token_ids is not None:
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.logprob_token_ids):
                bad("logprob_token_ids must be a list of non-negative token ids.")
            if not 0 < len(self.logprob_token_ids) <= MAX_LOGPROB_TOKEN_IDS:
                bad(f"logprob_token_ids must name 1 to {MAX_LOGPROB_TOKEN_IDS} token ids, "
                    f"got {len(self.logprob_token_ids)}.")
            if self.logprobs is None:
                bad("logprob_token_ids needs logprobs (they replace its top N).")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20):
            bad(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs!r}.")
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int)
                or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)):
            bad("truncate_prompt_tokens must be -1 (max_model_len) or an integer >= 1, "
                f"got {self.truncate_prompt_tokens!r}.")
        if self.truncation_side not in ("left", "right"):
            bad(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            bad(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (int64), got {self.seed!r}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a string or a list of non-empty strings.")
        if len(self.stop) > 16:
            bad(f"at most 16 stop strings are allowed, got {len(self.stop)}.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be a list of non-negative integers.")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias must map token ids to biases.")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    bad(f"logit_bias keys must be non-negative token ids, got {t!r}.")
                if isinstance(b, bool) or not isinstance(b, (int, float)) \
                        or not -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX:  # also rejects NaN
                    bad(f"logit_bias values must be in [-100, 100], got {b!r} for token {t}.")
            if len(self.logit_bias) > 1024:  # OpenAI's limit; a bigger map is a mask, not a bias
                bad(f"logit_bias may name at most 1024 tokens, got {len(self.logit_bias)}.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            bad("structured_outputs must be a StructuredOutputsParams.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields changed (used to fork ``n > 1`` into samples)."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values["stop"] = list(self.stop)
        values["stop_token_ids"] = list(self.stop_token_ids)
        values.update(changes)
        return SamplingParams(**values)
