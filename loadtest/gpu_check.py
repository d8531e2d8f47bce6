"""The one prepared GPU check: kernels, then the engine end to end, in a single call.

    python -m pagedserve.loadtest.gpu_check --json latest.json [--budget-s 420] [--only S ..] [--skip S ..]
    python -m pagedserve.loadtest.gpu_check --cpu-smoke --image-packages-only   # the script itself, on a CPU

On this workplace's GPU machine (no network): first, here, ``bash loadtest/gpu_check_setup.sh
prepare`` (the wheels the GPU image lacks into .whl/; today none: the script says why), then
the device tool's ``run`` with ``timeout_s`` 480 and this command (no ``carry`` while .whl/ is
empty, ``carry: [".whl"]`` otherwise):

    set -o pipefail; . loadtest/gpu_check_setup.sh offline && cd /tmp && PYTHONUNBUFFERED=1 python3 -m pagedserve.loadtest.gpu_check --json $OUT/latest.json --budget-s 420 2>&1 | tee $OUT/gpu_check.log

(``cd /tmp``: run from the checkout, its folders would shadow installed names, HF's
``kernels`` among them), then copy ``latest.json`` from the reply's ``files_at`` to
docs/gpu/latest.json. The sections run in this order, the order of their value; each is
skipped, with a row saying so, when its estimate (an H100 guess, in ``sections()``) would
end it past ``--budget-s``, and the hard stop (``--hard-stop-s``, default budget + 30 s)
ends the one running then, so the table and the JSON (rewritten after every section) come
back inside the call. The estimates add up to ~410 s, the 8B section ~75 s of it:

 1-4. kernels (pagedserve.loadtest.kernel_checks.gpu_kernels): attention and cache-write correctness vs the
      torch reference; decode attention GB/s against a device-to-device copy at 64 x 2048
      and 8 x 16k (``decode_attention_bw_fraction``); the quantised KV formats likewise.
 5. exact: greedy tokens of the engine, with CUDA graphs and with ``enforce_eager``, equal
    transformers ``generate()`` on the same random ~0.85B Llama, both in float32. Why fp32:
    a bf16 run rounds every activation to 8 bits of mantissa, and the engine (Triton paged
    attention, its own fused layers, split-KV merges) and HF (SDPA, other GEMM shapes) round
    in different places; a greedy near-tie then flips a token and the rest of the sequence
    diverges, so bf16 token equality may legitimately fail. In fp32 (IEEE dots in the Triton
    kernel, TF32 off in torch) the two differ by ~1e-6, far below the random model's top-1
    margins (worker/loading/random_models.py), and equality is expected token for token.
 6. b1: batch-1 decode step time from CUDA events (around the worker's execute_model)
    against the HBM roofline: (weight bytes + KV bytes read per step) / the copy bandwidth,
    on the ~0.85B model in bf16.
 7. b1_8b: the same on an 8B-shaped random Llama in bf16 (hidden 4096, 32 layers, 32 heads,
    8 KV heads, intermediate 14336, vocab 128256): ~16 GB of weights drawn on the GPU and
    written with safetensors in shards, loaded by the engine, deleted after. The costliest
    section: the write (~16 GB through the page cache), the engine's load and a short run.
    ``b1_roofline_fraction`` of the JSON is this model's (else the small one's).
 8. throughput: decode tok/s at batch 1, 8, 64, 256 with CUDA graphs on and off
    (``enforce_eager``) x ``async_scheduling`` on and off, and greedy token agreement with
    the graphs + sync run (bf16: graphs and eager may split KV differently, see 10).
 9. memory_profile: an engine started without ``num_gpu_blocks_override``: the KV blocks and
    GiB it reports (its ``kv_sizing``, the worker's memory plan, the start-up log), then a
    batch at ``max_num_seqs`` with top-p and logprobs (the sampler's worst case): no OOM.
10. fp8_kv: ``kv_cache_dtype="fp8"`` end to end: tok/s and token agreement with the bf16 KV
    run of section 8.
11. long_context: a decode batch whose context makes the Triton kernel split the KV
    (``choose_num_splits``) replayed inside CUDA graphs: greedy tokens equal to eager, fp32
    (the graph bounds the context by max_model_len, so it splits differently from eager).
12. top_p: batch 256 with temperature 0.8, top_p 0.9, seeded: tok/s against greedy on the
    same engine, and the same tokens when run again.
13. ttft: prefill time to first token of a 2k- and an 8k-token prompt (default chunked
    prefill budget).
14. imports: that the single-GPU sections loaded no ray, zmq, xgrammar, pydantic, ...
15. tp2: TensorParallel 2 over NCCL, fp32 tokens equal to HF's (section 5), when two GPUs
    and ray are there; a row says why not otherwise (ray's wheel is over the carry limit).
16. hf_generate: transformers ``generate()`` tok/s at the same batches, as the ratio x HF.
17. spec_decode: prompt-lookup speculation on vs off at batch 1 and 8.
18. attention_sweep: the decode kernel's tile / warps / splits sweep (kernels).

vLLM does not run in this workplace (its wheel is far over the carry limit), so
``vllm_b1_tok_s`` and ``vllm_throughput_tok_s`` are null with a note. Every LLM(...) here
passes ``device`` explicitly ("cuda", or "cpu" for the smoke). ``--cpu-smoke`` runs every
section with tiny shapes on the CPU (Triton interpreter, the engine's torch path);
``--image-packages-only`` first makes every installed package outside the GPU image
(loadtest/gpu_image_packages.txt) and the carried wheels unimportable. It lives here, not
in kernels/, because it drives the whole engine and kernels/ imports tensors only.
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # must precede the first @triton.jit (kernel import)
    os.environ["TRITON_INTERPRET"] = "1"

_HERE = os.path.dirname(os.path.abspath(__file__))


def block_packages_outside_image() -> tuple[list[str], list[str]]:
    """Make every top-level module unimportable whose distribution the GPU image lacks and no
    carried wheel brings (``sys.modules[name] = None``: ``import`` raises ImportError and
    ``importlib.util.find_spec`` says absent). Allowed: the image's list, what those
    distributions require as installed here (another version's needs may differ), the wheels
    in .whl/, and pagedserve itself; pagedserve's own requirements the image lacks are blocked
    even where some allowed distribution here requires them. Returns (blocked, already
    imported before the block: a violation)."""
    import glob
    import importlib.metadata as md
    import re

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    def req_name(req: str) -> str | None:
        if "extra ==" in req.replace("extra==", "extra =="):
            return None
        m = re.match(r"[A-Za-z0-9][A-Za-z0-9_.-]*", req)
        return norm(m.group(0)) if m else None

    with open(os.path.join(_HERE, "gpu_image_packages.txt")) as f:
        image = {norm(s.strip()) for s in f if s.strip() and not s.startswith("#")}
    carried = {norm(os.path.basename(p).split("-")[0])
               for p in glob.glob(os.path.join(os.path.dirname(_HERE), ".whl", "*.whl"))}
    dists = {}
    for d in md.distributions():
        if d.metadata["Name"]:
            dists.setdefault(norm(d.metadata["Name"]), d)
    own = {n for r in (dists["pagedserve"].requires or []) if (n := req_name(r))} if "pagedserve" in dists else set()
    absent = own - image - carried
    allowed, todo = set(), [n for n in image | carried if n in dists]
    while todo:
        name = todo.pop()
        if name in allowed or name in absent:
            continue
        allowed.add(name)
        todo += [n for r in (dists[name].requires or []) if (n := req_name(r)) and n in dists]
    allowed |= image | carried | {"pagedserve"}
    blocked = sorted(top for top, names in md.packages_distributions().items()
                     if not top.startswith("_") and top not in sys.stdlib_module_names
                     and (not any(norm(n) in allowed for n in names) or any(norm(n) in absent for n in names)))
    loaded = [top for top in blocked if sys.modules.get(top) is not None]
    for top in blocked:
        sys.modules.setdefault(top, None)
    return blocked, loaded


_BLOCKED = block_packages_outside_image() if "--image-packages-only" in sys.argv else None

import atexit  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import torch  # noqa: E402

from pagedserve.loadtest.kernel_checks import gpu_kernels as kernel_check  # noqa: E402
from pagedserve.loadtest.kernel_checks.gpu_kernels import RESULTS, Section, row  # noqa: E402

# The ~0.85B random Llama of the engine sections (make_random_llama: fp32 on disk, run in
# fp32 or bf16) and the 8B-shaped one of b1_8b (bf16, drawn on the GPU); tiny in the smoke.
SMALL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=16384)
SMALL_SMOKE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                rms_norm_eps=1e-5)
LLAMA_8B_SMOKE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024, rope_theta=500000.0,
                      rms_norm_eps=1e-5)
PROMPT_LEN = 32
BATCHES = (1, 8, 64, 256)
# Packages the single-GPU path must not load: the image lacks them (gpu_check_setup.sh).
OPTIONAL_PACKAGES = ("ray", "zmq", "msgspec", "xgrammar", "pydantic", "fastapi", "uvicorn", "gguf")
VLLM_NOTE = ("vLLM does not run in this workplace: its wheel is far over the 64 MiB a device call carries "
             "and the GPU machine has no network; measure it where pip reaches PyPI.")


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


def _worker(llm):
    return llm.engine.executor.worker


class StepTimer:
    """CUDA events around the worker's execute_model, one pair per step (the step's time on
    the GPU's timeline: the host's preparation, launches or graph replay, sampling and the
    copy of the sampled ids back); wall clock on a CPU."""

    def __init__(self, ctx: Ctx, llm) -> None:
        from pagedserve.scheduler.outputs import ProbePlan

        self.ctx, self.worker, self.marks = ctx, _worker(llm), []
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


def weight_bytes_per_step(llm) -> tuple[int, int]:
    """(bytes a decode step reads of the weights, the parameter count). Every parameter is
    read once a step, except an untied embedding table, of which a step reads only its rows."""
    model = _worker(llm).runner.model
    params = dict(model.named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    tied = not any(n.startswith("lm_head") for n in params)
    embed = sum(p.numel() * p.element_size() for n, p in params.items() if "embed_tokens" in n)
    return total - (0 if tied else embed), sum(p.numel() for p in params.values())


def kv_bytes_per_token(cfg: dict, elem: int) -> int:
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * elem


# ---------------------------------------------------------------------------- sections
def check_exact(ctx: Ctx) -> None:
    """HF generate() vs the engine (graphs, then eager), greedy, fp32, 8 prompts."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = ctx.small()
    n, bsz = ctx.max_tokens if ctx.smoke else 64, 8
    prompts = ctx.prompts[:bsz]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(ctx.dev).eval()
    cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                           eos_token_id=hf.config.eos_token_id)
    with torch.no_grad():
        ids = torch.tensor(prompts, device=ctx.dev)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    ref = out[:, PROMPT_LEN:].tolist()
    del hf, out
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    ctx.hf_exact = ref
    res = RESULTS["exact"]
    res.update(dtype="float32", seqs=bsz, tokens_per_seq=n, ok=True)
    mml = PROMPT_LEN + n + 16
    for mode, eager in (("graphs", False), ("eager", True)):
        toks = run_engine(ctx, path, lambda llm: generate(ctx, llm, prompts, greedy(n, exact=True))[0],
                          dtype="float32", max_num_seqs=bsz, max_model_len=mml,
                          num_gpu_blocks_override=ctx.blocks(bsz, mml), enforce_eager=eager)
        agree = agreement(toks, ref)
        ok = agree["seqs_equal"] == bsz
        res[mode] = agree
        res["ok"] = res["ok"] and ok
        row("exact", f"engine ({mode}) vs HF generate(), fp32, {bsz} x {n} greedy",
            f"{agree['seqs_equal']}/{bsz} sequences equal {'PASS' if ok else 'FAIL'}"
            + ("" if ok else f" (mean prefix {agree['mean_prefix_match']:.2f})"))


