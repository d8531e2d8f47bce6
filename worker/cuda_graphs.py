"""CudaGraphRunner: decode steps replayed from CUDA graphs, one per padded batch size.

A decode step of a small model is launch-bound: hundreds of small kernels whose host-side
launch cost exceeds their run time. A CUDA graph records the launches once and replays
them with one call. What a graph needs, and where it comes from:

* fixed input addresses: the step buffers (step_buffers.py), filled in place each step;
* fixed shapes: a decode-only batch of n rows runs as the smallest captured size >= n
  (1, 2, 4, 8, then multiples of 8 up to max_num_seqs), the extra rows padded so they
  write nothing and are never sampled;
* no host values inside: the captured attention metadata bounds the longest context
  by max_model_len and carries no host lists (StepBuffers.graph_metadata).

Prefill and mixed steps, and decode batches above the largest size, run eagerly through
the same buffers. On a CPU a decode step of a plain Llama runs as kernel calls bound once
(cpu_decode_path.py: the Python between the kernels is what a graph removes on a GPU),
built with the cache like the graphs. Graphs are captured only on CUDA with the Triton
attention backend (the torch backend reads lengths on the host) and without ``enforce_eager``.
With ``pad_eager`` the same padded shapes run eagerly: on a CPU that is how tests check
the padding and buffer logic the graphs replay (padding only wastes compute there, so it
is off by default).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from pagedserve.worker.step_buffers import StepBuffers, StepInputs

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512  # vLLM's bound too: above it a step is long enough that launches do not matter


def capture_sizes(max_num_seqs: int, max_capture_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to min(max_num_seqs, max_capture_size), that bound
    included, so every batch the scheduler may send below it has a graph."""
    cap = min(max_num_seqs, max_capture_size)
    sizes = [s for s in (1, 2, 4) if s <= cap] + list(range(8, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def graphs_disabled_reason(device: torch.device, attention_backend: str, enforce_eager: bool) -> str | None:
    """Why this runner must run eagerly, or None when decode graphs can be captured."""
    if enforce_eager:
        return "enforce_eager is set"
    if device.type != "cuda":
        return f"the device is {device.type}"
    if attention_backend != "triton":
        return f"the {attention_backend!r} attention backend reads sequence lengths on the host"
    return None


def cpu_dtype_warning(dtype: str, gguf: bool) -> str | None:
    """What a CPU model in ``dtype`` other than float32 costs, and the fix (None for
    float32): the CPU kernels between the GEMMs (decode attention, norms, rotary, the bound
    decode path) take float32, so its steps run torch's reference ops there (BENCHMARKS.md
    has the cost). GGUF weights compute in float32 whatever the dtype. The worker logs it,
    and ``pagedserve serve`` too (a worker's log is not on its console)."""
    if dtype in ("float32", "torch.float32"):
        return None
    return (f"the model runs in {dtype.removeprefix('torch.')} on the CPU, whose kernels between the GEMMs take "
            "float32: they run as torch's reference ops, several times slower. --dtype float32 is the CPU's fast "
            "path" + (", and GGUF weights compute in float32 whatever --dtype says." if gguf else "."))


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, buffers: StepBuffers, sizes: list[int], *, use_graphs: bool,
                 pad_eager: bool = False) -> None:
        self.model = model
        self.buffers = buffers
        self.sizes = sorted(sizes)
        self.use_graphs = use_graphs
        self.pad_eager = pad_eager
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # size -> (graph, static hidden)
        self.cpu_path = None  # cpu_decode_path.CPUDecodePath, once the cache exists (capture)

    def padded_size(self, num_rows: int) -> int | None:
        """The captured size a decode-only batch of ``num_rows`` runs as; None: eager, unpadded."""
        if not (self.use_graphs or self.pad_eager):
            return None
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    @torch.inference_mode()
    def capture(self, kv_caches: list) -> None:
        """Largest size first, all in one memory pool: smaller graphs reuse the largest's
        activations (only one graph runs at a time). Each size runs once before capture so
        Triton compiles and cuBLAS picks its kernels outside the graph. On a CPU: the bound
        decode path instead, where the model fits it."""
        if self.buffers.device.type == "cpu":
            from pagedserve.kernels.cpu_gguf import GGUFWeight
            from pagedserve.worker.cpu_decode_path import CPUDecodePath

            self.cpu_path, why = CPUDecodePath.build(self.model, kv_caches)
            logger.info("CPU decode path: %s", "bound" if why is None else f"off ({why})")
            dtype = getattr(getattr(self.model, "config", None), "dtype", torch.float32)  # a test's bare module: none
            if dtype != torch.float32:  # only then is the model's weight kind worth a walk over its modules
                gguf = any(type(getattr(m, "_packed", None)) is GGUFWeight for m in self.model.modules())
                logger.warning("%s", cpu_dtype_warning(str(dtype), gguf))
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            self.buffers.fill([], [], [], [], 0, pad_to=size)  # padding rows only: writes nothing
            md = self.buffers.graph_metadata(size)
            v = self.buffers.views(size, size, self.buffers.max_blocks_per_seq)
            self.model(v["input_ids"], v["positions"], kv_caches, md)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(v["input_ids"], v["positions"], kv_caches, md)
            pool = graph.pool()
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("CUDA graphs: captured %d decode sizes (%s) in %.1f s", len(self.sizes),
                    ", ".join(map(str, self.sizes)), time.perf_counter() - t0)

    def release(self) -> None:
        """Drop the graphs and their pool (the memory profile captures them once to
        measure the pool, then again on the real cache)."""
        self.graphs.clear()
        self.cpu_path = None  # bound to that cache

    def forward(self, inputs: StepInputs, kv_caches: list) -> torch.Tensor:
        """Hidden states of every row of ``inputs`` (padding included). A replayed graph
        returns its static output: read it before the next step overwrites it."""
        entry = self.graphs.get(inputs.num_rows) if inputs.padded else None
        if entry is None:
            if self.cpu_path is not None:
                hidden = self.cpu_path.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
                if hidden is not None:
                    return hidden
            return self.model(inputs.input_ids, inputs.positions, kv_caches, inputs.attn_metadata)
        graph, hidden = entry
        graph.replay()
        return hidden
