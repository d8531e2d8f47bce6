"""The offline BPE tokenizer: loads through AutoTokenizer with the hub switched off,
round-trips text, has the special tokens the model config names, renders its chat
template, and every id below vocab_size decodes to something."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers

from pagedserve.worker.loading.tokenizer_build import BOS, BOS_ID, EOS, EOS_ID, IM_END, IM_START, PAD, PAD_ID, build_tokenizer, generate_corpus, save_tokenizer

VOCAB = 1024


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(str(path), VOCAB)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


def test_autotokenizer_loads_offline_in_a_fresh_process(tok_dir):
    code = ("import transformers; t = transformers.AutoTokenizer.from_pretrained(%r); "
            "print(len(t), t('hello world').input_ids)" % str(tok_dir))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    size, ids = out.stdout.strip().split(" ", 1)
    assert int(size) == VOCAB and ids.startswith(f"[{BOS_ID}, ")


@pytest.mark.parametrize("text", ["Hello world, this is a test.", "  leading spaces\tand\ttabs\n",
                                  "unicode: héllo wörld — 東京 🙂", "1234567890 !@#$%^&*()", ""])
def test_round_trip(tok, text):
    ids = tok(text).input_ids
    assert ids[0] == BOS_ID and all(0 <= i < VOCAB for i in ids)
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids[1:]) == text


def test_special_tokens(tok):
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert tok.convert_tokens_to_ids([IM_START, IM_END]) == [3, 4]
    # special tokens in text are single ids, never split into bytes
    assert tok(f"a{IM_END}b", add_special_tokens=False).input_ids[1] == 4
    assert tok.decode([BOS_ID, EOS_ID], skip_special_tokens=True) == ""


def test_chat_template_renders(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (f"{BOS}{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nHi there{IM_END}\n"
                    f"{IM_START}assistant\n")
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids.count(BOS_ID) == 1 and ids[0] == BOS_ID  # the template's bos, not a second one
    assert ids.count(3) == 3 and ids.count(4) == 2


def test_vocabulary_size_and_every_id_decodes(tok, tok_dir):
    assert len(tok) == VOCAB
    assert len(json.load(open(os.path.join(tok_dir, "tokenizer.json")))["model"]["vocab"]) == VOCAB
    for i in range(VOCAB):
        assert tok.decode([i]) != "", i
    # merges learnt from the corpus: common words are single tokens
    assert len(tok(" the", add_special_tokens=False).input_ids) == 1


def test_deterministic_build():
    # two independent trainings (save_tokenizer caches per process; build_tokenizer does not)
    assert build_tokenizer(400, seed=5).to_str() == build_tokenizer(400, seed=5).to_str()
    assert generate_corpus(10, seed=1) == generate_corpus(10, seed=1) != generate_corpus(10, seed=2)