def b1_roofline(ctx: Ctx, path: str, cfg: dict, section: str, label: str, max_tokens: int) -> float:
    """Batch-1 decode: median step time from CUDA events vs (weight + KV bytes) / copy GB/s."""
    copy = kernel_check.copy_gbs(ctx.dev, ctx.smoke)
    mml = PROMPT_LEN + max_tokens + 16
    prompt = [ctx.prompts[0][:PROMPT_LEN]]
    prompt = [[t % cfg["vocab_size"] for t in prompt[0]]]

    def run(llm):
        generate(ctx, llm, prompt, greedy(8))  # warm-up: compiles, first-call costs
        timer = StepTimer(ctx, llm)
        try:
            toks, wall, _ = generate(ctx, llm, prompt, greedy(max_tokens))
        finally:
            steps = timer.stop()
        return weight_bytes_per_step(llm), steps, wall, len(toks[0])

    (w_bytes, n_params), steps, wall, n = run_engine(
        ctx, path, run, dtype="bfloat16", max_num_seqs=1, max_model_len=mml,
        num_gpu_blocks_override=ctx.blocks(1, mml), enforce_eager=False)
    decode = steps[1:] or steps  # the first step is the prefill
    step_s = statistics.median(decode)
    kv = kv_bytes_per_token(cfg, 2) * (PROMPT_LEN + n / 2)  # the mean context of the decode steps
    bound_s = (w_bytes + kv) / (copy * 1e9)
    frac, wall_frac = bound_s / step_s, bound_s * n / wall
    RESULTS[section].update(model=label, params=n_params, weight_bytes_per_step=w_bytes, kv_bytes_per_step=kv,
                            copy_GBps=copy, decode_steps=len(decode), step_ms_median=step_s * 1e3,
                            step_ms_min=min(decode) * 1e3, roofline_ms=bound_s * 1e3, roofline_fraction=frac,
                            tok_s_wall=n / wall, roofline_fraction_wall=wall_frac)
    row(section, f"batch 1 step, {label} ({n_params / 1e9:.2f}B, bf16)",
        f"{step_s * 1e3:7.3f} ms (CUDA events, median of {len(decode)}) vs roofline {bound_s * 1e3:.3f} ms = "
        f"{100 * frac:5.1f}%; wall {n / wall:.1f} tok/s = {100 * wall_frac:5.1f}%")
    return frac


