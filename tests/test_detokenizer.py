"""Incremental detokenization and stop strings on a real byte-level BPE tokenizer.

The tokenizer is trained here (a second): with a small vocabulary, accented letters, CJK
and emoji are split into byte tokens, and some merges end in the middle of a character,
which is exactly what the prefix/read offset technique has to get right.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedserve.cluster.engine.detokenizer import IncrementalDetokenizer, detokenize_all
from pagedserve.scheduler.sampling_params import SamplingParams

SENTENCES = [
    "héllo wörld 你好 🙂", "the quick brown fox jumps over the lazy dog.", "Grüße aus Köln, ça va?",
    "naïve café résumé", "東京は晴れです。", "emoji 🙂🙂 party 🎉 and 👍🏽", "hello world </end>",
    "Ελληνικά και русский текст", "price: 42€ or £37", "the end. The End! THE END?",
]
CORPUS = [f"{SENTENCES[i % 10]} {i} {SENTENCES[i * 7 % 10]}" for i in range(300)]


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=["<s>", "</s>", "<|eot|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    t.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["<|eot|>"],
                                   clean_up_tokenization_spaces=False)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def stream(tok, chunks, params=None, prompt=()):
    """Feeds ``chunks`` (lists of ids) one update each; returns (deltas, flush, detok)."""
    d = IncrementalDetokenizer(tok, list(prompt), params or SamplingParams())
    deltas = [d.update(list(c)) for c in chunks]
    return deltas, d.flush(), d


def test_partial_character_tokens_exist(tok):
    # Guard: the vocabulary really splits characters, or the next tests prove nothing.
    pieces = [tok.decode([i]) for i in enc(tok, "你好 🙂 wörld")]
    assert any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("text", SENTENCES)
def test_deltas_concatenate_to_decode_and_never_split_a_character(tok, text):
    ids = enc(tok, text)
    deltas, rest, d = stream(tok, [[i] for i in ids], prompt=enc(tok, "Say: "))
    assert "".join(deltas) + rest == tok.decode(ids) == text
    assert rest == "" and d.output_text == text
    assert not any("\ufffd" in x for x in deltas)
    # The window stays a few tokens long: O(new tokens) per update.
    assert len(d._window) <= 8


def test_emoji_arrives_whole_in_one_delta(tok):
    ids = enc(tok, "a🙂b")
    deltas, _, _ = stream(tok, [[i] for i in ids])
    assert "🙂" in deltas and len(ids) > 3  # 4 bytes, several tokens, one delta


def test_skip_special_tokens(tok):
    eot, eos = tok.convert_tokens_to_ids("<|eot|>"), tok.eos_token_id
    ids = enc(tok, "hi") + [eot] + enc(tok, " there") + [eos]
    skipped = "".join(stream(tok, [[i] for i in ids])[0])
    kept = stream(tok, [[i] for i in ids], SamplingParams(skip_special_tokens=False))
    assert skipped == "hi there" == detokenize_all(tok, ids)
    assert "".join(kept[0]) == "hi<|eot|> there</s>" == detokenize_all(tok, ids, False)


def test_stop_token_text_is_dropped_unless_included(tok):
    # A stop_token_ids token that is ordinary text (here ".") ends the request: as in
    # vLLM, its text is not returned, unless include_stop_str_in_output.
    ids = enc(tok, "fox.")
    for include, want in [(False, "fox"), (True, "fox.")]:
        d = IncrementalDetokenizer(tok, [], SamplingParams(stop_token_ids=[ids[-1]],
                                                           include_stop_str_in_output=include))
        assert d.update(ids, stop_terminated=True) + d.flush() == want == d.output_text


def test_stop_string_across_tokens_is_cut_exactly(tok):
    text = "the quick brown fox jumps over the lazy dog."
    ids = enc(tok, text)
    stop = "fox jumps"
    assert not any(stop in tok.decode([i]) for i in ids)  # it spans several tokens
    deltas, rest, d = stream(tok, [[i] for i in ids], SamplingParams(stop=[stop]))
    assert "".join(deltas) == d.output_text == "the quick brown "
    assert d.stop_reason == stop and rest == ""
    assert d.update(enc(tok, " more")) == "" and d.output_text == "the quick brown "


def test_include_stop_str_in_output(tok):
    ids = enc(tok, "the quick brown fox jumps over")
    params = SamplingParams(stop=["brown f"], include_stop_str_in_output=True)
    deltas, _, d = stream(tok, [ids], params)  # one update that runs past the stop
    assert deltas == ["the quick brown f"] and d.stop_reason == "brown f"


def test_stop_string_at_the_very_first_token(tok):
    ids = enc(tok, "hello world")
    deltas, rest, d = stream(tok, [[i] for i in ids], SamplingParams(stop=["h"]))
    assert deltas[0] == "" and d.stop_reason == "h" and "".join(deltas) + rest == ""


def test_hold_back_is_minimal_and_released(tok):
    # Chunks encoded separately: the update boundaries are the chunk boundaries.
    chunks = ["abc <", "/", "x def <", "/e", "nd", " tail"]
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["</end>"]))
    got = [d.update(enc(tok, c)) for c in chunks]
    # "<" and "</" may start "</end>": held; "</x" cannot: released at once.
    assert got[:3] == ["abc ", "", "</x def "]
    assert got[3:5] == ["", ""]  # "</e", "</end" still pending
    assert got[5] == "</end tail" and d.stop_reason is None
    d2 = IncrementalDetokenizer(tok, [], SamplingParams(stop=["</end>", "STOP"]))
    assert d2.update(enc(tok, "ok </en")) == "ok " and d2.flush() == "</en"
    assert d2.output_text == "ok </en"


def test_first_stop_to_end_wins(tok):
    # One update holds "abcd": checking char by char, "bc" completes before "abcd".
    params = SamplingParams(stop=["abcd", "bc"])
    deltas, _, d = stream(tok, [enc(tok, "xabcdy")], params)
    assert deltas == ["xa"] and d.stop_reason == "bc"
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["bc", "xab"]))
    assert d.update(enc(tok, "xabc")) == "" and d.stop_reason == "xab"


def test_flush_releases_an_incomplete_character_like_decode(tok):
    ids = enc(tok, "a你")
    assert tok.decode(ids[:-1]).endswith("\ufffd")
    deltas, rest, _ = stream(tok, [[i] for i in ids[:-1]])
    assert "".join(deltas) == "a" and rest == tok.decode(ids[:-1])[1:]


def test_project_tokenizer_round_trip():
    # The demo/test tokenizer of worker/loading/tokenizer_build.py (ASCII-trained: CJK is bytes).
    from pagedserve.worker.loading.tokenizer_build import build_tokenizer

    t = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(600), eos_token="<|end_of_text|>",
                                clean_up_tokenization_spaces=False)
    text = "hello world 你好 🙂 the model decodes paged attention."
    ids = t.encode(text, add_special_tokens=False)
    deltas, rest, _ = stream(t, [[i] for i in ids], SamplingParams(stop=["attention"]))
    assert "".join(deltas) + rest == "hello world 你好 🙂 the model decodes paged "


# Property: for any token ids (invalid UTF-8 included), any chunking and a stop string
# taken from the text, the stream equals the full decode cut at the stop.
@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_stream_equals_full_decode_cut_at_stop(tok, data):
    ids = data.draw(st.lists(st.integers(3, len(tok) - 1), min_size=1, max_size=40))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    chunks = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]
    full = tok.decode(ids)
    stops = []
    if data.draw(st.booleans()) and len(full) > 1:
        a = data.draw(st.integers(0, len(full) - 1))
        stops = [full[a:a + data.draw(st.integers(1, 4))]]
    include = data.draw(st.booleans())
    deltas, rest, d = stream(tok, chunks, SamplingParams(stop=stops, include_stop_str_in_output=include))
    expected = full
    if stops:
        i = full.find(stops[0])
        expected = full[: i + len(stops[0]) if include else i]
        assert d.stop_reason == stops[0]
    assert "".join(deltas) + rest == expected == d.output_text
