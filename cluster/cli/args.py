"""Engine flags shared by every CLI subcommand, spelled as ``vllm serve`` spells them."""

from __future__ import annotations

import argparse
import os

from pagedserve.scheduler.kv.kv_cache_dtype import KV_CACHE_DTYPES
from pagedserve.config import CPU_LINEAR_CHOICES, QUANTIZATION_CHOICES, EngineConfig
from pagedserve.cluster.text.reasoning import REASONING_PARSERS


def _memory(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', or a number of bytes."""
    t = text.strip().lower().replace("ib", "").replace("b", "")
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    if t and t[-1] in scale:
        return int(float(t[:-1]) * scale[t[-1]])
    return int(float(t))


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory, .gguf file (or a directory holding one), Hugging Face repo "
                        "id (org/name), object-store URI (s3://bucket/prefix, gs://bucket/prefix), or a "
                        "built-in name: SmolLM2-135M-Instruct (the default) or pagedserve-demo (random "
                        "weights). A repo id or URI is fetched onto each node that loads it")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit of a repo id --model (default: main; pinned to its commit)")
    g.add_argument("--download-dir", default=None,
                   help="where each node keeps a repo id or URI --model (default: the Hugging Face "
                        "cache, $HF_HUB_CACHE; $PAGEDSERVE_CACHE/object-store for a URI)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id /v1/models lists and requests name (default: --model as given)")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_CHOICES),
                   help="gguf: a GGUF's weights stay in their quantized blocks (the default for a .gguf; "
                        "CUDA: its Q4_0 / Q4_1 layers, the rest dequantized at load); awq, gptq, fp8 "
                        "(compressed-tensors, modelopt): the checkpoint's quantization_config, kept packed "
                        "(the default for such a checkpoint); none: dequantized to --dtype at load")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size)
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=d.enable_chunked_prefill)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument("--kv-cache-memory", dest="kv_cache_memory_bytes", type=_memory, default=None,
                   help="KV cache size on CPU, e.g. 2GiB")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                   help="auto: the model's dtype; fp8 (= fp8_e4m3), fp8_e5m2, int8: 1 byte per value plus "
                        "a 1-byte scale (the row's absmax) per (token, KV head)")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="most logprobs a request may ask for per token (default %(default)s; -1: the "
                        "whole vocabulary)")
    g.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="a reasoning model's thinking (<think> ... </think>) goes to the chat message's "
                        "reasoning field and the Responses API's reasoning item, not its content; "
                        "structured outputs and tool calls start where the thinking ends (vLLM's parsers)")
    g.add_argument("--scheduling-policy", default=d.scheduling_policy,
                   choices=["fcfs", "priority", "static"])
    g.add_argument("--kv-allocation", default=d.kv_allocation, choices=["paged", "contiguous"])
    g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"],
                   help="auto (default): cuda when the deployment's placement asks for GPUs, or the cluster "
                        "has GPU nodes (live, or node types its autoscaler may add), or this node has a GPU")
    g.add_argument("--accelerator-type", default=None,
                   help="the GPU model the TP workers need, e.g. H100, A100-80G, L4 (Ray's "
                        "accelerator_type:<name> resource, as Ray Serve LLM's accelerator_type)")
    g.add_argument("--placement-group-config", default=None, type=_json_object,
                   help='one engine replica\'s placement group as Ray Serve LLM writes it: \'{"bundles": '
                        '[{"GPU": 1, "CPU": 4}, ...], "strategy": "STRICT_PACK"}\' (one bundle per TP '
                        'worker) or \'{"bundle_per_worker": {...}}\'')
    g.add_argument("--attention-backend", default=d.attention_backend, choices=["auto", "torch", "triton"])
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: launch every decode step eagerly (as vLLM's flag)")
    g.add_argument("--max-waiting-requests", type=int, default=None)
    g.add_argument("--max-queue-delay-s", type=float, default=d.max_queue_delay_s,
                   help="429 when a request would wait longer than this to start, at the measured "
                        "drain rate (default %(default)s; 0 turns it off)")
    g.add_argument("--num-threads", type=int, default=None, help="CPU threads per worker")
    g.add_argument("--distributed-executor-backend", default=None, choices=["uni", "ray"],
                   help="workers in this process (uni; TP=1) or in Ray actors (ray); default: uni at "
                        "TP=1, else ray")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="plan step N+1 while step N runs (outputs one step later); default: on for a "
                        "worker bound to cores of its own, else off")
    g.add_argument("--cpu-omp-threads-bind", default=d.cpu_omp_threads_bind,
                   help="CPU cores per worker rank (vLLM's VLLM_CPU_OMP_THREADS_BIND): auto (serve: the "
                        "first core for the serving path, the rest for the model), nobind, or e.g. "
                        "'1-3|4-7' (one list per rank)")
    g.add_argument("--cpu-borrow-cores", default=d.cpu_borrow_cores,
                   help="CPU, GGUF weights: cores whose idle time the model's GEMMs may use, at the lowest "
                        "priority (SCHED_IDLE; the serving path preempts them at once): auto (with "
                        "--cpu-omp-threads-bind auto and a one-core model rank: the serving core), off, or a "
                        "core list such as '0'")
    g.add_argument("--cpu-linear", default=d.cpu_linear, choices=list(CPU_LINEAR_CHOICES),
                   help="CPU GEMM of the linear layers: auto (probe the backends on the model's weights at "
                        "load, keep the fastest), or panel, onednn, aten (that one, no probe)")
    g.add_argument("--cpu-int8-activations", default=d.cpu_int8_activations, action=argparse.BooleanOptionalAction,
                   help="GGUF weights on CPU: activations quantized to int8 per 32 values, as "
                        "llama.cpp computes them (faster; near ties of the next token may go the other way); "
                        "default off: fp32 activations, the dequantized model's tokens")
    g.add_argument("--speculative-config", default=None, type=_speculative_config,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (prompt lookup drafts)')
    pool = parser.add_argument_group("embeddings (vLLM's pooling runner)")
    pool.add_argument("--runner", default=d.runner, choices=["auto", "generate", "pooling"],
                      help="generate: text; pooling: embeddings (POST /v1/embeddings, each prompt's pooled "
                           "hidden state); auto (default): pooling for a sentence-transformers checkpoint "
                           "(modules.json) or a bare decoder's (e.g. Qwen3Model), else generate")
    pool.add_argument("--task", default=None, choices=["embed", "embedding", "generate"],
                      help="vLLM's older name for --runner: embed is --runner pooling")
    pool.add_argument("--pooler-config", default=None, type=_json_object,
                      help='how the pooling runner pools, over the checkpoint\'s sentence-transformers config: '
                           '\'{"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true|false}\' (default: '
                           'modules.json + 1_Pooling/config.json, else LAST with normalize)')
    lora = parser.add_argument_group("LoRA adapters (vLLM's flags)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT directories)")
    lora.add_argument("--lora-modules", nargs="+", default=None, type=_lora_module, metavar="NAME=PATH",
                      help='adapters served from the start: name=path, or JSON {"name": ..., "path": ..., '
                           '"base_model_name": ...}; a request names one as its model ("name" or "<base>:name")')
    lora.add_argument("--max-loras", type=int, default=d.max_loras,
                      help="the most distinct adapters in one step (slots in the worker; default %(default)s)")
    lora.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                      help="the largest rank an adapter may have (default %(default)s)")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept in host memory, least recently used out first (default: --max-loras)")
    lora.add_argument("--dynamic-lora-loading-path", default=None, metavar="DIR",
                      help="a folder of adapter folders: a request naming <name> not otherwise known loads "
                           "DIR/<name> on first use (Ray Serve LLM's dynamic_lora_loading_path)")
    t = parser.add_argument_group("tenants")
    t.add_argument("--tenant-weight", action="append", type=_tenant_weight, default=None,
                   metavar="NAME=W", help="fair-share weight of a tenant (default 1); repeatable")
    t.add_argument("--reserve", action="append", type=_reservation, default=None,
                   metavar="CLASS:blocks=N,seqs=M",
                   help="KV blocks and batch slots held for a tenant or priority:N; repeatable")
    t.add_argument("--isolate-tenant-prefix-cache", action=argparse.BooleanOptionalAction,
                   default=d.isolate_tenant_prefix_cache,
                   help="a prefix cache per tenant (default on: no cross-tenant timing channel)")
    t.add_argument("--preemption-protect-steps", type=int, default=d.preemption_protect_steps,
                   help="steps a resumed request is spared from preemption")
    return parser


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _lora_module(text: str):
    from pagedserve.scheduler.lora import parse_lora_modules

    try:
        return parse_lora_modules(text)[0]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _speculative_config(text: str):
    from pagedserve.scheduler.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _tenant_weight(text: str):
    from pagedserve.cluster.front.tenants import parse_tenant_weight

    try:
        return parse_tenant_weight(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _reservation(text: str):
    from pagedserve.cluster.front.tenants import parse_reservation

    try:
        return parse_reservation(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = EngineConfig.field_names()
    kw = {k: v for k, v in vars(args).items() if k in names}
    weights, reserve = getattr(args, "tenant_weight", None), getattr(args, "reserve", None)
    if weights:
        kw["tenant_weights"] = dict(weights)
    if reserve:
        if len({c for c, _ in reserve}) < len(reserve):
            raise SystemExit("error: --reserve names one class twice")
        kw["reservations"] = dict(reserve)
    try:
        return EngineConfig(**kw)
    except ValueError as e:  # flags that contradict each other: one line, as argparse's own errors
        raise SystemExit(f"error: {e}") from None


# A checkpoint directory's tokenizer, in any of the forms transformers' AutoTokenizer reads.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def resolve_model_or_exit(cfg: EngineConfig) -> EngineConfig:
    """Check ``--model`` before anything starts (Ray, workers) and fix what it resolves to,
    so a bad path or an unsupported checkpoint is one line on stderr and exit code 1.
    A GGUF file is prepared here, once (worker/loading/model_source.py). A repo id or a URI is
    checked from its config and tokenizer alone, fetched onto this node, and stays the
    source: every node that loads it fetches it itself (worker/loading/model_fetch.py), a repo id
    at the commit found here."""
    import dataclasses

    from pagedserve.worker.model_config import ModelConfig
    from pagedserve.worker.loading.loader import safetensors_files
    from pagedserve.worker.loading.model_source import resolve_model

    try:
        resolved = resolve_model(cfg.model, revision=cfg.revision, download_dir=cfg.download_dir,
                                 config_only=True)
        mc = ModelConfig.from_pretrained(resolved.path, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                                         device=cfg.device, quantization=cfg.quantization, runner=cfg.runner,
                                         pooler_config=cfg.pooler_config)
        if mc.runner == "pooling":
            cfg.check_pooling()
        if not resolved.remote and os.path.isdir(resolved.source):  # a checkpoint directory
            safetensors_files(resolved.path)  # no weights: the loader's own error, before anything starts
            if cfg.tokenizer is None and not any(os.path.isfile(os.path.join(resolved.path, f)) for f in TOKENIZER_FILES):
                raise FileNotFoundError(f"no tokenizer in {resolved.path!r} (none of {', '.join(TOKENIZER_FILES)}); "
                                        "add the model's tokenizer files, or name a directory holding them with --tokenizer.")
    except (OSError, ValueError) as e:
        what = "the default model" if cfg.model is None else f"--model {cfg.model!r}"
        raise SystemExit(f"error: {what}: {e}") from None
    # The engine loads the resolved directory (a local one; a remote source as itself);
    # /v1/models shows --model as given (vLLM's id and root), or the built-in default's
    # name when --model was omitted.
    given = cfg.model_root or cfg.model or resolved.served_model_name
    return dataclasses.replace(cfg, model=cfg.model if resolved.remote else resolved.path,
                               revision=resolved.revision or cfg.revision, model_root=given,
                               served_model_name=cfg.served_model_name or given)
