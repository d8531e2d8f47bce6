"""The measuring harness of the GPU check's engine sections: the random model shapes, Ctx
(the checkpoint, prompts and results the sections share), an engine built and freed around
one function (run_engine), timed generation, greedy parameters, token agreement, and
StepTimer (CUDA events around each worker step)."""

from __future__ import annotations

import gc
import os
import tempfile
import time

import torch

from pagedserve.loadtest.kernel_checks.gpu_kernels import row

# The ~0.85B random Llama of the engine sections (make_random_llama: fp32 on disk, run in
# fp32 or bf16; the 8B-shaped one of b1_8b is checks_roofline.py's); tiny in the smoke.
SMALL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=16384)
SMALL_SMOKE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
PROMPT_LEN = 32
BATCHES = (1, 8, 64, 256)


class Ctx:
    """What the engine sections share: the small checkpoint (written on first use), the
    prompts, and the results one section hands a later one."""

    def __init__(self, dev: torch.device, args) -> None:
        self.dev, self.args, self.smoke = dev, args, args.cpu_smoke
        self.cuda = dev.type == "cuda"
        self.work = tempfile.mkdtemp(prefix="gpu_check_", dir=args.work_dir)
        self.small_cfg = SMALL_SMOKE if self.smoke else SMALL
        self.max_tokens = args.max_tokens or (8 if self.smoke else 128)
        # The throughput batches and the one batch at max_num_seqs (top-p, memory profile);
        # the smoke checks the code paths, not batch 256.
        self.batches = (1, 8) if self.smoke else BATCHES
        self.big_batch = 16 if self.smoke else max(BATCHES)
        gen = torch.Generator().manual_seed(0)
        self.prompts = torch.randint(10, self.small_cfg["vocab_size"], (max(BATCHES), PROMPT_LEN),
                                     generator=gen).tolist()
        self._small: str | None = None
        self.baseline: dict[int, list[list[int]]] = {}  # batch -> bf16 greedy tokens (graphs, sync)
        self.baseline_tok_s: dict[int, float] = {}
        self.hf_exact: list[list[int]] | None = None  # HF fp32 greedy tokens of the exact section

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def small(self) -> str:
        if self._small is None:
            from pagedserve.worker.loading.random_models import make_random_llama

            t = time.time()
            self._small = make_random_llama(os.path.join(self.work, "small"), **self.small_cfg)
            size = sum(os.path.getsize(os.path.join(self._small, f)) for f in os.listdir(self._small))
            row("model", "random ~0.85B Llama written (fp32)" if not self.smoke else "random tiny Llama written",
                f"{size / 1e9:.2f} GB in {time.time() - t:.1f} s")
        return self._small

    def blocks(self, max_num_seqs: int, max_model_len: int) -> int:
        """A fixed KV pool that fits every sequence at max_model_len (no memory profile, so an
        engine whose memory is not yet returned cannot starve the next one's budget)."""
        return max_num_seqs * -(-max_model_len // 16) + 64


def run_engine(ctx: Ctx, path: str, fn, **kw):
    """``fn(llm)`` on an engine built here and shut down and freed before returning (so the
    next section's engine has the memory), whatever ``fn`` does."""
    from pagedserve import LLM

    kw.setdefault("device", ctx.dev.type)
    llm = LLM(model=path, **kw)
    try:
        return fn(llm)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()


def generate(ctx: Ctx, llm, prompts: list[list[int]], params) -> tuple[list[list[int]], float, list]:
    """(tokens of every sequence, wall seconds, the outputs)."""
    ctx.sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return [list(o.outputs[0].token_ids) for o in outs], dt, outs


def greedy(n: int, exact: bool = False):
    """n greedy tokens. ``exact``: EOS masked until n (min_tokens, as HF's min_new_tokens),
    so both sides pick the argmax of the same logits; else ignore_eos (the sampler's fast path)."""
    from pagedserve import SamplingParams

    if exact:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Sequences equal, and the mean fraction of each sequence before the first difference."""
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(n / max(len(x), len(y), 1))
    return {"seqs_equal": sum(x == y for x, y in zip(a, b)), "seqs": len(a),
            "mean_prefix_match": sum(prefix) / max(len(prefix), 1)}



def engine_worker(llm):
    return llm.engine.executor.worker


class StepTimer:
    """CUDA events around the worker's execute_model, one pair per step (the step's time on
    the GPU's timeline: the host's preparation, launches or graph replay, sampling and the
    copy of the sampled ids back); wall clock on a CPU."""

    def __init__(self, ctx: Ctx, llm) -> None:
        from pagedserve.scheduler.outputs import ProbePlan

        self.ctx, self.worker, self.marks = ctx, engine_worker(llm), []
        inner = self.worker.execute_model

        def timed(plan):
            if isinstance(plan, ProbePlan):
                return inner(plan)
            if ctx.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = inner(plan)
                b.record()
            else:
                a = time.perf_counter()
                out = inner(plan)
                b = time.perf_counter()
            self.marks.append((a, b))
            return out

        self.worker.execute_model = timed  # an instance attribute: the executor looks it up per step

    def stop(self) -> list[float]:
        """Seconds of every timed step, in order; the worker's own method back in place."""
        del self.worker.execute_model
        self.ctx.sync()
        if self.ctx.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in self.marks]
        return [b - a for a, b in self.marks]