def check_b1(ctx: Ctx) -> None:
    frac = b1_roofline(ctx, ctx.small(), ctx.small_cfg, "b1", "random Llama ~0.85B", ctx.max_tokens)
    RESULTS.setdefault("b1_roofline_fraction_by_model", {})["llama_0.85b"] = frac
    if "b1_roofline_fraction" not in RESULTS:
        RESULTS.update(b1_roofline_fraction=frac, b1_roofline_model="llama_0.85b")


def write_random_llama_fast(path: str, cfg: dict, dev: torch.device) -> int:
    """An HF Llama checkpoint of random bf16 weights drawn on ``dev``, written with safetensors
    in shards (a thread writes one while the next is drawn), with config.json and a tokenizer.
    Weights ~N(0, 0.02), norms 1: finite activations through every layer, which is all a
    timing run needs (its tokens are not compared). Returns the bytes written."""
    from safetensors.torch import save_file

    from pagedserve.worker.loading.tokenizer_build import BOS_ID, EOS_ID, PAD_ID, save_tokenizer

    os.makedirs(path, exist_ok=True)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    layers, heads, kvh = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", torch_dtype="bfloat16",
                  tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, **cfg)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_tokenizer(path, v, model_max_length=cfg["max_position_embeddings"])

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        return {p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kvh * hd, h),
                p + "self_attn.v_proj.weight": (kvh * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
                p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,)}

    shards = [{"model.embed_tokens.weight": (v, h)}]
    for first in range(0, layers, 4):
        shards.append({k: s for i in range(first, min(first + 4, layers)) for k, s in layer(i).items()})
    shards.append({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    gen = torch.Generator(device=dev).manual_seed(0)
    weight_map, total, pending = {}, 0, []
    with ThreadPoolExecutor(2) as pool:
        for i, shapes in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for key, shape in shapes.items():
                if len(shape) == 1:
                    t = torch.ones(shape, dtype=torch.bfloat16, device=dev)
                else:
                    t = torch.randn(shape, generator=gen, dtype=torch.bfloat16, device=dev).mul_(0.02)
                tensors[key] = t.cpu()
                weight_map[key] = name
                total += t.numel() * 2
            pending.append(pool.submit(save_file, tensors, os.path.join(path, name), {"format": "pt"}))
            del tensors
            if len(pending) > 2:  # at most ~3 shards in host memory at once
                pending.pop(0).result()
        for p in pending:
            p.result()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def check_b1_8b(ctx: Ctx) -> None:
    cfg = LLAMA_8B_SMOKE if ctx.smoke else LLAMA_8B
    path = os.path.join(ctx.work, "llama8b")
    need = 2 * (cfg["vocab_size"] * cfg["hidden_size"] * 2 + cfg["num_hidden_layers"] * (
        4 * cfg["hidden_size"] ** 2 + 3 * cfg["hidden_size"] * cfg["intermediate_size"]))
    free = shutil.disk_usage(ctx.work).free
    if free < need * 1.2:
        row("b1_8b", "skipped", f"{free / 1e9:.1f} GB free in {ctx.work}, the checkpoint needs ~{need / 1e9:.1f} GB")
        RESULTS["b1_8b"]["skipped"] = "disk"
        return
    try:
        t = time.time()
        nbytes = write_random_llama_fast(path, cfg, ctx.dev)
        write_s = time.time() - t
        row("b1_8b", "8B-shaped random Llama written (bf16)" if not ctx.smoke else "8B-shaped (tiny) written",
            f"{nbytes / 1e9:.2f} GB in {write_s:.1f} s")
        RESULTS["b1_8b"].update(checkpoint_bytes=nbytes, write_s=write_s)
        frac = b1_roofline(ctx, path, cfg, "b1_8b", "8B-shaped Llama", 64 if not ctx.smoke else ctx.max_tokens)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    RESULTS.setdefault("b1_roofline_fraction_by_model", {})["llama_8b_shape"] = frac
    RESULTS.update(b1_roofline_fraction=frac, b1_roofline_model="llama_8b_shape")  # the 8B's, when it ran


def _throughput_run(ctx: Ctx, path: str, batches, n: int, **kw) -> tuple[dict, dict, list[int]]:
    """tok/s and tokens per batch on one engine (a short warm-up first), and its graph sizes."""
    mml = PROMPT_LEN + n + 16
    kw = dict(dtype="bfloat16", max_num_seqs=max(batches), max_model_len=mml,
              num_gpu_blocks_override=ctx.blocks(max(batches), mml), **kw)

    def run(llm):
        runner = _worker(llm).runner
        sizes = sorted(runner.graph_runner.graphs) if ctx.cuda else []
        generate(ctx, llm, ctx.prompts[:4], greedy(8))
        tps, toks = {}, {}
        for bsz in batches:
            toks[bsz], dt, _ = generate(ctx, llm, ctx.prompts[:bsz], greedy(n))
            tps[bsz] = sum(map(len, toks[bsz])) / dt
        return tps, toks, sizes

    return run_engine(ctx, path, run, **kw)


def check_throughput(ctx: Ctx) -> None:
    path, n, batches = ctx.small(), ctx.max_tokens, ctx.batches
    res = RESULTS["throughput"]
    res.update(model="random Llama ~0.85B, bf16", prompt_len=PROMPT_LEN, max_tokens=n)
    runs = {}
    for graphs in (True, False):
        for async_ in (False, True):
            key = f"{'graphs' if graphs else 'eager'} {'async' if async_ else 'sync'}"
            tps, toks, sizes = _throughput_run(ctx, path, batches, n, enforce_eager=not graphs,
                                               async_scheduling=async_)
            runs[key] = (tps, toks)
            if key == "graphs sync":
                ctx.baseline, ctx.baseline_tok_s = toks, tps
                res["graph_sizes"] = sizes
                row("throughput", "CUDA graphs captured", f"{len(sizes)} sizes {sizes[:4]}..{sizes[-1:]}"
                    if sizes else "none (not CUDA)")
    base = runs["graphs sync"][1]
    for bsz in batches:
        entry = {key: {"tok_s": tps[bsz], **agreement(toks[bsz], base[bsz])} for key, (tps, toks) in runs.items()}
        res[f"batch {bsz}"] = entry
        row("throughput", f"decode batch {bsz:>3} tok/s (graphs|eager x sync|async)",
            "  ".join(f"{k} {v['tok_s']:8.1f}" for k, v in entry.items())
            + "  equal to graphs sync " + "/".join(str(v["seqs_equal"]) for v in entry.values()) + f" of {bsz}")
    res["tok_s_graphs_sync_by_batch"] = {b: runs["graphs sync"][0][b] for b in batches}


class _LogTap(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if any(w in msg for w in ("KV cache", "GPU memory", "memory", "CUDA graphs")):
            self.lines.append(msg)


def check_memory_profile(ctx: Ctx) -> None:
    """No num_gpu_blocks_override: the engine sizes its KV cache (worker/worker.py's memory
    plan); what it reports, and a batch at max_num_seqs with top-p + logprobs runs."""
    from pagedserve import SamplingParams

    bsz, n = ctx.big_batch, ctx.max_tokens
    mml = 4096 if not ctx.smoke else 256
    tap, log = _LogTap(), logging.getLogger("pagedserve")
    old_level = log.level
    log.addHandler(tap)
    log.setLevel(logging.INFO)
    kw = dict(dtype="bfloat16", max_num_seqs=bsz, max_model_len=mml)
    if ctx.smoke:  # the CPU's KV budget is RAM (2 GiB by default): keep the smoke small
        kw["kv_cache_memory_bytes"] = 64 << 20

    def run(llm):
        info = dict(getattr(llm.engine, "kv_sizing", {}) or {})
        mp = _worker(llm).memory_plan  # worker/memory_plan.py: the CUDA profile's, None on the CPU
        plan = None if mp is None else {**dataclasses.asdict(mp), "kv_cache": mp.kv_cache, "text": mp.describe()}
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
        params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=n, ignore_eos=True, logprobs=5)
                  for i in range(bsz)]
        toks, dt, _ = generate(ctx, llm, ctx.prompts[:bsz], params)
        mem = {}
        if ctx.cuda:
            free, total = torch.cuda.mem_get_info()
            # After the run the allocator still holds its peak: used / total is what the
            # process took of the device, to set against gpu_memory_utilization (0.9).
            mem = dict(peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                       reserved_gib=torch.cuda.memory_reserved() / 2**30, free_gib=free / 2**30,
                       total_gib=total / 2**30, used_fraction=(total - free) / total)
        return info, plan, toks, dt, mem

    try:
        info, plan, toks, dt, mem = run_engine(ctx, ctx.small(), run, **kw)
    finally:
        log.removeHandler(tap)
        log.setLevel(old_level)
    ok = len(toks) == bsz and all(len(t) == n for t in toks)
    RESULTS["memory_profile"].update(kv_sizing=info, memory_plan=plan, log=tap.lines, batch=bsz, ok=ok,
                                     tok_s=sum(map(len, toks)) / dt, max_model_len=mml, **mem)
    row("memory_profile", "KV cache sized by the engine (no override)",
        f"{info.get('num_blocks', '?')} blocks = {info.get('kv_gib_per_rank', float('nan')):.2f} GiB, "
        f"{info.get('max_concurrency_at_max_model_len', float('nan')):.1f} seqs of {mml}")
    for line in tap.lines[-3:]:
        print(f"    log: {line}", flush=True)
    row("memory_profile", f"batch {bsz} (max_num_seqs), top-p + logprobs 5, {n} tok",
        f"{'no OOM, all finished PASS' if ok else 'FAIL'}"
        + (f"; peak {mem['peak_allocated_gib']:.1f} GiB allocated, {mem['free_gib']:.1f} GiB free of "
           f"{mem['total_gib']:.1f} (used {100 * mem['used_fraction']:.1f}% vs 90% asked)" if mem else ""))


def check_fp8_kv(ctx: Ctx) -> None:
    """kv_cache_dtype="fp8" (e4m3, one scale per token and head) end to end vs the bf16 KV run."""
    path, n = ctx.small(), ctx.max_tokens
    batches = ctx.batches if ctx.smoke else (1, 64, 256)
    if not ctx.baseline or not all(b in ctx.baseline for b in batches):
        tps, toks, _ = _throughput_run(ctx, path, batches, n, enforce_eager=False, async_scheduling=False)
        ctx.baseline.update(toks)
        ctx.baseline_tok_s.update(tps)
    tps, toks, _ = _throughput_run(ctx, path, batches, n, enforce_eager=False, async_scheduling=False,
                                   kv_cache_dtype="fp8")
    for bsz in batches:
        agree = agreement(toks[bsz], ctx.baseline[bsz])
        RESULTS["fp8_kv"][f"batch {bsz}"] = {"tok_s": tps[bsz], "bf16_kv_tok_s": ctx.baseline_tok_s[bsz],
                                             "speedup": tps[bsz] / ctx.baseline_tok_s[bsz], **agree}
        row("fp8_kv", f"batch {bsz:>3}, fp8 e4m3 KV vs bf16 KV (graphs, sync)",
            f"{tps[bsz]:9.1f} vs {ctx.baseline_tok_s[bsz]:9.1f} tok/s x{tps[bsz] / ctx.baseline_tok_s[bsz]:.2f}; "
            f"{agree['seqs_equal']}/{bsz} seqs equal, mean prefix {agree['mean_prefix_match']:.2f}")


def check_long_context(ctx: Ctx) -> None:
    """Graphs vs eager on a decode batch long enough that the kernel splits the KV, fp32."""
    from pagedserve.kernels.triton_paged_attention import choose_num_splits

    bsz, ctx_len = 4, (300 if ctx.smoke else 6000)
    n = ctx.max_tokens if ctx.smoke else 32
    mml = 512 if ctx.smoke else 8192
    kvh = ctx.small_cfg["num_key_value_heads"]
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(10, ctx.small_cfg["vocab_size"], (bsz, ctx_len), generator=gen).tolist()
    res = RESULTS["long_context"]
    out = {}
    for mode, eager in (("graphs", False), ("eager", True)):
        def run(llm):
            gr = _worker(llm).runner.graph_runner
            replays = [0]
            inner = gr.forward

            def counted(inputs, kv_caches):
                if getattr(inputs, "padded", False) and inputs.num_rows in gr.graphs:
                    replays[0] += 1
                return inner(inputs, kv_caches)

            gr.forward = counted
            try:
                toks, dt, _ = generate(ctx, llm, prompts, greedy(n, exact=True))
            finally:
                del gr.forward
            return toks, replays[0]

        out[mode] = run_engine(ctx, ctx.small(), run, dtype="float32", max_num_seqs=bsz, max_model_len=mml,
                               num_gpu_blocks_override=ctx.blocks(bsz, mml), enforce_eager=eager)
    splits_graph = choose_num_splits(bsz, kvh, mml, 64, ctx.dev)
    splits_eager = choose_num_splits(bsz, kvh, ctx_len + n, 64, ctx.dev)
    agree = agreement(out["graphs"][0], out["eager"][0])
    ok = agree["seqs_equal"] == bsz and (out["graphs"][1] > 0 or not ctx.cuda)
    res.update(batch=bsz, context=ctx_len, max_model_len=mml, tokens=n, dtype="float32",
               num_splits_graph=splits_graph, num_splits_eager=splits_eager, graph_replays=out["graphs"][1],
               ok=ok, **agree)
    row("long_context", f"{bsz} x {ctx_len} ctx, {n} tok, fp32: graphs vs eager",
        f"{agree['seqs_equal']}/{bsz} equal, {out['graphs'][1]} graph replays, splits {splits_graph} (graph) / "
        f"{splits_eager} (eager) {'PASS' if ok else 'FAIL'}")


def check_top_p(ctx: Ctx) -> None:
    from pagedserve import SamplingParams

    bsz, n = ctx.big_batch, ctx.max_tokens
    mml = PROMPT_LEN + n + 16
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1000 + i, max_tokens=n, ignore_eos=True)
              for i in range(bsz)]

    def run(llm):
        generate(ctx, llm, ctx.prompts[:4], greedy(8))
        g_toks, g_dt, _ = generate(ctx, llm, ctx.prompts[:bsz], greedy(n))
        p_toks, p_dt, _ = generate(ctx, llm, ctx.prompts[:bsz], params)
        again, _, _ = generate(ctx, llm, ctx.prompts[:bsz], params)
        return g_toks, g_dt, p_toks, p_dt, again

    g_toks, g_dt, p_toks, p_dt, again = run_engine(
        ctx, ctx.small(), run, dtype="bfloat16", max_num_seqs=bsz, max_model_len=mml,
        num_gpu_blocks_override=ctx.blocks(bsz, mml))
    g_tps, p_tps = sum(map(len, g_toks)) / g_dt, sum(map(len, p_toks)) / p_dt
    same = sum(a == b for a, b in zip(p_toks, again))
    differ = sum(a != b for a, b in zip(p_toks, g_toks))
    ok = same == bsz
    RESULTS["top_p"].update(batch=bsz, tok_s=p_tps, greedy_tok_s=g_tps, ratio=p_tps / g_tps, seeded_repeat_equal=same,
                            differ_from_greedy=differ, ok=ok, temperature=0.8, top_p=0.9)
    row("top_p", f"batch {bsz}, T 0.8, top_p 0.9, seeded vs greedy",
        f"{p_tps:9.1f} vs {g_tps:9.1f} tok/s x{p_tps / g_tps:.2f}; rerun equal {same}/{bsz} "
        f"{'PASS' if ok else 'FAIL'}; {differ}/{bsz} differ from greedy")


