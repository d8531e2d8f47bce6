"""The batched sampler against hand-computed and distributional expectations.

Run as a script (``python tests/test_sampler.py``) to print the build + sample cost
for 256 rows, vocab 8192.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.sampler import (Sampler, SamplingMetadata, apply_penalties, apply_top_k, apply_top_p,
                            make_generator, sample_inverse_cdf)

CPU = torch.device("cpu")


def build(params, *, prompts=None, outputs=None, stops=None, gens=None, vocab=None, logits=None):
    n = len(params)
    return SamplingMetadata.build(
        params=params,
        generators=gens if gens is not None else [None] * n,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        stop_token_ids=stops if stops is not None else [set() for _ in range(n)],
        vocab_size=vocab if vocab is not None else logits.shape[1],
        device=CPU)


def randn(b, v, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_and_builds_no_tensors():
    logits = randn(8, 100)
    md = build([SamplingParams(temperature=0.0)] * 8, logits=logits)
    assert md.all_greedy and md.temperature is None and md.output_counts is None
    assert md.top_k is None and md.min_tokens_rows is None and md.logprob_rows == []
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-4),  # temperature -> 0
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.5, top_p=1e-6),
    SamplingParams(temperature=1.0, top_k=5, top_p=1e-6),
    SamplingParams(temperature=1.0, min_p=1.0),
], ids=["temp-1e-4", "top_k-1", "top_p-tiny", "top_k+top_p", "min_p-1"])
def test_degenerate_random_settings_equal_greedy(params):
    logits = randn(64, 500, seed=1)
    out = Sampler(torch.Generator().manual_seed(7))(logits, build([params] * 64, logits=logits))
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_still_argmax():
    logits = randn(10, 300, seed=2)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.0)
              for i in range(10)]
    md = build(params, logits=logits)
    assert not md.all_greedy and not md.all_random
    out = Sampler(torch.Generator().manual_seed(0))(logits, md).sampled_token_ids
    assert out[1::2].tolist() == logits[1::2].argmax(-1).tolist()


# probs 0.5 / 0.3 / 0.15 / 0.05: which tokens each filter keeps.
P4 = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


@pytest.mark.parametrize("kw,kept", [
    (dict(top_k=2), {0, 1}),
    (dict(top_p=0.7), {0, 1}),  # ascending cumsum .05 .20 .50: drop mass <= .30
    (dict(top_p=0.85), {0, 1, 2}),  # drop mass <= .15: only token 3
    (dict(min_p=0.35), {0, 1}),  # threshold .35 * .5 = .175
    (dict(min_p=0.2), {0, 1, 2}),  # threshold .10
    (dict(top_k=3, min_p=0.5), {0, 1}),  # min_p is relative, so it composes with top-k
    (dict(top_k=3, top_p=0.7), {0, 1}),  # top-p on the top-k candidates (no full sort)
    (dict(top_k=3, top_p=0.8), {0, 1}),  # renormalised over k=3: .53 .32 .16; .84 >= .8
    (dict(top_k=3, top_p=0.9), {0, 1, 2}),
])
def test_filters_keep_exactly_the_expected_tokens(kw, kept):
    n = 4000
    logits = P4.repeat(n, 1)
    out = Sampler(torch.Generator().manual_seed(3))(
        logits, build([SamplingParams(temperature=1.0, **kw)] * n, logits=logits))
    counts = torch.bincount(out.sampled_token_ids, minlength=4)
    assert {i for i in range(4) if counts[i] > 0} == kept
    # Among kept tokens the ratio follows the renormalised distribution.
    assert abs(counts[1].item() / counts[0].item() - 0.6) < 0.08


def test_top_p_on_top_k_candidates_equals_full_sort():
    # Same masked logits whether top-p reuses the top-k candidates or sorts the row.
    logits = randn(6, 200, seed=5)
    ks, ps = [5, 40, 200, 1, 17, 60], [0.3, 0.9, 1.0, 0.99, 0.6, 1.0]
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in zip(ks, ps)]
    md = build(params, logits=logits)
    assert md.top_p_within_top_k and md.top_p_rows.tolist() == [0, 1, 3, 4]
    fast = logits.clone()
    apply_top_p(fast, md, apply_top_k(fast, md.top_k, md.max_top_k))
    md.top_p_within_top_k = False
    slow = logits.clone()
    apply_top_k(slow, md.top_k, md.max_top_k)
    apply_top_p(slow, md)
    assert torch.equal(fast, slow)
    kept = (fast > float("-inf")).sum(-1).tolist()
    assert kept[3] == 1 and kept[2] == 200 and all(1 <= n <= k for n, k in zip(kept, ks))


def test_inverse_cdf_never_picks_a_zero_probability_token():
    # Zeros at the start, the middle and the end; u at both ends of [0, 1) and at a
    # cdf step. x = (1 - u) * total: u -> 1 is the first positive token, u = 0 the last.
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([[0.0], [1 - 2**-24], [0.5], [0.5 - 2**-23]])
    assert sample_inverse_cdf(probs, u).tolist() == [3, 1, 1, 3]
    unnormalised = torch.tensor([[0.0, 0.0, 2e-3, 0.0]])  # min_p leaves rows unnormalised
    assert sample_inverse_cdf(unnormalised, torch.tensor([[0.0]])).tolist() == [2]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_unseeded_distribution_matches_softmax_with_temperature():
    # V = 8 -> 7 degrees of freedom; chi2 0.999 quantile is 24.3. The global generator
    # is seeded, so this test is deterministic, yet it fails for a wrong temperature
    # (e.g. 1.0 instead of 0.7 gives chi2 in the thousands).
    v, n, temp = 8, 20000, 0.7
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.3, -1.0, 0.8])
    logits = row.repeat(n, 1)
    out = Sampler(torch.Generator().manual_seed(0))(
        logits, build([SamplingParams(temperature=temp)] * n, logits=logits))
    counts = torch.bincount(out.sampled_token_ids, minlength=v).float()
    assert chi_square(counts, (row / temp).softmax(-1)) < 24.3
    assert chi_square(counts, row.softmax(-1)) > 100


def test_penalties_hand_computed():
    # token:     0     1     2     3     4     5
    raw = torch.tensor([[2.0, -1.0, 1.5, -0.5, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0,
                            frequency_penalty=0.5, presence_penalty=0.25)
    md = build([params], prompts=[[0, 3]], outputs=[[4, 4, 1]], logits=raw)
    # repetition (seen = prompt {0,3} + output {1,4}): >0 halved, <0 doubled;
    # then output counts {4: 2, 1: 1}: -0.5*count - 0.25*present.
    expected = [[2.0 / 2, -1.0 * 2 - 0.5 - 0.25, 1.5, -0.5 * 2, 1.0 / 2 - 1.0 - 0.25, 0.0]]
    assert torch.allclose(apply_penalties(raw, md), torch.tensor(expected))
    assert raw[0, 0] == 2.0  # input untouched
    # The penalised greedy choice moves from token 0 to token 2.
    assert Sampler()(raw, md).sampled_token_ids.tolist() == [2]


def test_penalised_row_does_not_leak_into_others():
    logits = randn(3, 50, seed=4)
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, frequency_penalty=2.0),
              SamplingParams(temperature=0.0)]
    top = logits.argmax(-1).tolist()
    # Every row generated its own argmax before; only row 1 is penalised for it.
    md = build(params, outputs=[[top[0]] * 5, [top[1]] * 5, [top[2]] * 5], logits=logits)
    out = Sampler()(logits, md).sampled_token_ids.tolist()
    assert out[0] == top[0] and out[2] == top[2] and out[1] != top[1]


def test_bf16_logits_and_input_untouched_on_every_path():
    logits = randn(8, 64, seed=6).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8),
              SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=1),
              SamplingParams(temperature=1.0, top_k=3, min_tokens=2)] * 2
    md = build(params, outputs=[[1]] * 8, prompts=[[3]] * 8, stops=[{0}] * 8, logits=logits)
    assert md.min_tokens_rows.tolist() == [3, 7] and md.penalty_rows.tolist() == [2, 6]
    out = Sampler(torch.Generator().manual_seed(0))(logits, md)
    assert torch.equal(logits, before)
    assert out.sampled_token_ids[0].item() == logits[0].float().argmax().item()
    assert out.logprobs[2].logprobs[0] == pytest.approx(
        logits[2].float().log_softmax(-1)[out.sampled_token_ids[2]].item(), abs=1e-5)


def test_min_tokens_masks_stop_tokens_until_reached():
    eos, stop = 7, 3
    logits = torch.zeros(1, 10)
    logits[0, eos], logits[0, stop], logits[0, 5] = 5.0, 4.0, 3.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])
    sampler = Sampler()
    for n_out, want in [(0, 5), (2, 5), (3, eos)]:
        md = build([params], outputs=[[1] * n_out], stops=[{eos, stop}], logits=logits)
        assert sampler(logits, md).sampled_token_ids.tolist() == [want]
    assert logits[0, eos] == 5.0  # input untouched


def run_steps(seed, position, others, steps, logits_per_step):
    """Sample ``steps`` tokens for a seeded request at ``position`` among ``others``."""
    gen = make_generator(seed, CPU)
    sampler = Sampler()  # torch's default generator for the unseeded rows
    params = list(others)
    params.insert(position, SamplingParams(temperature=1.0, top_p=0.95, seed=seed))
    gens = [make_generator(100 + i, CPU) if p.seed is not None else None
            for i, p in enumerate(params)]
    gens[position] = gen
    got = []
    for step in range(steps):
        logits = randn(len(params), 1000, seed=1000 + step)
        logits[position] = logits_per_step[step]
        md = build(params, gens=gens, logits=logits)
        got.append(sampler(logits, md).sampled_token_ids[position].item())
    return got


def test_seeded_row_is_independent_of_batch_and_run():
    steps = 6
    rows = [randn(1, 1000, seed=50 + s)[0] * 0.3 for s in range(steps)]  # flat: noise decides
    alone = run_steps(1234, 0, [], steps, rows)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
              SamplingParams(temperature=1.0, seed=9), SamplingParams(temperature=1.2, top_k=20),
              SamplingParams(temperature=0.5, min_p=0.1), SamplingParams(temperature=1.0, logprobs=3),
              SamplingParams(temperature=1.0, frequency_penalty=1.0)] * 2
    others += [SamplingParams(temperature=0.9), SamplingParams(temperature=0.0)]
    assert len(others) == 16
    torch.manual_seed(0)
    in_batch = run_steps(1234, 7, others, steps, rows)
    torch.manual_seed(1)  # different global noise for the unseeded rows
    in_batch_again = run_steps(1234, 16, others, steps, rows)
    assert alone == in_batch == in_batch_again
    assert run_steps(4321, 0, [], steps, rows) != alone


def test_logprobs_are_raw_log_softmax_with_ranks():
    raw = torch.tensor([[3.0, 2.5, 1.5, 0.0, -1.0],
                        [0.0, 1.0, 4.0, 2.0, 3.0],
                        [1.0, 1.0, 1.0, 1.0, 9.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=2),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, logprobs=0)]
    # Row 0 already produced tokens 0 and 1: the penalty makes greedy pick token 2,
    # whose raw rank is 3; its logprobs are still those of the raw logits.
    md = build(params, outputs=[[0, 1], [], []], logits=raw)
    out = Sampler(torch.Generator().manual_seed(0))(raw, md)
    assert out.sampled_token_ids[0].item() == 2
    assert out.logprobs[1] is None
    ref = raw.log_softmax(-1)
    lp0 = out.logprobs[0]
    assert lp0.token_ids == [2, 0, 1] and lp0.sampled_rank == 3
    assert lp0.logprobs == pytest.approx([ref[0, 2].item(), ref[0, 0].item(), ref[0, 1].item()], abs=1e-6)
    lp2 = out.logprobs[2]
    tok = out.sampled_token_ids[2].item()
    assert lp2.token_ids == [tok] and lp2.logprobs == pytest.approx([ref[2, tok].item()], abs=1e-6)
    assert lp2.sampled_rank == (1 if tok == 4 else 2)
    assert math.isclose(sum(math.exp(x) for x in ref[0].tolist()), 1.0, rel_tol=1e-6)


def test_logprob_token_ids_replace_the_top_n():
    """vLLM's logprob_token_ids: the row's entries are the sampled token, then the asked ids
    (their raw logprobs), not the top N; a row beside it keeps its top N."""
    raw = torch.tensor([[3.0, 2.5, 1.5, 0.0, -1.0],
                        [0.0, 1.0, 4.0, 2.0, 3.0]])
    params = [SamplingParams(temperature=0.0, logprobs=3, logprob_token_ids=[4, 1]),
              SamplingParams(temperature=0.0, logprobs=2)]
    out = Sampler(torch.Generator().manual_seed(0))(raw, build(params, logits=raw))
    ref = raw.log_softmax(-1)
    asked, top = out.logprobs
    assert asked.token_ids == [0, 4, 1] and asked.sampled_rank == 1
    assert asked.logprobs == pytest.approx([ref[0, 0].item(), ref[0, 4].item(), ref[0, 1].item()], abs=1e-6)
    assert top.token_ids == [2, 2, 4]
    with pytest.raises(ValueError, match="logprob_token_ids needs logprobs"):
        SamplingParams(logprob_token_ids=[1])


def _bench() -> None:
    """Build + sample for 256 rows, vocab 8192. Best of 5 rounds (the box is shared)."""
    import time

    v, b = 8192, 256
    logits = randn(b, v)
    outs = [[i % v for i in range(r, r + 50)] for r in range(b)]
    prompts = [[i % v for i in range(r, r + 200)] for r in range(b)]
    eos = [{2} for _ in range(b)]
    mixes = {
        "all-greedy": [SamplingParams(temperature=0.0) for _ in range(b)],
        "all-random t=0.8": [SamplingParams(temperature=0.8) for _ in range(b)],
        "mixed": [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9),
                  SamplingParams(temperature=1.0, top_k=50, seed=1),
                  SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.1,
                                 frequency_penalty=0.2, logprobs=5)] * (b // 4),
    }
    sampler = Sampler()

    def best_us(fn, n=10):
        fn()
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            rounds.append((time.perf_counter() - t0) / n * 1e6)
        return min(rounds)

    for name, params in mixes.items():
        gens = [make_generator(p.seed, CPU) if p.seed is not None else None for p in params]

        def make():
            return build(params, prompts=prompts, outputs=outs, stops=eos, gens=gens, logits=logits)

        md = make()
        print(f"{name:18s} build: {best_us(make):8.0f} us   sample: "
              f"{best_us(lambda: sampler(logits, md)):8.0f} us")


if __name__ == "__main__":
    import sys
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    print(f"torch threads: {torch.get_num_threads()}, rows 256, vocab 8192")
    _bench()
