"""Worker: one per tensor-parallel rank. Owns a weight shard, a KV-cache shard and a
ModelRunner; executes the plans it is sent. No ray in here: cluster/ wraps it in an
actor (or runs it in-process at tensor_parallel_size 1).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from pagedserve.kernels import AttentionMetadata, kv_cache_torch_dtype
from pagedserve.kernels.kv_quant import check_fp8_device
from pagedserve.scheduler.kv_cache_dtype import canonical_kv_cache_dtype, kv_cache_bytes_per_token
from pagedserve.scheduler.outputs import ModelRunnerOutput, ProbePlan, SchedulerOutput
from pagedserve.worker import parallel_state
from pagedserve.config import EngineConfig
from pagedserve.worker.cpu_affinity import format_core_list, parse_bind, pin_this_process
from pagedserve.worker.loader import load_model
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# CPU KV budget when neither kv_cache_memory_bytes nor num_gpu_blocks_override is given
# (vLLM's CPU backend defaults to 4 GiB as well); capped to a quarter of free RAM.
DEFAULT_CPU_KV_BYTES = 4 << 30


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
        self.device = torch.device(engine_config.resolve_device())
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
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local if torch.cuda.device_count() > local else 0)
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.world_size > 1:
            if not self.distributed_init_method:
                raise ValueError("tensor_parallel_size > 1 needs a distributed_init_method.")
            parallel_state.init_tensor_parallel(self.rank, self.world_size,
                                                self.distributed_init_method)
        torch.manual_seed(self.config.seed)

    def load_model(self) -> None:
        builds = []
        if self.device.type == "cpu" and os.environ.get("PAGEDSERVE_CPU_EXT", "1") != "0":
            # Build (first time on a machine kind, slow) or load the C++ kernels now, while the
            # engine starts, not inside the first request's forward pass: side by side (each
            # build is its own compiler process) and beside the weight load.
            from pagedserve.kernels import cpu_decode_attention, cpu_fused, cpu_gemm

            builds = [threading.Thread(target=ready, name="cpu-ext-build", daemon=True)
                      for ready in (cpu_gemm.available, cpu_decode_attention.available, cpu_fused.available)]
            for t in builds:
                t.start()
        self.model_config = ModelConfig.from_pretrained(
            self.model_path, dtype=self.config.dtype, max_model_len=self.config.max_model_len)
        backend = self.config.attention_backend
        if backend == "auto":
            from pagedserve.kernels import resolve_attention_backend

            backend = resolve_attention_backend("auto", self.device)
        model = load_model(self.model_config, self.device, attention_backend=backend)
        for t in builds:
            t.join()  # before the linear probe, which must not time a machine busy compiling
        if self.device.type == "cpu":
            from pagedserve.worker.layers.cpu_backend import apply_cpu_linear_backend

            self.cpu_linear_backend = apply_cpu_linear_backend(model)
        budget = self.config.scheduler_config(self.model_config.max_model_len).max_num_batched_tokens
        spec = self.config.speculative_config
        self.runner = ModelRunner(model, self.model_config, block_size=self.config.block_size,
                                  device=self.device, seed=self.config.seed, max_num_seqs=self.config.max_num_seqs,
                                  max_num_batched_tokens=budget, enforce_eager=self.config.enforce_eager,
                                  num_speculative_tokens=spec.num_speculative_tokens if spec else 0)

    # ---------------------------------------------------------------- KV sizing
    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """Storage dtype of the values: the model's ("auto") or a 1-byte quantised format."""
        return kv_cache_torch_dtype(canonical_kv_cache_dtype(self.config.kv_cache_dtype), self.model_config.dtype)

    def kv_bytes_per_block(self) -> int:
        """This rank's bytes per block, scales included (what the budget is divided by)."""
        mc = self.model_config
        per_token = kv_cache_bytes_per_token(mc.num_hidden_layers, mc.get_num_kv_heads(self.world_size),
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
        """Run the largest step the scheduler may send without a cache, see the peak,
        and give the rest of ``gpu_memory_utilization`` to KV blocks."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        num_tokens = self.config.max_num_batched_tokens or 2048
        dev = self.device
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        pos = torch.arange(num_tokens, dtype=torch.int64, device=dev)
        # One sequence of num_tokens rows, no cache: attention stays inside the chunk.
        md = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            block_table=torch.zeros((1, 1), dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            max_seqlen_q=num_tokens, max_seq_len=num_tokens,
            seq_lens_cpu=[num_tokens], query_lens_cpu=[num_tokens])
        with torch.inference_mode():
            hidden = self.runner.model(ids, pos, None, md)
            self.runner.model.compute_logits(hidden[-min(num_tokens, self.config.max_num_seqs):])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        budget = int(total * self.config.gpu_memory_utilization) - peak - max(used_by_others, 0)
        del hidden
        torch.cuda.empty_cache()
        if budget <= per_block:
            raise RuntimeError(
                f"no memory left for the KV cache: weights + activations peak at {peak / 2**30:.2f} GiB "
                f"of {total / 2**30:.2f} GiB at gpu_memory_utilization={self.config.gpu_memory_utilization}.")
        return budget // per_block

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
