"""LoRA serving: output tok/s with 1, 8 and 32 adapters in a mixed workload against the base model alone (issue 58).

One run, the same requests in each part (fixed-length token-id prompts, ``ignore_eos``):

    offline     LLM.generate over the whole batch: the base model (LoRA off), then one engine
                with LoRA on serving the batch under 1, 8 and 32 adapters, round-robin
                (request i gets adapter i mod N); the LoRA-on engine's own base run too
    http c=8    ``pagedserve serve`` without LoRA, then with --enable-lora and every adapter in
                --lora-modules, the same requests at concurrency 8 (this project's load tester)
    cold TTFT   a request naming an adapter no request has used yet (its weights read from
                disk and put in a slot on the way), against the same adapter again and the
                base model, each with a prompt of its own that nothing before it used (no
                prefix-cache hit for any of the three); offline (engine metrics) and over
                HTTP (the client's first token)

Each adapter set runs once untimed first, so the timed run has every adapter in host memory
(--max-cpu-loras) and measures what serving N adapters costs in steady state: the slot
swaps when N > --max-loras, and the per-row adapter work. The adapters are random PEFT
directories built here: rank 16 on q_proj, k_proj, v_proj, o_proj (``--rank``,
``--targets``), lora_alpha 2r.

The model is the default one (SmolLM2-135M-Instruct, a Llama) or ``--model``; one whose
architecture takes no adapters here is replaced by a random Llama of the test shapes.

    python -m pagedserve.loadtest.offline.bench_lora                  # minutes on 2 cores
    python -m pagedserve.loadtest.offline.bench_lora --smoke          # seconds: checks it runs end to end
    python -m pagedserve.loadtest.offline.bench_lora --no-http --num-prompts 64 --output-len 128

The last line is one JSON object: ``{"offline": {"base_tok_s", "lora_on_base_tok_s",
"adapters": {"1": {"tok_s", "ratio"}, "8": ..., "32": ...}}, "http": {...the same...},
"cold_ttft": {"offline": {"cold_s", "warm_s", "base_s"}, "http": {...}}, "goal_8_adapters":
{"offline": bool, "http": bool}, ...}``; a ratio is tok/s over the base model's (LoRA off),
and the goal is issue 58's: at least 0.8 at 8 adapters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass

from pagedserve.loadtest.harness.runner import run_benchmark
from pagedserve.loadtest.harness.servers import pagedserve_server
from pagedserve.loadtest.peers.bench_vs_vllm import cpu_name
from pagedserve.loadtest.workloads import RequestSpec, fixed_length_prompts

GOAL_RATIO = 0.8  # issue 58: tok/s at 8 adapters over the base model's
LORA_ARCHS = ("llama", "mistral", "qwen2")  # what worker/lora adapts (worker/models/llama.py)
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def model_dir(model: str | None) -> tuple[str, str, dict]:
    """(what to pass as --model, its directory, its config.json): the default model, the
    given one, or a random Llama where the architecture takes no adapters."""
    from pagedserve.worker.loading.model_source import DEFAULT_MODEL_NAME, resolve_model

    given = model or DEFAULT_MODEL_NAME
    path = resolve_model(given).path
    cfg = json.load(open(os.path.join(path, "config.json")))
    if cfg.get("model_type") not in LORA_ARCHS:
        from pagedserve.worker.loading.random_models import make_test_model

        print(f"{given}: model_type {cfg.get('model_type')!r} takes no adapters here; a random Llama instead")
        path = make_test_model("llama-gqa2-hd64", os.path.join(tempfile.gettempdir(), "bench-lora-models"))
        given, cfg = path, json.load(open(os.path.join(path, "config.json")))
    return given, path, cfg


def make_adapter(cfg: dict, out: str, *, rank: int, targets: tuple[str, ...], seed: int) -> str:
    """A PEFT LoRA directory with random A and B for a model of config ``cfg``."""
    import torch
    from safetensors.torch import save_file

    from pagedserve.worker.lora.peft_adapter import module_shapes

    shapes = module_shapes(_ShapeView(cfg))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        for m in targets:
            fan_in, fan_out = shapes[m]
            block = "self_attn" if m in ATTN else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{m}"
            # Small enough that the model stays a model; the timing does not depend on it.
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
                   "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}, f)
    return out


class _ShapeView:
    """The fields module_shapes reads, from a config.json (no weights loaded)."""

    def __init__(self, cfg: dict) -> None:
        self.hidden_size = int(cfg["hidden_size"])
        self.num_attention_heads = int(cfg["num_attention_heads"])
        self.num_key_value_heads = int(cfg.get("num_key_value_heads") or self.num_attention_heads)
        self.head_dim = int(cfg.get("head_dim") or self.hidden_size // self.num_attention_heads)
        self.intermediate_size = int(cfg["intermediate_size"])


def ratios(base: float, runs: dict[int, float]) -> dict:
    return {str(n): {"tok_s": round(t, 2), "ratio": round(t / base, 3) if base else None} for n, t in runs.items()}


# ---------------------------------------------------------------- offline

def _tok_s(llm, prompts, params, loras) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def _ttft(llm, prompt, lora) -> float:
    from pagedserve import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False,
                       lora_request=lora)[0]
    return out.metrics.first_token_time - out.metrics.arrival_time


def offline(model: str, prompts, output_len: int, adapters: dict, counts, cold: tuple[str, str], engine: dict,
            lora_engine: dict, probes) -> tuple[dict, dict]:
    from pagedserve import LLM, LoRARequest, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm = LLM(model=model, **engine)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    base = _tok_s(llm, prompts, params, None)
    llm.shutdown()
    print(f"offline  base (LoRA off)   {base:8.1f} tok/s", flush=True)

    llm = LLM(model=model, enable_lora=True, **engine, **lora_engine)
    reqs = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())]
    llm.generate(prompts[:2], params, use_tqdm=False)
    lora_on_base = _tok_s(llm, prompts, params, None)
    print(f"offline  base (LoRA on)    {lora_on_base:8.1f} tok/s", flush=True)
    runs = {}
    for n in counts:
        loras = [reqs[i % n] for i in range(len(prompts))]
        warm = [prompts[i % len(prompts)] for i in range(n)]
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False,
                     lora_request=reqs[:n])  # every adapter read once, untimed
        runs[n] = _tok_s(llm, prompts, params, loras)
        print(f"offline  {n:2d} adapters        {runs[n]:8.1f} tok/s  ({runs[n] / base:.2f}x base)", flush=True)
    cold_req = LoRARequest(cold[0], len(reqs) + 1, cold[1])
    ttft = {"cold_s": _ttft(llm, probes[0], cold_req), "warm_s": _ttft(llm, probes[1], cold_req),
            "base_s": _ttft(llm, probes[2], None)}
    print("offline  TTFT  cold adapter {cold_s:.3f} s  same adapter again {warm_s:.3f} s  base {base_s:.3f} s"
          .format(**ttft), flush=True)
    llm.shutdown()
    return {"base_tok_s": round(base, 2), "lora_on_base_tok_s": round(lora_on_base, 2),
            "adapters": ratios(base, runs)}, {k: round(v, 4) for k, v in ttft.items()}


# ---------------------------------------------------------------- over HTTP

@dataclass
class LoRASpec(RequestSpec):
    """A request that names its model: an adapter, or None for the run's (the base model)."""

    model: str | None = None