def check_ttft(ctx: Ctx) -> None:
    lens = (128, 400) if ctx.smoke else (2048, 8192)
    mml = max(lens) + 16
    gen = torch.Generator().manual_seed(4)
    vocab = ctx.small_cfg["vocab_size"]

    def prompt(k: int) -> list[int]:
        return torch.randint(10, vocab, (k,), generator=gen).tolist()

    def run(llm):
        for k in lens:  # warm-up: every prefill shape compiled, distinct prompts (no prefix-cache hits)
            generate(ctx, llm, [prompt(k)], greedy(1))
        got = {}
        for k in lens:
            times = []
            for _ in range(3):
                _, dt, outs = generate(ctx, llm, [prompt(k)], greedy(1))
                m = outs[0].metrics
                times.append(m.first_token_time - m.arrival_time if m and m.first_token_time else dt)
            got[k] = times
        return got, llm.engine.config.scheduler_config(mml).max_num_batched_tokens

    got, budget = run_engine(ctx, ctx.small(), run, dtype="bfloat16", max_num_seqs=8, max_model_len=mml,
                             num_gpu_blocks_override=ctx.blocks(2, mml))
    for k, times in got.items():
        med = statistics.median(times)
        RESULTS["ttft"][f"prompt {k}"] = {"ttft_ms_median": med * 1e3, "ttft_ms": [t * 1e3 for t in times],
                                          "chunks": math.ceil(k / budget), "max_num_batched_tokens": budget}
        row("ttft", f"prompt {k} tokens (bf16, chunks of {budget})", f"{med * 1e3:8.1f} ms to the first token "
            f"(median of {len(times)})")


