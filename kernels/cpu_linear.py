"""Linear layers on CPU: whichever GEMM is fastest on the CPU at hand, measured at load.

The same fp32 ``F.linear`` runs at very different speeds across x86 CPUs: it goes through
MKL's sgemm, which is fast on some vendors' parts and slow on others (on some parts oneDNN
with a pre-packed weight was measured faster at every batch size: docs/notes/benchmarks-history.md
has the figures). The CPU also changes between runs of this project, so the
choice is made by a probe at load time, not hard-coded:

    "aten"    F.linear(x, W, b)                     plain [out, in] weight
    "onednn"  mkldnn._linear_pointwise(x, Wp, b)    Wp: W reordered once into oneDNN's
                                                    blocked layout (an opaque mkldnn tensor)
    "panel"   cpu_gemm.gemm(x, Wp, N, b)            Wp: W in 16-column panels, fp32 only,
                                                    AVX-512 or AVX2 (kernels/cpu_gemm.py)

A GGUF weight kept in its blocks (``--quantization gguf``) is a cpu_gguf.GGUFWeight, packed
at load, not by a backend; ``cpu_linear`` runs it with kernels/cpu_gguf.py whatever the probe
chose for the plain weights. AWQ / GPTQ int4 and fp8 weights (kernels/quant/) likewise run their
own GEMM, on CPU and CUDA.

All compute x W^T + b with fp32 accumulation (bf16 inputs included), so fp32 results
differ from each other only in summation order (~1e-6 relative). Each replaces the plain
weight: one copy of the weights whichever runs.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from . import cpu_gemm, cpu_gguf
from .quant import QUANT_WEIGHTS

BACKENDS = ("aten", "onednn", "panel")

# shape -> a new fp32 tensor for the panels (the worker passes one that is in huge pages)
Alloc = Callable[[tuple[int, ...]], torch.Tensor]


_ONEDNN_DTYPES: dict[torch.dtype, bool] = {}


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """torch has oneDNN's linear ops and they pack ``dtype`` on this CPU (bf16 needs
    AVX-512 BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only part oneDNN refuses to pack it)."""
    if dtype not in _ONEDNN_DTYPES:
        ok = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
              and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
        if ok:
            try:
                pack_weight(torch.zeros(16, 16, dtype=dtype))
            except RuntimeError:
                ok = False
        _ONEDNN_DTYPES[dtype] = ok
    return _ONEDNN_DTYPES[dtype]


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] (fp32 or bf16, CPU) -> oneDNN's blocked layout for ``linear_onednn``."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"pack_weight needs a 2-D CPU weight, got {tuple(weight.shape)} on {weight.device}.")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear_onednn(x: torch.Tensor,  # [..., in], same dtype as the packed weight
                  packed: torch.Tensor,  # pack_weight(W), W [out, in]
                  bias: torch.Tensor | None = None) -> torch.Tensor:  # [..., out]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def panel_available(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and cpu_gemm.available()


class PanelWeight:
    """W [N, K] in cpu_gemm's panel layout, with N (the panels are padded to 16 rows)."""

    __slots__ = ("panels", "n")

    def __init__(self, weight: torch.Tensor, alloc: Alloc | None = None) -> None:
        out = alloc(cpu_gemm.panel_shape(weight)) if alloc is not None else None
        self.panels = cpu_gemm.pack_panels(weight.detach(), out)
        self.n = weight.shape[0]

    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()


def pack_cpu_weight(weight: torch.Tensor, backend: str, alloc: Alloc | None = None):
    """W [out, in] in ``backend``'s layout, for :func:`cpu_linear`."""
    if backend == "onednn":
        return pack_weight(weight)
    if backend == "panel":
        if not panel_available(weight.dtype):
            raise RuntimeError(f"the panel GEMM needs fp32 weights and AVX-512 or AVX2 with FMA (got {weight.dtype}).")
        return PanelWeight(weight, alloc)
    raise ValueError(f"no packed layout for CPU linear backend {backend!r}.")


def cpu_linear(x: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` with W packed by :func:`pack_cpu_weight`."""
    if type(packed) is PanelWeight:
        return cpu_gemm.gemm(x, packed.panels, packed.n, bias)
    if type(packed) is cpu_gguf.GGUFWeight:
        return cpu_gguf.linear(x, packed, bias)
    if type(packed) in QUANT_WEIGHTS:  # AWQ / GPTQ int4, fp8 (kernels/quant/; CUDA as well)
        return packed.linear(x, bias)
    return linear_onednn(x, packed, bias)


def packed_nbytes(packed) -> int:
    """Bytes of a weight packed by :func:`pack_cpu_weight` (what a step reads of it)."""
    if type(packed) in (PanelWeight, cpu_gguf.GGUFWeight, *QUANT_WEIGHTS):
        return packed.nbytes()
    return packed.numel() * packed.element_size()


def probe_linear_backends(weights: list[torch.Tensor], batch_sizes: tuple[int, ...] = (1, 8, 32, 128),
                          reps: int = 5, alloc: Alloc | None = None) -> dict[str, dict[int, float]]:
    """Seconds for one pass of ``x W^T`` over every weight, per backend and batch size:
    ``{"aten": {1: s, 8: s, 32: s, 128: s}, "onednn": {...}, "panel": {...}}`` (the fastest of
    ``reps``; the backends' passes alternate, so a load change on the machine hits all alike;
    oneDNN and the panel GEMM only where they run here, the panels in ``alloc``'s memory). The
    fastest, not the median: noise only slows a pass, and on a shared 2-core guest a median
    of 3 could take two slow passes and flip the choice to aten in some starts, whose decode
    steps are then slower.

    Pass the model's weights in the order a step reads them, enough of them that they do
    not stay in cache from one pass to the next (cpu_backend.py takes up to 256 MB): a step
    streams its weights from memory, and so must the probe. Three hot weights in a loop
    make MKL look much closer to oneDNN than it is in a real decode step; a pass over the
    whole model shows the gap the steps see."""
    with torch.inference_mode():
        layouts: dict[str, list] = {"aten": weights}
        if weights and onednn_available(weights[0].dtype):
            layouts["onednn"] = [pack_weight(w) for w in weights]
        if weights and all(panel_available(w.dtype) for w in weights):
            layouts["panel"] = [PanelWeight(w, alloc) for w in weights]
        out: dict[str, dict[int, float]] = {name: {} for name in layouts}
        for m in batch_sizes:
            xs = [torch.randn(m, w.shape[1], dtype=w.dtype) for w in weights]
            times: dict[str, list[float]] = {name: [] for name in layouts}
            for rep in range(reps + 1):
                for name, ws in layouts.items():
                    fn = F.linear if name == "aten" else cpu_linear
                    t = time.perf_counter()
                    for x, p in zip(xs, ws):
                        fn(x, p)
                    if rep:  # the first pass warms caches and oneDNN's primitive cache
                        times[name].append(time.perf_counter() - t)
            for name in layouts:
                out[name][m] = min(times[name])
    return out


def relative_time(timings: dict[str, dict[int, float]], backend: str, baseline: str = "aten") -> float:
    """The geometric mean over batch sizes of ``backend``'s time / ``baseline``'s: each
    batch size is one regime (decode at 1, 8 and 32, prefill at 128) and counts alike. A sum
    of seconds would let the largest batch, many times the decode terms, decide alone, and a
    near-tie there flipped the choice on noise (a backend that wins clearly at decode sizes
    could lose to a near-tie at the largest one)."""
    ratios = [timings[backend][m] / timings[baseline][m] for m in timings[baseline]]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))
