"""Linear layers on CPU: whichever GEMM is fastest on the CPU at hand, measured at load.

The same fp32 ``F.linear`` runs at very different speeds across x86 CPUs: it goes through
MKL's sgemm, which is fast on some vendors' parts and slow on others (measured on a 2-core
AMD EPYC: ~200 GFLOP/s at M >= 128 and 20-45 at M = 1, where oneDNN with a pre-packed
weight reaches 380-515 and 80). The CPU also changes between runs of this project, so the
choice is made by a probe at load time, not hard-coded:

    "aten"    F.linear(x, W, b)                     plain [out, in] weight
    "onednn"  mkldnn._linear_pointwise(x, Wp, b)    Wp: W reordered once into oneDNN's
                                                    blocked layout (an opaque mkldnn tensor)

Both compute x W^T + b with fp32 accumulation (bf16 inputs included), so fp32 results
differ from each other only in summation order (~1e-6 relative).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

BACKENDS = ("aten", "onednn")


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] (fp32 or bf16, CPU) -> oneDNN's blocked layout for ``linear_onednn``."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"pack_weight needs a 2-D CPU weight, got {tuple(weight.shape)} on {weight.device}.")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear_onednn(x: torch.Tensor,  # [..., in], same dtype as the packed weight
                  packed: torch.Tensor,  # pack_weight(W), W [out, in]
                  bias: torch.Tensor | None = None) -> torch.Tensor:  # [..., out]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def probe_linear_backends(weights: list[torch.Tensor], batch_sizes: tuple[int, ...] = (1, 8, 32, 128),
                          reps: int = 5) -> dict[str, dict[int, float]]:
    """Seconds for one pass of ``x W^T`` over every weight, per backend and batch size:
    ``{"aten": {1: s, 8: s, 32: s, 128: s}, "onednn": {...}}`` (the fastest of ``reps``; the
    two backends' passes alternate, so a load change on the machine hits both alike). The
    fastest, not the median: noise only slows a pass, and on a shared 2-core guest a median
    of 3 took two slow passes (oneDNN at M = 128: 77 ms against 51-55 in other starts) and
    flipped the choice to aten in 1 start of 3, whose decode steps are 1.3x slower at M = 8.

    Pass the model's weights in the order a step reads them, enough of them that they do
    not stay in cache from one pass to the next (cpu_backend.py takes up to 256 MB): a step
    streams its weights from memory, and so must the probe. Three hot weights in a loop
    measured MKL at M = 8 within 1.2-1.4x of oneDNN on a Xeon whose decode steps it made
    2x slower; a pass over the whole 63M model measured 1.7x (42 vs 25 ms, 1 thread)."""
    out: dict[str, dict[int, float]] = {"aten": {}}
    with torch.inference_mode():
        fns = {"aten": lambda x, w, p: F.linear(x, w)}
        packed = [None] * len(weights)
        if onednn_available():
            packed = [pack_weight(w) for w in weights]
            fns["onednn"] = lambda x, w, p: linear_onednn(x, p)
            out["onednn"] = {}
        for m in batch_sizes:
            xs = [torch.randn(m, w.shape[1], dtype=w.dtype) for w in weights]
            times: dict[str, list[float]] = {name: [] for name in fns}
            for rep in range(reps + 1):
                for name, fn in fns.items():
                    t = time.perf_counter()
                    for x, w, p in zip(xs, weights, packed):
                        fn(x, w, p)
                    if rep:  # the first pass warms caches and oneDNN's primitive cache
                        times[name].append(time.perf_counter() - t)
            for name in fns:
                out[name][m] = min(times[name])
    return out


def relative_time(timings: dict[str, dict[int, float]], backend: str, baseline: str = "aten") -> float:
    """The geometric mean over batch sizes of ``backend``'s time / ``baseline``'s: each
    batch size is one regime (decode at 1, 8 and 32, prefill at 128) and counts alike. A sum
    of seconds would let the largest batch, ~20x the decode terms, decide alone, and a
    near-tie there flipped the choice on noise (a 2.1 GHz Xeon: oneDNN 2x faster at
    M = 8, 10% slower at M = 1, equal at 128; the summed probe picked aten in some starts)."""
    ratios = [timings[backend][m] / timings[baseline][m] for m in timings[baseline]]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))