def check_imports(ctx: Ctx) -> None:
    loaded = sorted(m for m in OPTIONAL_PACKAGES if sys.modules.get(m) is not None)
    ok = not loaded
    RESULTS["imports"].update(loaded_optional=loaded, ok=ok, image_packages_only=_BLOCKED is not None,
                              blocked=len(_BLOCKED[0]) if _BLOCKED else None)
    row("imports", "optional packages loaded by the TP=1 sections", ", ".join(loaded) or "none PASS")
    if _BLOCKED is not None:
        RESULTS["imports"]["loaded_before_block"] = _BLOCKED[1]
        RESULTS["imports"]["ok"] = ok and not _BLOCKED[1]
        row("imports", "packages outside the GPU image, made unimportable",
            f"{len(_BLOCKED[0])} ({', '.join(m for m in _BLOCKED[0] if m in OPTIONAL_PACKAGES)}, ...)"
            + (f"; already loaded: {_BLOCKED[1]} FAIL" if _BLOCKED[1] else ""))


def check_tp2(ctx: Ctx) -> None:
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    reason = None
    if gpus < 2:
        reason = f"{gpus} CUDA device(s): TP=2 needs two"
    elif importlib.util.find_spec("ray") is None:
        reason = "ray is not importable (its wheel is over the 64 MiB carry limit; gpu_check_setup.sh pypi --tp)"
    if reason:
        row("tp2", "skipped", reason)
        RESULTS["tp2"]["skipped"] = reason
        return
    bsz, n = 8, (ctx.max_tokens if ctx.smoke else 64)  # the exact section's prompts and length
    mml = PROMPT_LEN + n + 16
    prompts = ctx.prompts[:bsz]

    def run(llm):
        generate(ctx, llm, prompts[:1], greedy(8))
        toks, dt, _ = generate(ctx, llm, prompts, greedy(n, exact=True))
        _, dt1, _ = generate(ctx, llm, prompts[:1], greedy(n))
        return toks, bsz * n / dt, n / dt1

    toks, tps8, tps1 = run_engine(ctx, ctx.small(), run, dtype="float32", tensor_parallel_size=2, max_num_seqs=bsz,
                                  max_model_len=mml, num_gpu_blocks_override=ctx.blocks(bsz, mml))
    ref = ctx.hf_exact if ctx.hf_exact and len(ctx.hf_exact[0]) == n else None
    agree = agreement(toks, ref) if ref else None
    ok = agree is None or agree["seqs_equal"] == bsz
    RESULTS["tp2"].update(tok_s_batch8=tps8, tok_s_batch1=tps1, vs_hf=agree, ok=ok, dtype="float32")
    row("tp2", "TP=2 over NCCL, fp32", f"batch 8 {tps8:.1f} tok/s, batch 1 {tps1:.1f} tok/s; "
        + (f"{agree['seqs_equal']}/{bsz} equal HF {'PASS' if ok else 'FAIL'}" if agree else "no HF tokens to compare"))


