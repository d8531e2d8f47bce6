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


def _median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def probe_linear_backends(weights: list[torch.Tensor], batch_sizes: tuple[int, ...] = (1, 8, 128),
                          reps: int = 5) -> dict[str, float]:
    """Seconds for one pass of ``x W^T`` over every weight at every batch size, per
    backend (medians of ``reps``). The weights should be the model's own largest ones,
    so the probe measures the shapes it will run (a few ms each on a small model)."""
    out: dict[str, float] = {}
    with torch.inference_mode():
        xs = {(m, w.shape[1], w.dtype): torch.randn(m, w.shape[1], dtype=w.dtype) for w in weights
              for m in batch_sizes}
        out["aten"] = sum(_median_s(lambda x=xs[(m, w.shape[1], w.dtype)], w=w: F.linear(x, w), reps)
                          for w in weights for m in batch_sizes)
        if onednn_available():
            packed = [pack_weight(w) for w in weights]
            out["onednn"] = sum(
                _median_s(lambda x=xs[(m, w.shape[1], w.dtype)], p=p: linear_onednn(x, p), reps)
                for w, p in zip(weights, packed) for m in batch_sizes)
    return out
