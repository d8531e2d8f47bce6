"""Quantised KV cache on a real model, CPU: accuracy against the unquantised cache, and decode speed.

    python -m pagedserve.loadtest.offline.bench_kv_quant accuracy [--model M] [--prompts 64] [--tokens 128]
    python -m pagedserve.loadtest.offline.bench_kv_quant speed [--model M] [--batch 32] [--context 2000] [--rounds 6]

Both drive the model the engine loads (Worker: loader, CPU linear backend, the model's
forward with the paged cache) directly with hand-built step metadata, so every format sees
exactly the same batches and only the cache differs.

accuracy: 64 English prompts; the "auto" cache decodes 128 greedy tokens from each (the
  reference). Each quantised format is then teacher-forced along the reference tokens
  (prefill the prompt, then one decode step per reference token, batch = all prompts):
  agreement = its argmax equals the reference token; mean |delta logprob| of the reference
  tokens against auto's; and a free greedy run from the same prompts gives the position of
  the first token that differs from the reference (128 = none).
speed: batch x context decode rows over a cache filled with random K/V (the same values for
  every format); rounds interleave the formats (A/B/C/D, A/B/C/D, ...) because the machine is
  shared, and the median step time of each is reported as decode tok/s and as a ratio to auto.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedserve.kernels import AttentionMetadata, write_kv_cache
from pagedserve.config import EngineConfig
from pagedserve.worker.loading.model_source import resolve_model
from pagedserve.worker.worker import Worker

FORMATS = ("auto", "fp8", "fp8_e5m2", "int8")
_OPENERS = ("Once upon a time,", "The history of", "Here is a short guide to", "Scientists explain that",
            "My favourite thing about", "A common question about", "In the morning,", "The main reason for")
_TOPICS = ("the ocean", "bread baking", "the Roman empire", "electric cars", "learning a language",
           "black holes", "gardening", "the internet")


class Driver:
    """The engine's model with one cache per format; sequence i owns blocks [i*nb, (i+1)*nb)."""

    def __init__(self, model: str | None, num_seqs: int, max_len: int, formats=FORMATS) -> None:
        path = resolve_model(model).path
        self.worker = Worker(EngineConfig(model=path, device="cpu"))
        self.worker.init_device()
        self.worker.load_model()
        self.model, mc = self.worker.runner.model, self.worker.model_config
        self.nb = -(-max_len // 16)
        self.num_seqs = num_seqs
        self.table = torch.arange(num_seqs * self.nb, dtype=torch.int32).view(num_seqs, self.nb)
        self.caches = {}
        for fmt in formats:
            self.worker.config.kv_cache_dtype = fmt
            self.worker.runner.initialize_cache(num_seqs * self.nb, mc.get_num_kv_heads(1), self.worker.kv_cache_dtype)
            self.caches[fmt] = self.worker.runner.kv_caches
        self.path = path

    def _slots(self, seq: int, positions: range) -> list[int]:
        return [int(self.table[seq, p // 16]) * 16 + p % 16 for p in positions]

    @torch.inference_mode()
    def step(self, fmt: str, rows: list[tuple[int, list[int], int]], logits: bool = True) -> torch.Tensor:
        """rows: (seq, new token ids, tokens already cached). Returns the last row's log-probs per seq."""
        decode = all(len(t) == 1 for _, t, _ in rows)
        ids, pos, slots, cu, lens, qlens = [], [], [], [0], [], []
        for seq, toks, done in rows:
            ids += toks
            pos += range(done, done + len(toks))
            slots += self._slots(seq, range(done, done + len(toks)))
            cu.append(cu[-1] + len(toks))
            lens.append(done + len(toks))
            qlens.append(len(toks))
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_table=self.table[[s for s, _, _ in rows]].contiguous(),
            seq_lens=torch.tensor(lens, dtype=torch.int32), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            max_seqlen_q=max(qlens), max_seq_len=max(lens), num_decode_tokens=len(rows) if decode else 0,
            seq_lens_cpu=lens, query_lens_cpu=qlens)
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.caches[fmt], md)
        if not logits:
            return hidden
        last = torch.tensor(cu[1:]) - 1
        return torch.log_softmax(self.model.compute_logits(hidden.index_select(0, last)).float(), dim=-1)


def _run(d: Driver, fmt: str, prompts: list[list[int]], n: int, forced: list[list[int]] | None):
    """Prefill, then n - 1 decode steps feeding ``forced`` tokens (or the argmax). -> (argmax, logp of ref)."""
    seqs = range(len(prompts))
    lp = d.step(fmt, [(i, p, 0) for i, p in zip(seqs, prompts)])
    picks, ref_lp = [], []
    for t in range(n):
        top = lp.argmax(-1)
        picks.append(top)
        ref = top if forced is None else torch.tensor([f[t] for f in forced])
        ref_lp.append(lp.gather(1, ref[:, None])[:, 0])
        if t + 1 < n:
            lp = d.step(fmt, [(i, [int(ref[i])], len(prompts[i]) + t) for i in seqs])
    return torch.stack(picks, 1), torch.stack(ref_lp, 1)


def accuracy(args) -> dict:
    from transformers import AutoTokenizer

    texts = [f"{o} {t}" for o in _OPENERS for t in _TOPICS][: args.prompts]
    d = Driver(args.model, len(texts), 64 + args.tokens)
    tok = AutoTokenizer.from_pretrained(d.path, local_files_only=True)
    prompts = [tok.encode(t) for t in texts]
    ref, ref_lp = _run(d, "auto", prompts, args.tokens, None)
    forced = ref.tolist()
    out = {"model": d.path, "prompts": len(prompts), "tokens": args.tokens,
           "prompt_tokens_mean": statistics.mean(map(len, prompts))}
    for fmt in FORMATS[1:]:
        picks, lp = _run(d, fmt, prompts, args.tokens, forced)
        greedy, _ = _run(d, fmt, prompts, args.tokens, None)
        diverge = [next((t for t in range(args.tokens) if greedy[i, t] != ref[i, t]), args.tokens)
                   for i in range(len(prompts))]
        out[fmt] = {"agreement": float((picks == ref).float().mean()),
                    "mean_abs_dlogprob": float((lp - ref_lp).abs().mean()),
                    "max_abs_dlogprob": float((lp - ref_lp).abs().max()),
                    "first_divergence_mean": statistics.mean(diverge),
                    "first_divergence_median": statistics.median(diverge),
                    "first_divergence_min": min(diverge),
                    "identical_greedy": sum(x == args.tokens for x in diverge)}
        r = out[fmt]
        print(f"{fmt:9s} agreement {100 * r['agreement']:6.2f}%  mean |dlogprob| {r['mean_abs_dlogprob']:.4f} "
              f"(max {r['max_abs_dlogprob']:.3f})  greedy first divergence mean {r['first_divergence_mean']:.1f} "
              f"median {r['first_divergence_median']} min {r['first_divergence_min']}, "
              f"{r['identical_greedy']}/{len(prompts)} identical", flush=True)
    return out


def speed(args) -> dict:
    d = Driver(args.model, args.batch, args.context + 16)
    mc = d.worker.model_config
    gen = torch.Generator().manual_seed(0)
    n, heads = args.batch * args.context, mc.get_num_kv_heads(1)
    slots = torch.tensor([s for i in range(args.batch) for s in d._slots(i, range(args.context))])
    for layer in range(mc.num_hidden_layers):  # same random K/V (roughly unit scale) in every format
        k = torch.randn(n, heads, mc.head_dim, generator=gen)
        v = torch.randn(n, heads, mc.head_dim, generator=gen)
        for fmt in FORMATS:
            write_kv_cache(k, v, *d.caches[fmt][layer][:2], slots, "torch", *d.caches[fmt][layer][2:])
    rows = [(i, [100 + i], args.context) for i in range(args.batch)]  # rewrites slot `context` each step
    times = {fmt: [] for fmt in FORMATS}
    for fmt in FORMATS:
        d.step(fmt, rows, logits=False)  # warm-up
    for _ in range(args.rounds):
        for fmt in FORMATS:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                d.step(fmt, rows)
            times[fmt].append((time.perf_counter() - t0) / args.steps)
    out = {"model": d.path, "batch": args.batch, "context": args.context, "rounds": args.rounds,
           "steps_per_round": args.steps, "threads": torch.get_num_threads()}
    base = statistics.median(times["auto"])
    for fmt in FORMATS:
        med = statistics.median(times[fmt])
        out[fmt] = {"step_s_median": med, "tok_s": args.batch / med, "ratio_vs_auto": base / med,
                    "step_s_all": times[fmt]}
        print(f"{fmt:9s} step {1e3 * med:7.1f} ms median ({', '.join(f'{1e3 * t:.0f}' for t in times[fmt])})  "
              f"{args.batch / med:6.1f} tok/s  {base / med:.2f}x auto", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["accuracy", "speed"])
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=2, help="decode steps per format per round")
    args = ap.parse_args()
    print(json.dumps(accuracy(args) if args.what == "accuracy" else speed(args)))


if __name__ == "__main__":
    main()
