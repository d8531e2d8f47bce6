"""What a structured-output request costs the requests batched with it, offline.

    python -m pagedserve.loadtest.offline.bench_structured [--model pagedserve-demo] [--rounds 3]

Per round, two batches of 4 decoding requests on one engine, alternated so machine
noise hits both alike: A = 4 unconstrained, B = 3 unconstrained + 1 json_schema. The
decode step time is the median over steps where all 4 rows decode; the engine-side
bitmask fill and the grammar compile (cold vs cached) are timed on their own.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedserve.cluster.llm import LLM
from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams

# A long constrained output: its string must run 60-80 characters.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["note", "n"],
          "properties": {"note": {"type": "string", "minLength": 60, "maxLength": 80},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9}}}


def _batch(llm: LLM, constrained: bool, max_tokens: int, tag: str) -> list[float]:
    """Step times (s) of the steps where all 4 requests decode."""
    eng = llm.engine
    for i in range(4):
        so = StructuredOutputsParams(json=SCHEMA) if constrained and i == 0 else None
        eng.add_request(f"{tag}-{i}", "page memory cache block", SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=so is None, structured_outputs=so))
    times = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        plan = eng.last_plan
        if len(plan.num_scheduled_tokens) == 4 and plan.total_num_scheduled_tokens == 4:
            times.append(dt)
    return times


def _paired_sampler(llm: LLM, runner) -> None:
    """The worker's part alone, alternated call by call on the same logits [4, V] (so
    load from other processes hits both alike): metadata build + sampling of 4 free rows
    vs 3 free + 1 masked by a real matcher's bitmask."""
    import numpy as np
    import torch

    from pagedserve.worker.sampling_metadata import SamplingMetadata

    mgr = llm.engine.structured
    mgr.add_request("paired", StructuredOutputsParams(json=SCHEMA))
    mask = torch.empty((1, mgr.num_words), dtype=torch.int32)
    mgr.matchers.pop("paired").fill_next_token_bitmask(mask, 0)
    row = np.ascontiguousarray(mask.numpy()[0])
    v = runner.vocab_size
    logits = torch.randn(4, v)
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(4)]
    args = ([None] * 4, [[1]] * 4, [[]] * 4, [set()] * 4, v, "cpu")
    ta, tb = [], []
    for _ in range(300):
        for out, bitmask in ((ta, None), (tb, [row, None, None, None])):
            t = time.perf_counter()
            runner.sampler(logits, SamplingMetadata.build(params, *args, bitmask))
            out.append(time.perf_counter() - t)
    ma, mb = statistics.median(ta) * 1e3, statistics.median(tb) * 1e3
    print(f"sampler, paired (V={v}): 4 free {ma:.3f} ms, 3 free + 1 masked {mb:.3f} ms, "
          f"+{mb - ma:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="pagedserve-demo", help='"default": SmolLM2-135M-Instruct')
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    llm = LLM(model=None if args.model == "default" else args.model, dtype="float32", max_model_len=512, num_gpu_blocks_override=256)
    so = StructuredOutputsParams(json=SCHEMA)
    t0 = time.perf_counter()
    llm.engine.structured.compile(so)  # the first compile also builds the GrammarCompiler
    first = time.perf_counter() - t0
    other = StructuredOutputsParams(json=dict(SCHEMA, required=["note"]))
    t0 = time.perf_counter()
    llm.engine.structured.compile(other)  # cold: a new schema, the compiler exists
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.engine.structured.compile(other)
    cached = time.perf_counter() - t0
    print(f"compile: first (with tokenizer info) {first * 1e3:.1f} ms, cold {cold * 1e3:.1f} ms, "
          f"cached {cached * 1e6:.1f} us")

    # The parts a constrained row adds, timed where they run: the engine fills the mask
    # and advances the matcher; the worker builds the sampling metadata and samples.
    timings: dict[str, list[float]] = {"fill": [], "accept": [], "accept_free": [],
                                       "sample_a": [], "sample_b": []}
    mgr, runner = llm.engine.structured, llm.engine.executor.worker.runner
    phase = ["a"]

    def timed(obj, name, key):
        inner = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            out = inner(*a, **k)
            timings[key() if callable(key) else key].append(time.perf_counter() - t)
            return out
        setattr(obj, name, wrapper)

    timed(mgr, "fill_bitmask", "fill")
    timed(mgr, "accept", lambda: "accept" if phase[0] == "b" else "accept_free")
    timed(runner, "_sample_rows", lambda: f"sample_{phase[0]}")
    _batch(llm, True, 8, "warm")  # warm-up
    for key in timings:
        timings[key].clear()
    a, b = [], []
    for r in range(args.rounds):
        phase[0] = "a"
        a += _batch(llm, False, args.max_tokens, f"a{r}")
        phase[0] = "b"
        b += _batch(llm, True, args.max_tokens, f"b{r}")
    med = {k: statistics.median(v) * 1e3 if v else float("nan") for k, v in timings.items()}
    pa, pb = (statistics.quantiles(x, n=10)[0] * 1e3 for x in (a, b))
    print(f"decode step, 4 rows (all rows decoding): unconstrained p10 {pa:.2f} median "
          f"{statistics.median(a) * 1e3:.2f} ms (n={len(a)}); 3 + 1 json_schema p10 {pb:.2f} median "
          f"{statistics.median(b) * 1e3:.2f} ms (n={len(b)}); p10 overhead {pb - pa:+.2f} ms")
    _paired_sampler(llm, runner)
    print(f"parts, median per step: engine bitmask fill {med['fill']:.3f} ms, accept() "
          f"{med['accept']:.4f} ms per request of batch B (1 of 4 has a matcher), worker metadata + sampling {med['sample_a']:.3f} ms "
          f"(4 free) vs {med['sample_b']:.3f} ms (3 free + 1 constrained)")
    llm.shutdown()


if __name__ == "__main__":
    main()