def _specs(prompts, output_len: int, names: list[str | None], tag: str) -> list[LoRASpec]:
    return [LoRASpec(f"{tag}-{i}", p, len(p), output_len, model=names[i % len(names)])
            for i, p in enumerate(prompts)]


# The front may answer 429 while its requests wait to reach the replica (cluster/front/door.py,
# FrontLimit), as on a busy 2-core box; those are retried after Retry-After, as the openai
# SDK would, and counted in the row (retries_429).
MAX_RETRIES = 50


def _run(url: str, specs, concurrency: int, label: str) -> dict:
    res = asyncio.run(run_benchmark(url, specs, max_concurrency=concurrency, label=label, progress=False,
                                    max_retries=MAX_RETRIES))
    if res.metrics["failed"]:
        errors = {r.error for r in res.results if not r.success and r.error}
        raise RuntimeError(f"{label}: {res.metrics['failed']} requests failed: {sorted(errors)[:3]}")
    return res.metrics


def http(model: str, prompts, output_len: int, adapters: dict, counts, cold: tuple[str, str], concurrency: int,
         engine: dict, lora_engine: dict, log_dir: str, probes) -> tuple[dict, dict]:
    with pagedserve_server(model, log_dir=log_dir, **engine) as server:
        _run(server.base_url, _specs(prompts[:2], 2, [None], "warm"), concurrency, "warm-up")
        m = _run(server.base_url, _specs(prompts, output_len, [None], "base"), concurrency, "base")
    base, retries = m["output_throughput"], {"base": m["retries_429"]}
    print(f"http c={concurrency} base (LoRA off)   {base:8.1f} tok/s", flush=True)
    modules = [f"{name}={path}" for name, path in {**adapters, cold[0]: cold[1]}.items()]
    with pagedserve_server(model, log_dir=log_dir, enable_lora=True, lora_modules=modules, **engine,
                           **lora_engine) as server:
        url = server.base_url
        _run(url, _specs(prompts[:2], 2, [None], "warm"), concurrency, "warm-up")
        m = _run(url, _specs(prompts, output_len, [None], "lbase"), concurrency, "base")
        lora_on_base, retries["lora_on_base"] = m["output_throughput"], m["retries_429"]
        print(f"http c={concurrency} base (LoRA on)    {lora_on_base:8.1f} tok/s", flush=True)
        names = list(adapters)
        runs = {}
        for n in counts:
            warm = [prompts[i % len(prompts)] for i in range(n)]
            _run(url, _specs(warm, 2, names[:n], f"w{n}"), concurrency, f"warm {n}")  # each adapter read once
            m = _run(url, _specs(prompts, output_len, names[:n], f"a{n}"), concurrency, f"{n} adapters")
            runs[n], retries[str(n)] = m["output_throughput"], m["retries_429"]
            print(f"http c={concurrency} {n:2d} adapters        {runs[n]:8.1f} tok/s  ({runs[n] / base:.2f}x base)",
                  flush=True)
        def one(tag: str, name: str | None, prompt) -> float:  # one request alone: its TTFT, s
            return _run(url, _specs([prompt], 2, [name], tag), 1, tag)["mean_ttft_ms"] / 1e3

        ttft = {"cold_s": one("cold", cold[0], probes[0]), "warm_s": one("cold-again", cold[0], probes[1]),
                "base_s": one("tbase", None, probes[2])}
    print(f"http     TTFT  cold adapter {ttft['cold_s']:.3f} s  same adapter again {ttft['warm_s']:.3f} s  "
          f"base {ttft['base_s']:.3f} s", flush=True)
    return {"base_tok_s": round(base, 2), "lora_on_base_tok_s": round(lora_on_base, 2),
            "adapters": ratios(base, runs), "retries_429": retries}, {k: round(v, 4) for k, v in ttft.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    ap.add_argument("--adapters", default="1,8,32", help="adapter counts of the mixed workload")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8, help="HTTP requests in flight")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=",".join(ATTN))
    ap.add_argument("--max-loras", type=int, default=8, help="adapters in one step (the slots)")
    ap.add_argument("--max-cpu-loras", type=int, default=None, help="default: every adapter of the run")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a few short requests: checks the bench end to end")
    ap.add_argument("--log-dir", default="/tmp/loadtest-logs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len = 32, 16, 4
    counts = sorted({int(x) for x in args.adapters.split(",")})
    model, path, cfg = model_dir(args.model)
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    vocab = int(cfg["vocab_size"])
    prompts = fixed_length_prompts(args.num_prompts, args.input_len, vocab, seed=0)
    probes = fixed_length_prompts(3, args.input_len, vocab, seed=1)  # the cold-TTFT requests' own prompts
    root = tempfile.mkdtemp(prefix="bench-lora-")
    adapters = {f"lora-{i}": make_adapter(cfg, os.path.join(root, f"lora-{i}"), rank=args.rank, targets=targets,
                                          seed=i) for i in range(max(counts))}
    cold = ("cold", make_adapter(cfg, os.path.join(root, "cold"), rank=args.rank, targets=targets, seed=10_000))
    engine = dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    engine = {k: v for k, v in engine.items() if v is not None}
    lora_engine = dict(max_loras=args.max_loras, max_lora_rank=args.rank,
                       max_cpu_loras=args.max_cpu_loras or max(len(adapters) + 1, args.max_loras))
    out = {"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": model,
           "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
           "rank": args.rank, "targets": list(targets), **lora_engine, "smoke": args.smoke, "cold_ttft": {}}
    print(f"{model}: {args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} out; adapters "
          f"{counts}, rank {args.rank} on {', '.join(targets)}; max_loras {args.max_loras}", flush=True)
    if not args.no_offline:
        out["offline"], out["cold_ttft"]["offline"] = offline(model, prompts, args.output_len, adapters, counts,
                                                              cold, engine, lora_engine, probes)
    if not args.no_http:
        out["http"], out["cold_ttft"]["http"] = http(model, prompts, args.output_len, adapters, counts, cold,
                                                     args.concurrency, engine, lora_engine, args.log_dir, probes)
    eight = str(8)
    out["goal_8_adapters"] = {part: out[part]["adapters"][eight]["ratio"] >= GOAL_RATIO
                              for part in ("offline", "http") if part in out and eight in out[part]["adapters"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
