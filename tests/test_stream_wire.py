"""The stream between the engine replica and the ingress (cluster/wire/stream.py):
items carry deltas only, the final one whole, and the ingress rebuilds every item's
cumulative fields exactly; items that waited together merge into one that loses nothing.
Driven by a real engine (a tiny random Llama) with n=2, logprobs, prompt logprobs and a
stop string, against the RequestOutputs it made, snapshotted as they came out."""

from __future__ import annotations

import copy
import pickle

import pytest

from pagedserve.cluster.engine.llm_engine import LLMEngine
from pagedserve.cluster.executors.uniproc import UniProcExecutor
from pagedserve.cluster.wire.stream import Accumulated, merge, merge_texts, slim
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.worker.loading.random_models import make_test_model


@pytest.fixture(scope="module")
def streams(tmp_path_factory):
    path = make_test_model("llama-gqa2-hd64", tmp_path_factory.getbasetemp() / "wire-models")
    engine = LLMEngine(EngineConfig(model=path, max_model_len=256, num_gpu_blocks_override=128,
                                    max_num_seqs=8, dtype="float32", seed=0), UniProcExecutor)
    cases = {
        "greedy": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        "n2": SamplingParams(max_tokens=20, n=2, temperature=1.0, seed=3, logprobs=2, ignore_eos=True),
        "plp": SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=1, ignore_eos=True),
        "one": SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    }
    for i, (rid, p) in enumerate(cases.items()):
        engine.add_request(rid, [5 + i, 9, 11, 13, 17, 19, 23], p)
    got: dict[str, list] = {rid: [] for rid in cases}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].append(copy.deepcopy(out))  # the engine's lists keep growing
    return got


def _cumulative(out):
    return (out.prompt_token_ids, out.finished, out.prompt_logprobs is not None,
            [(c.index, c.text, c.token_ids, c.finish_reason, c.logprobs) for c in out.outputs],
            [(c.delta_text, c.delta_token_ids, c.delta_logprobs) for c in out.outputs])


def test_every_item_is_rebuilt_exactly_from_the_deltas(streams):
    for rid, outs in streams.items():
        acc = Accumulated(None)
        for k, out in enumerate(outs):
            wire = pickle.loads(pickle.dumps(slim(out, first=k == 0)))  # as Ray sends it
            if not out.finished:
                assert wire.prompt_token_ids == ([] if k else out.prompt_token_ids)
                assert all(c.token_ids == [] and c.text == "" for c in wire.outputs)
            assert _cumulative(acc.rebuild(wire)) == _cumulative(out), (rid, k)


def test_the_wire_is_smaller_than_the_cumulative_outputs(streams):
    outs = streams["n2"]
    whole = sum(len(pickle.dumps(o)) for o in outs)
    wire = sum(len(pickle.dumps(slim(o, first=k == 0))) for k, o in enumerate(outs))
    assert wire < 0.6 * whole, (wire, whole)


@pytest.mark.parametrize("group", [2, 3, 100])
def test_merged_items_carry_every_delta(streams, group):
    """Items that waited together become one: the stream of merged items rebuilds the
    same final output and the same concatenated deltas (the text a streaming client sees)."""
    for rid, outs in streams.items():
        merged = []
        for k in range(0, len(outs), group):
            m, tt = outs[k], {1: "a"}
            for nxt in outs[k + 1:k + group]:
                m, tt = merge(m, nxt), merge_texts(tt, {2: "b"})
            merged.append(m)
            assert tt == ({1: "a", 2: "b"} if len(outs[k:k + group]) > 1 else {1: "a"})
        acc = Accumulated(None)
        rebuilt = [acc.rebuild(slim(m, first=k == 0)) for k, m in enumerate(merged)]
        assert _cumulative(rebuilt[-1])[:4] == _cumulative(outs[-1])[:4]
        for idx in range(len(outs[-1].outputs)):
            def cat(items, field):
                return sum((getattr(next(c for c in o.outputs if c.index == idx), field) or [] for o in items), [])
            assert "".join(next(c for c in o.outputs if c.index == idx).delta_text for o in rebuilt) == \
                "".join(next(c for c in o.outputs if c.index == idx).delta_text for o in outs)
            assert cat(rebuilt, "delta_token_ids") == cat(outs, "delta_token_ids")
            assert cat(rebuilt, "delta_logprobs") == cat(outs, "delta_logprobs")
        assert any(o.prompt_logprobs is not None for o in rebuilt) == any(o.prompt_logprobs is not None for o in outs)