def check_hf_generate(ctx: Ctx) -> None:
    from transformers import AutoModelForCausalLM

    path, n, batches = ctx.small(), ctx.max_tokens, ctx.batches
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(ctx.dev).eval()
    try:
        with torch.no_grad():
            hf.generate(torch.tensor(ctx.prompts[:1], device=ctx.dev), max_new_tokens=4, do_sample=False)
            for bsz in batches:
                ids = torch.tensor(ctx.prompts[:bsz], device=ctx.dev)
                ctx.sync()
                t = time.perf_counter()
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)
                ctx.sync()
                tps = bsz * n / (time.perf_counter() - t)
                ours = ctx.baseline_tok_s.get(bsz)
                RESULTS["hf_generate"][f"batch {bsz}"] = {"hf_tok_s": tps, "engine_tok_s": ours,
                                                          "engine_vs_hf": ours / tps if ours else None}
                row("hf_generate", f"batch {bsz:>3}, bf16, {n} tok", f"HF {tps:9.1f} tok/s"
                    + (f"; engine (graphs, sync) x{ours / tps:.2f}" if ours else ""))
    finally:
        del hf
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()


def check_spec(ctx: Ctx) -> None:
    """Prompt lookup (4 drafts) on vs off at batch 1 and 8, graphs on: prompts that repeat a
    block of 8 tokens (drafts match at once; a random model's greedy output loops too)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    n, batches = ctx.max_tokens, (1, 8)
    prompts = [p[:8] * 4 for p in ctx.prompts[:max(batches)]]
    mml = len(prompts[0]) + n + 16

    def tok_s(speculative_config):
        def run(llm):
            generate(ctx, llm, prompts[:4], greedy(8))
            out = {}
            for bsz in batches:
                toks, dt, _ = generate(ctx, llm, prompts[:bsz], greedy(n))
                out[bsz] = (sum(map(len, toks)) / dt, toks)
            return out, llm.engine.get_stats()

        return run_engine(ctx, ctx.small(), run, dtype="bfloat16", max_num_seqs=max(batches), max_model_len=mml,
                          num_gpu_blocks_override=ctx.blocks(max(batches), mml), speculative_config=speculative_config)

    off, _ = tok_s(None)
    on, st = tok_s(spec)
    rate = st.spec_num_accepted_tokens / max(st.spec_num_draft_tokens, 1)
    length = 1 + st.spec_num_accepted_tokens / max(st.spec_num_drafts, 1)
    for bsz in batches:
        same = sum(a == b for a, b in zip(off[bsz][1], on[bsz][1]))
        RESULTS["spec_decode"][f"batch {bsz}"] = {"spec_tok_s": on[bsz][0], "base_tok_s": off[bsz][0],
                                                  "speedup": on[bsz][0] / off[bsz][0], "seqs_equal": same,
                                                  "seqs": bsz, "acceptance_rate": rate,
                                                  "mean_acceptance_length": length}
        row("spec_decode", f"batch {bsz:>3} (ngram k=4)",
            f"on {on[bsz][0]:9.1f}  off {off[bsz][0]:9.1f} tok/s  x{on[bsz][0] / off[bsz][0]:.2f}  "
            f"acceptance {rate:.2f}  mean length {length:.2f}  tokens equal {same}/{bsz}")


def sections(args) -> list[Section]:
    """Every section in the order of its value, with its H100 estimate (seconds; a guess for
    the budget guard until a run's section_s replaces it). The first engine section also
    writes the ~0.85B checkpoint (HF's init on the CPU, ~3.4 GB in fp32)."""
    core, sweep = kernel_check.kernel_sections()
    ctx_box: list[Ctx] = []

    def with_ctx(fn):
        def call(dev, a):
            if not ctx_box:
                ctx_box.append(Ctx(dev, a))
                atexit.register(shutil.rmtree, ctx_box[0].work, True)  # the checkpoints, GBs
            fn(ctx_box[0])
        return call

    RESULTS.update(vllm_b1_tok_s=None, vllm_throughput_tok_s=None, vllm_note=VLLM_NOTE)
    e2e = [Section("exact", 40, with_ctx(check_exact)),
           Section("b1", 12, with_ctx(check_b1)),
           Section("b1_8b", 75, with_ctx(check_b1_8b)),
           Section("throughput", 50, with_ctx(check_throughput)),
           Section("memory_profile", 15, with_ctx(check_memory_profile)),
           Section("fp8_kv", 15, with_ctx(check_fp8_kv)),
           Section("long_context", 25, with_ctx(check_long_context)),
           Section("top_p", 12, with_ctx(check_top_p)),
           Section("ttft", 12, with_ctx(check_ttft)),
           Section("imports", 0, with_ctx(check_imports)),
           # Only with two GPUs does it start engines; else it is a row saying why.
           Section("tp2", 60 if not args.cpu_smoke and torch.cuda.device_count() >= 2 else 0, with_ctx(check_tp2)),
           Section("hf_generate", 20, with_ctx(check_hf_generate)),
           Section("spec_decode", 20, with_ctx(check_spec))]
    if args.skip_e2e:
        args.skip = list(args.skip) + [s.name for s in e2e]
    return core + e2e + [sweep]


def add_args(ap) -> None:
    ap.add_argument("--skip-e2e", action="store_true", help="the kernel sections only")
    ap.add_argument("--max-tokens", type=int, default=None, help="generated tokens per sequence (default 128)")
    ap.add_argument("--work-dir", default=None, help="where the random checkpoints are written (default: $TMPDIR)")
    ap.add_argument("--image-packages-only", action="store_true",
                    help="packages outside the GPU image unimportable (loadtest/gpu_image_packages.txt)")


def main() -> int:
    return kernel_check.main(sections=sections, add_args=add_args, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
