"""Worker: one per tensor-parallel rank. Owns a weight shard, a KV-cache shard and a
ModelRunner; executes the plans it is sent. No ray in here: cluster/ wraps it in an
actor (or runs it in-process at tensor_parallel_size 1).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import torch

from pagedserve.kernels import kv_cache_torch_dtype
from pagedserve.kernels.kv_quant import check_fp8_device
from pagedserve.scheduler.kv.kv_cache_dtype import canonical_kv_cache_dtype, kv_cache_bytes_per_token
from pagedserve.scheduler.outputs import ModelRunnerOutput, ProbePlan, SchedulerOutput
from pagedserve.worker import parallel_state
from pagedserve.config import EngineConfig
from pagedserve.platforms import CUDA_INSTALL_HINT, cuda_unusable_reason
from pagedserve.worker.cpu_affinity import format_core_list, parse_bind, parse_core_list, pin_this_process
from pagedserve.worker.loading.loader import load_model
from pagedserve.worker.memory_plan import MemoryPlan, profile_shapes
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.loading.model_fetch import local_model_path
from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# CPU KV budget when neither kv_cache_memory_bytes nor num_gpu_blocks_override is given
# (vLLM's CPU backend defaults to 4 GiB as well); capped to a quarter of free RAM.
DEFAULT_CPU_KV_BYTES = 4 << 30
# Blocks of the cache the memory profile captures CUDA graphs on (their pool's size does
# not depend on it).
PROFILE_CACHE_BLOCKS = 16


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 << 30


class Worker:
    def __init__(self, engine_config: EngineConfig, rank: int = 0, world_size: int = 1,
                 distributed_init_method: str | None = None) -> None:
        if engine_config.model is None:
            raise ValueError("Worker needs a resolved model directory (engine_config.model).")
        self.config = engine_config
        self.model_path = engine_config.model
        self.rank = rank
        self.world_size = world_size
        self.distributed_init_method = distributed_init_method
        if engine_config.device not in ("cpu", "cuda"):
            raise ValueError(f"a Worker needs a decided device, got {engine_config.device!r}: the engine or "
                             "app decides it where it is built (platforms.py), never a worker.")
        self.device = torch.device(engine_config.device)
        # Who this worker is, for its start-up errors (the Ray wrapper says rank, node, GPUs).
        self.where = f"the worker in process {os.getpid()} on {socket.gethostname()}"
        self.memory_plan: MemoryPlan | None = None
        self.model_config: ModelConfig | None = None
        self.runner: ModelRunner | None = None

    def init_device(self) -> None:
        threads = self.config.num_threads
        bound = parse_bind(self.config.cpu_omp_threads_bind, self.world_size)
        if bound is not None and self.device.type == "cpu":
            cores = bound[self.rank]
            pin_this_process(cores)  # before the OpenMP pool starts: its threads inherit
            threads = threads or len(cores)
            logger.info("rank %d bound to cores %s, %d threads", self.rank, format_core_list(cores), threads)
        if threads:
            torch.set_num_threads(threads)
        if self.device.type == "cpu":
            from pagedserve.worker.cpu_memory import tune_malloc

            tune_malloc()
        if self.device.type == "cuda":
            reason = cuda_unusable_reason()
            if reason is not None:  # never a silent CPU fallback
                where = self.where
                if "CUDA_VISIBLE_DEVICES" not in where:
                    where += f" (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})"
                raise RuntimeError(f"{where}: device 'cuda' was decided for this deployment, but "
                                   f"{reason}. Fix: {CUDA_INSTALL_HINT}.")
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if local >= torch.cuda.device_count():
                raise RuntimeError(f"{self.where}: local rank {local} but only {torch.cuda.device_count()} "
                                   f"GPUs are visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}).")
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        if self.world_size > 1:
            if not self.distributed_init_method:
                raise ValueError("tensor_parallel_size > 1 needs a distributed_init_method.")
            parallel_state.init_tensor_parallel(self.rank, self.world_size,
                                                self.distributed_init_method)
        torch.manual_seed(self.config.seed)

    def _borrow_cores(self) -> None:
        """GGUF GEMMs also on the cores ``cpu_borrow_cores`` names (a resolved list; "auto"
        that reached a worker unresolved, with no CPU split, is off), at SCHED_IDLE."""
        borrow = self.config.cpu_borrow_cores
        if self.device.type != "cpu" or borrow in ("auto", "off") or self.model_config.quantization != "gguf":
            return
        from pagedserve.kernels import cpu_gguf

        cores = parse_core_list(borrow)
        if cpu_gguf.borrow_cores(cores):
            logger.info("rank %d: GGUF GEMMs also on core %s at SCHED_IDLE, in the time it leaves idle",
                        self.rank, borrow)

    def load_model(self) -> None:
        builds = []
        if self.device.type == "cpu" and os.environ.get("PAGEDSERVE_CPU_EXT", "1") != "0":
            # Build (first time on a machine kind, slow) or load the C++ kernels now, while the
            # engine starts, not inside the first request's forward pass: side by side (each
            # build is its own compiler process) and beside the weight load.
            from pagedserve.kernels import cpu_decode_attention, cpu_fused, cpu_gemm, cpu_gguf

            builds = [threading.Thread(target=ready, name="cpu-ext-build", daemon=True)
                      for ready in (cpu_gemm.available, cpu_decode_attention.available, cpu_fused.available,
                                    cpu_gguf.available)]
            for t in builds:
                t.start()
        # A repo id or URI arrives as itself: this node gets its files first (once per node).
        self.model_path = local_model_path(self.config.model, self.config.revision, self.config.download_dir)
        self.model_config = ModelConfig.from_pretrained(
            self.model_path, dtype=self.config.dtype, max_model_len=self.config.max_model_len,
            device=self.device.type, quantization=self.config.quantization, runner=self.config.runner,
            pooler_config=self.config.pooler_config)
        if builds and self.model_config.moe_layers:  # the experts' kernel (kernels/moe/cpu_experts.py)
            from pagedserve.kernels.moe import cpu_experts

            builds.append(threading.Thread(target=cpu_experts.available, name="cpu-ext-build", daemon=True))
            builds[-1].start()
        if self.model_config.quantization == "gguf" and self.device.type == "cpu":
            from pagedserve.kernels import cpu_gguf

            if not cpu_gguf.available():  # waits for its build; the failure was logged
                logger.warning("%s: the GGUF kernel is unavailable, so the GGUF's weights are dequantized to "
                               "%s at load (as --quantization none).", self.where, self.model_config.dtype)
                self.model_config.quantization = None
        if self.model_config.dtype == torch.bfloat16 and self.device.type == "cuda" \
                and not torch.cuda.is_bf16_supported():
            raise RuntimeError(f"{self.where}: {torch.cuda.get_device_name(self.device)} has no bfloat16; pass "
                               "--dtype float16 (dtype auto runs a float32 or GGUF checkpoint in bfloat16 on CUDA).")
        backend = self.config.attention_backend
        if backend == "auto":
            from pagedserve.kernels import resolve_attention_backend

            backend = resolve_attention_backend("auto", self.device)
        model = load_model(self.model_config, self.device, attention_backend=backend)
        for t in builds:
            t.join()  # before the linear probe, which must not time a machine busy compiling
        self._borrow_cores()
        if self.device.type == "cpu":
            from pagedserve.worker.layers.cpu_backend import apply_cpu_linear_backend, set_int8_activations

            self.cpu_linear_backend = apply_cpu_linear_backend(model, self.config.cpu_linear)
            set_int8_activations(model, self.config.cpu_int8_activations)
        budget = self.config.scheduler_config(self.model_config.max_model_len).max_num_batched_tokens
        spec = self.config.speculative_config
        lora = None
        if self.config.enable_lora:  # its slot pool now, before the memory profile counts the weights
            from pagedserve.worker.lora.manager import LoRAManager

            lora = LoRAManager(self.model_config, max_loras=self.config.max_loras,
                               max_lora_rank=self.config.max_lora_rank, max_cpu_loras=self.config.max_cpu_loras,
                               device=self.device)
        # A hybrid KV cache's groups of layers (scheduler/kv/kv_groups.py), as the scheduler's.
        self.kv_groups = self.model_config.kv_cache_groups(self.config.kv_allocation)
        self.runner = ModelRunner(model, self.model_config, block_size=self.config.block_size,
                                  device=self.device, seed=self.config.seed, max_num_seqs=self.config.max_num_seqs,
                                  max_num_batched_tokens=budget, enforce_eager=self.config.enforce_eager,
                                  num_speculative_tokens=spec.num_speculative_tokens if spec else 0, lora=lora,
                                  kv_groups=self.kv_groups)

    # ---------------------------------------------------------------- KV sizing
    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """Storage dtype of the values: the model's ("auto") or a 1-byte quantised format."""
        return kv_cache_torch_dtype(canonical_kv_cache_dtype(self.config.kv_cache_dtype), self.model_config.dtype)

    def kv_bytes_per_block(self) -> int:
        """This rank's bytes per block, scales included (what the budget is divided by)."""
        mc = self.model_config
        # A hybrid cache's block holds one group's layers (group_size), not every layer's.
        groups = mc.kv_cache_groups(self.config.kv_allocation)
        layers = mc.num_hidden_layers if groups is None else groups.group_size
        per_token = kv_cache_bytes_per_token(layers, mc.get_num_kv_heads(self.world_size),
                                             mc.head_dim, self.config.kv_cache_dtype, mc.dtype.itemsize)
        return per_token * self.config.block_size

    def determine_num_available_blocks(self) -> int:
        """Blocks this rank can hold. The engine takes the minimum over ranks."""
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cuda":
            return self._profile_cuda_blocks(per_block)
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            budget = min(DEFAULT_CPU_KV_BYTES, _available_ram_bytes() // 4)
        return max(1, budget // per_block)

    def _profile_cuda_blocks(self, per_block: int) -> int:
        """Measure each share of the GPU a step needs (worker/memory_plan.py) and give
        the rest of ``gpu_memory_utilization`` to KV blocks."""
        cuda, runner, mc = torch.cuda, self.runner, self.model_config
        shapes = profile_shapes(self.config, mc.max_model_len, graphs=runner.graph_runner.use_graphs,
                                max_capture_size=max(runner.graph_runner.sizes))
        cuda.synchronize()
        cuda.empty_cache()
        weights = cuda.memory_allocated()  # the model and the persistent step buffers

        def peak(run) -> int:
            cuda.reset_peak_memory_stats()
            run()
            cuda.synchronize()
            used = cuda.max_memory_allocated() - weights
            cuda.empty_cache()
            return max(used, 0)

        activations = peak(lambda: runner.profile_forward(shapes.num_tokens, shapes.num_sample_rows, shapes.logprobs))
        sampler = peak(lambda: runner.profile_sampler(shapes.num_sample_rows, shapes.logprobs))
        graphs = 0
        if shapes.graph_max_rows:
            # A small cache is enough to capture on: the pool holds the graphs' activations,
            # whatever the cache's size. Warm-up runs' memory goes back before measuring.
            runner.allocate_cache(PROFILE_CACHE_BLOCKS, mc.get_num_kv_heads(self.world_size), self.kv_cache_dtype)
            cuda.synchronize()
            before = cuda.memory_reserved()
            runner.graph_runner.capture(runner.kv_caches)
            cuda.synchronize()
            cuda.empty_cache()
            graphs = max(cuda.memory_reserved() - before, 0)
            runner.release_cache()
            cuda.empty_cache()
        free, total = cuda.mem_get_info()
        plan = MemoryPlan(total=total, gpu_memory_utilization=self.config.gpu_memory_utilization, weights=weights,
                          activations=activations, sampler=sampler, cuda_graphs=graphs,
                          non_torch=max(total - free - cuda.memory_reserved(), 0), bytes_per_block=per_block)
        if self.rank == 0:
            logger.info("%s", plan.describe())
        plan.check()
        self.memory_plan = plan
        return plan.num_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        heads = self.model_config.get_num_kv_heads(self.world_size)
        dtype = self.kv_cache_dtype
        check_fp8_device(dtype, self.device)  # e4m3 on a pre-Ada GPU: refuse before allocating
        self.runner.initialize_cache(num_blocks, heads, dtype)
        if self.rank == 0:
            per_block = self.kv_bytes_per_block()
            logger.info("KV cache: %s (%s), %d B/token/rank, %d blocks = %.3f GiB/rank", self.config.kv_cache_dtype,
                        str(dtype).removeprefix("torch."), per_block // self.config.block_size, num_blocks,
                        per_block * num_blocks / 2**30)

    # ---------------------------------------------------------------- step
    def execute_model(self, plan: SchedulerOutput | ProbePlan) -> ModelRunnerOutput | None:
        if isinstance(plan, ProbePlan):
            self.runner.probe()
            out = ModelRunnerOutput(step_id=plan.step_id)
        else:
            t0 = time.perf_counter()
            out = self.runner.execute_model(plan)
            out.execute_s = time.perf_counter() - t0
        return out if self.rank == 0 else None

    def shutdown(self) -> None:
        if self.world_size > 1:
            parallel_state.destroy_tensor_parallel()
