"""An offline-trained byte-level BPE tokenizer for test and demo models.

The corpus is generated, not downloaded: a fixed English word list plus pseudo-words
made from syllables by a seeded RNG, with Zipf-like frequencies, so BPE finds enough
merges to reach any vocabulary size we use (up to ~16k). Byte-level BPE covers every
byte, so any text encodes; every id decodes to something. The result is a normal HF
fast-tokenizer directory that ``AutoTokenizer.from_pretrained(dir)`` loads offline.

    id 0..4    special tokens (bos, eos, pad, <|im_start|>, <|im_end|>)
    id 5..260  the 256 byte symbols
    id 261..   merges, then (only if BPE runs out) filler tokens <|extra_N|>
"""

from __future__ import annotations

import json
import os
import random

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2

# ChatML-style; eos_token ends a turn so chat generations stop where plain ones do.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has look "
    "two more write go see number no way could people my than first water been call who oil its now find "
    "long down day did get come made may part hello world model token cache block serve request batch "
    "page memory attention layer tensor kernel python paged llama queue prefix schedule decode prefill"
).split()
_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "sl", "st", "str", "th", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "oo", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "rk", "x", "ck"]


def generate_corpus(num_lines: int = 6000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocab = list(_WORDS)
    while len(vocab) < 30000:
        n = rng.choice((1, 2, 2, 3, 3, 4))
        vocab.append("".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n)))
    cum_weights, total = [], 0.0
    for i in range(len(vocab)):  # Zipf-like; cumulative once, not per rng.choices call
        total += 1.0 / (i + 1) ** 0.8
        cum_weights.append(total)
    punct = [".", ",", "!", "?", ";", ":", ""]
    lines = []
    for i in range(num_lines):
        words = rng.choices(vocab, cum_weights=cum_weights, k=rng.randint(5, 20))
        if i % 3 == 0:
            words = [w.capitalize() if j == 0 else w for j, w in enumerate(words)]
        line = " ".join(words) + rng.choice(punct)
        if i % 7 == 0:
            line += f" {rng.randint(0, 99999)}"
        lines.append(line)
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"a byte-level BPE vocabulary needs >= {len(SPECIAL_TOKENS) + 256} ids, got {vocab_size}.")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(generate_corpus(seed=seed), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:  # BPE ran out of merges: fill deterministically, as plain (decodable) tokens
        tok.add_tokens([AddedToken(f"<|extra_{i}|>", special=False, normalized=False) for i in range(missing)])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, BOS_ID)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS[:3]] == [BOS_ID, EOS_ID, PAD_ID]
    return tok


_CACHE: dict[tuple[int, int], str] = {}


def save_tokenizer(out_dir: str, vocab_size: int, seed: int = 0, model_max_length: int = 2048) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    key = (vocab_size, seed)
    if key not in _CACHE:  # training is not free; test suites build many models of one vocab
        _CACHE[key] = build_tokenizer(vocab_size, seed).to_str()
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        f.write(_CACHE[key])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length, "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                   "additional_special_tokens": [IM_START, IM_END]}, f, indent=2)
