"""How a CUDA worker splits its share of the GPU between what a step needs and the KV cache.

    total memory x gpu_memory_utilization
      - weights          what the loaded model and the persistent step buffers hold
      - activations      the peak of the largest step the scheduler may send (its token
                         budget, or its verify rows, in one forward), with the logits of
                         every row that samples and a prompt-logprobs chunk
      - sampler          its peak at the most rows a step samples (max_num_seqs, times
                         1 + num_speculative_tokens with speculation), top-k/top-p,
                         penalties and logprobs all on
      - CUDA graphs      the decode graphs' private pool, captured once on a small cache
                         (they are captured again on the real one)
      - non-torch        what torch does not allocate: the CUDA context, NCCL's buffers,
                         other processes on the device
      = KV cache         // bytes per block (every layer's K and V, and their scales)

Each share is measured on the device (worker.py profiles them); this file is the
arithmetic and the start-up line that names each share. ``profile_shapes`` says what the
profile must run, from the config alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.config import EngineConfig

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class ProfileShapes:
    """The largest work one step may bring, which the memory profile runs."""

    num_tokens: int  # rows of the largest forward: the token budget, or every verify row
    num_sample_rows: int  # rows sampled in one step (each verify row samples)
    # Whether a request may ask for logprobs (max_logprobs != 0): then every sampled row
    # and a prompt-logprobs chunk take a log-softmax over the vocabulary.
    logprobs: bool
    graph_max_rows: int  # the largest decode batch a CUDA graph is captured for (0: none)


def profile_shapes(config: EngineConfig, max_model_len: int, graphs: bool,
                   max_capture_size: int) -> ProfileShapes:
    spec = config.speculative_config
    rows = config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
    budget = config.scheduler_config(max_model_len).max_num_batched_tokens
    return ProfileShapes(num_tokens=max(budget, rows), num_sample_rows=rows, logprobs=config.max_logprobs != 0,
                         graph_max_rows=min(rows, max_capture_size) if graphs else 0)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes of one rank's GPU, each share measured (see the module doc)."""

    total: int
    gpu_memory_utilization: float
    weights: int
    activations: int
    sampler: int
    cuda_graphs: int
    non_torch: int
    bytes_per_block: int

    @property
    def usable(self) -> int:
        return int(self.total * self.gpu_memory_utilization)

    @property
    def kv_cache(self) -> int:
        return self.usable - self.weights - self.activations - self.sampler - self.cuda_graphs - self.non_torch

    @property
    def num_blocks(self) -> int:
        return max(self.kv_cache, 0) // self.bytes_per_block

    def describe(self) -> str:
        def g(n: int) -> str:
            return f"{n / GiB:.2f}"

        return (f"GPU memory: {g(self.total)} GiB x gpu_memory_utilization {self.gpu_memory_utilization:g} = "
                f"{g(self.usable)} GiB: weights {g(self.weights)}, activations {g(self.activations)}, "
                f"sampler {g(self.sampler)}, CUDA graphs {g(self.cuda_graphs)}, non-torch {g(self.non_torch)}, "
                f"KV cache {g(max(self.kv_cache, 0))} GiB = {self.num_blocks} blocks of "
                f"{self.bytes_per_block} B")

    def check(self) -> None:
        """RuntimeError naming every share when not one block fits."""
        if self.num_blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache. {self.describe()}. Raise "
                               "--gpu-memory-utilization, lower --max-num-batched-tokens, --max-num-seqs or "
                               "--max-logprobs 0, pass --enforce-eager, or use more GPUs (--tensor-parallel-size).")
