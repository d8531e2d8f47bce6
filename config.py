"""EngineConfig: the one typed object every entry point (LLM, CLI, Serve) builds.

Field names are vLLM's, so ``LLM(model=..., max_num_seqs=...)`` and
``pagedserve serve --max-num-seqs`` mean what a vLLM user expects.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pagedserve.scheduler.config import CacheConfig, Reservation, SchedulerConfig, SpeculativeConfig
from pagedserve.scheduler.kv.kv_cache_dtype import canonical_kv_cache_dtype
from pagedserve.scheduler.lora import parse_lora_modules

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# --cpu-linear: the probe, or one of kernels/cpu_linear.BACKENDS (this module imports no torch).
CPU_LINEAR_CHOICES = ("auto", "panel", "onednn", "aten")
# --quantization (worker/model_config.py resolves it; unset: implied by the checkpoint). vLLM's
# names: compressed-tensors and modelopt are fp8 checkpoints here (worker/loading/quant_config.py).
QUANTIZATION_CHOICES = ("gguf", "awq", "gptq", "fp8", "compressed-tensors", "modelopt", "none")


# vLLM's --runner (worker/model_config.RUNNERS, resolved against the checkpoint there) and
# its older --task names for them.
RUNNERS = ("auto", "generate", "pooling")
TASK_RUNNERS = {"embed": "pooling", "embedding": "pooling", "generate": "generate"}


def check_quantization(value: str | None) -> None:
    if value not in (None, *QUANTIZATION_CHOICES):
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)} (or unset: implied "
                         f"by the checkpoint), got {value!r}.")


@dataclass
class EngineConfig:
    model: str | None = None  # HF dir, .gguf, repo id, URI or a built-in name; None: SmolLM2-135M-Instruct (model_source.py)
    tokenizer: str | None = None  # defaults to ``model``
    revision: str | None = None  # a repo id's branch, tag or commit (vLLM's); pinned to the commit found
    download_dir: str | None = None  # where a repo id / URI is fetched on each node (worker/loading/model_fetch.py)
    served_model_name: str | None = None  # the id /v1/models lists; None: ``model`` as given
    # What /v1/models shows as ``root``: ``model`` as the user gave it. The CLI resolves
    # ``model`` to a directory before the engine starts, and keeps the given one here.
    model_root: str | None = None
    dtype: str = "auto"
    # vLLM's --quantization: "gguf" runs a GGUF's weights in their blocks (CPU,
    # kernels/cpu_gguf.py; CUDA: Q4_0 / Q4_1 on the Triton int4 GEMM); "awq", "gptq", "fp8"
    # run a checkpoint's quantization_config packed (kernels/quant/); "none" dequantizes them
    # to ``dtype`` at load; None: implied by the checkpoint (a GGUF runs natively, a
    # quantization_config as its method).
    # worker/model_config.resolve_quantization.
    quantization: str | None = None
    tensor_parallel_size: int = 1
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory for weights + activations + KV
    kv_cache_memory_bytes: int | None = None  # CPU: bytes of KV cache (default 2 GiB, capped by RAM)
    # "auto": the model's dtype; "fp8" (= "fp8_e4m3"), "fp8_e5m2", "int8": 1-byte values with one
    # 1-byte scale (a UE5M3 absmax code) per (token, KV head), counted in the budget
    # (scheduler/kv/kv_cache_dtype.py)
    kv_cache_dtype: str = "auto"
    seed: int = 0
    # The most logprobs a request may ask for per token (vLLM's --max-logprobs); -1: the
    # whole vocabulary. A request's -1 means the whole vocabulary too.
    max_logprobs: int = 20
    scheduling_policy: str = "fcfs"
    kv_allocation: str = "paged"
    # "auto" is decided once where the engine or app is built (platforms.py decide_device:
    # the deployment's placement, the cluster's live GPUs and autoscaler node types, else
    # this node's NVIDIA driver) and travels to every actor as "cuda" or "cpu".
    device: str = "auto"
    attention_backend: str = "auto"  # "auto": triton on CUDA, torch elsewhere
    # vLLM's name: no CUDA graphs, every decode step launched eagerly (worker/cuda_graphs.py).
    # Graphs are captured only on CUDA with the triton backend; this turns them off there.
    enforce_eager: bool = False
    max_waiting_requests: int | None = None
    # Serving: refuse (429) a request that would wait longer than this to start, at the
    # replica's measured drain rate (cluster/replica/admission.py). None or <= 0: off.
    max_queue_delay_s: float | None = 1.0
    num_threads: int | None = None  # CPU intra-op threads per worker (None: torch's default)
    watermark: float = 0.01
    # Tenants (scheduler/fair_queue.py, tenancy.py): fair-share weight per tenant (default
    # 1), {"tenant" or "priority:N": {"blocks": n, "seqs": m}} held back for that class, a
    # prefix cache of its own per tenant, and hysteresis for resumed requests (in steps).
    tenant_weights: dict[str, float] | None = None
    reservations: dict[str, dict[str, int]] | None = None
    isolate_tenant_prefix_cache: bool = True
    preemption_protect_steps: int = 32
    # Plan step N+1 while step N runs (vLLM's --async-scheduling); outputs then come one
    # step later. Off: every step is planned after the previous one's result. None: off,
    # except for a worker bound to cores of its own (cpu_omp_threads_bind), where it is on.
    async_scheduling: bool | None = None
    # Where the workers run (vLLM's --distributed-executor-backend): "uni", in this process
    # (tensor_parallel_size 1 only); "ray", worker actors, one per rank (a TP=1 worker in an
    # actor of its own steps outside the serving process's GIL). None: "uni" at TP=1, else "ray".
    distributed_executor_backend: str | None = None
    # CPU: the cores each rank computes on (vLLM's VLLM_CPU_OMP_THREADS_BIND): "auto",
    # "nobind" or one core list per rank, e.g. "1-3|4-7" (worker/cpu_affinity.py).
    cpu_omp_threads_bind: str = "auto"
    # CPU: cores whose idle time the model's GGUF GEMMs may use, one helper thread each at
    # SCHED_IDLE (kernels/cpu_borrowed_cores.h): "auto" (with the CPU split of a one-core
    # rank: the serving cores), "off", or a core list (what "auto" resolves to).
    cpu_borrow_cores: str = "auto"
    # CPU: the GEMM of the linear layers (worker/layers/cpu_backend.py): "auto" probes the
    # backends that run here on the model's weights at load and keeps the fastest; "panel",
    # "onednn" or "aten" takes that one, no probe.
    cpu_linear: str = "auto"
    # CPU: GGUF weights multiply activations quantized to int8 per 32 (llama.cpp's
    # arithmetic, kernels/cpu_gguf.cpp: faster, and near ties
    # of the next token may go the other way); False: fp32 activations, the dequantized
    # model's results to rounding.
    cpu_int8_activations: bool = False
    # vLLM's --speculative-config: prompt lookup drafts verified in one pass, e.g.
    # {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
    # "prompt_lookup_min": 2}; JSON text, a dict or a SpeculativeConfig. None: off.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # vLLM's --reasoning-parser: "deepseek_r1" or "qwen3" (cluster/text/reasoning.py). A chat
    # answer's thinking goes to the message's ``reasoning`` (and the Responses API's reasoning
    # item), and its structured outputs / tool-call grammar start where the thinking ends.
    # None: the text is all content.
    reasoning_parser: str | None = None
    # Where the TP workers go, as Ray Serve LLM's LLMConfig says it: the accelerator they
    # need (e.g. "H100", "L4": Ray's accelerator_type:<name> resource on each worker's
    # bundle) and the placement group, {"bundles": [one per TP worker], "strategy": ...} or
    # {"bundle_per_worker": {...}, "strategy": ...} (cluster/placement.py). None: one
    # {"GPU": 1, "CPU": 1} bundle per worker on CUDA ({"CPU": 1} on the CPU).
    accelerator_type: str | None = None
    placement_group_config: dict | None = None
    # LoRA adapters (vLLM's flags; worker/lora, scheduler/lora.py): off unless enable_lora.
    # lora_modules: the adapters served from the start, each "name=path" or {"name", "path",
    # "base_model_name"} (text, a dict or a LoRAModulePath); max_loras: the most distinct
    # adapters in one step (the worker's slots); max_lora_rank: the largest r an adapter may
    # have (the slots' size); max_cpu_loras: adapters kept in host memory (None: max_loras).
    # dynamic_lora_loading_path (Ray Serve LLM's name): a folder whose sub-folder <name> is
    # the adapter a request names as <name> (or <base>:<name>), loaded on its first use.
    enable_lora: bool = False
    lora_modules: list | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    dynamic_lora_loading_path: str | None = None
    # vLLM's --runner: "generate" samples tokens; "pooling" serves embeddings (each prompt's
    # pooled hidden state: /v1/embeddings, worker/pooler.py); "auto": pooling for a
    # sentence-transformers checkpoint (modules.json) or a bare decoder's (Qwen3Model), else
    # generate. task: vLLM's older --task, "embed" (= runner pooling) or "generate".
    # pooler_config: vLLM's --pooler-config over the checkpoint's own, {"pooling_type":
    # "LAST" | "MEAN" | "CLS", "normalize": bool} (JSON text or a dict).
    runner: str = "auto"
    task: str | None = None
    pooler_config: dict | str | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        from pagedserve.cluster.text.reasoning import check_reasoning_parser

        check_reasoning_parser(self.reasoning_parser)
        self._check_runner()
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}.")
        canonical_kv_cache_dtype(self.kv_cache_dtype)  # ValueError naming the choices
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the whole vocabulary) or >= 0, got {self.max_logprobs}.")
        if self.distributed_executor_backend not in (None, "uni", "ray"):
            raise ValueError("distributed_executor_backend must be 'uni' or 'ray', got "
                             f"{self.distributed_executor_backend!r}.")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend 'uni' runs tensor_parallel_size 1 only; use 'ray'.")
        from pagedserve.worker.cpu_affinity import parse_bind

        parse_bind(self.cpu_omp_threads_bind, self.tensor_parallel_size)  # raises if malformed
        if self.cpu_borrow_cores not in ("auto", "off"):
            from pagedserve.worker.cpu_affinity import parse_core_list

            parse_core_list(self.cpu_borrow_cores)  # raises if malformed
        check_quantization(self.quantization)
        if self.cpu_linear not in CPU_LINEAR_CHOICES:
            raise ValueError(f"cpu_linear must be one of {', '.join(CPU_LINEAR_CHOICES)}, got {self.cpu_linear!r}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}.")
        from pagedserve.platforms import check_placement_group_config, decide_device, placement_asks_gpus

        check_placement_group_config(self.placement_group_config, self.tensor_parallel_size)
        self._check_lora()
        if self.device == "cpu":  # refuses a GPU placement on the CPU
            decide_device("cpu", placement_asks_gpus=placement_asks_gpus(self.placement_group_config,
                                                                         self.accelerator_type))

    def _check_runner(self) -> None:
        import json

        if self.task is not None:
            runner = TASK_RUNNERS.get(self.task)
            if runner is None:
                raise ValueError(f"task must be one of {', '.join(TASK_RUNNERS)} (vLLM's older name for --runner: "
                                 f"embed is --runner pooling), got {self.task!r}.")
            if self.runner not in ("auto", runner):
                raise ValueError(f"task {self.task!r} means runner {runner!r}, but runner is {self.runner!r}.")
            self.runner, self.task = runner, None
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}.")
        if isinstance(self.pooler_config, str):
            try:
                self.pooler_config = json.loads(self.pooler_config)
            except ValueError as e:
                raise ValueError(f"pooler_config is not JSON: {e}") from None
        if self.pooler_config is not None and not isinstance(self.pooler_config, dict):
            raise ValueError(f"pooler_config must be a JSON object, got {self.pooler_config!r}.")
        if self.pooler_config and self.runner == "generate":
            raise ValueError("pooler_config applies to runner pooling (--runner pooling) only.")
        if self.runner == "pooling":
            self.check_pooling()

    def check_pooling(self) -> None:
        """What the pooling runner does not combine with (the engine asks again once
        runner "auto" is resolved)."""
        if self.enable_lora:
            raise ValueError("LoRA adapters (enable_lora) are not supported with the pooling runner (embeddings).")
        if self.speculative_config is not None:
            raise ValueError("speculative decoding has nothing to draft with the pooling runner (embeddings).")

    def _check_lora(self) -> None:
        self.lora_modules = parse_lora_modules(self.lora_modules) or None
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules need enable_lora (--enable-lora).")
        if self.dynamic_lora_loading_path and not self.enable_lora:
            raise ValueError("dynamic_lora_loading_path needs enable_lora (--enable-lora).")
        if not self.enable_lora:
            return
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}.")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")

    def executor_backend(self) -> str:
        return self.distributed_executor_backend or ("uni" if self.tensor_parallel_size == 1 else "ray")

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not self.enable_chunked_prefill:
                budget = max(budget, max_model_len)
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            scheduling_policy=self.scheduling_policy,
            max_waiting_requests=self.max_waiting_requests,
            tenant_weights=dict(self.tenant_weights or {}),
            reservations={k: Reservation(**v) for k, v in (self.reservations or {}).items()},
            isolate_tenant_prefix_cache=self.isolate_tenant_prefix_cache,
            preemption_protect_steps=self.preemption_protect_steps,
            speculative_config=self.speculative_config,
            max_loras=self.max_loras if self.enable_lora else None,
        )

    def cache_config(self, num_blocks: int) -> CacheConfig:
        return CacheConfig(
            num_blocks=num_blocks,
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching and self.kv_allocation == "paged",
            kv_allocation=self.kv_allocation,
            watermark=self.watermark,
        )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
