"""fp32 ``y = x W^T + b`` on CPU over the weight in a panel layout of its own (a C++
extension, AVX-512 or AVX2 with FMA; built at worker start like cpu_fused.py):

    panels [ceil(N/16), K, 16]    panels[p, k, j] = W[16 p + j, k]   (rows past N are zero)

A step at decode batch sizes streams every weight once from memory, so the GEMM's speed is
the speed at which it reads W. In this layout a tile of 3 panels (48 output columns) reads
three contiguous streams, each k's 16 floats one 64-byte line, and every broadcast of
``x[m, k]`` feeds 3 FMAs; with AVX-512 a tile holds up to 9 rows of x (27 accumulators in
registers), so a step verifying 8 drafts reads each weight once. The tiles of one GEMM are
split over torch's intra-op threads by panel group, so each thread streams its own part of
W and x stays in cache. A tile prefetches its streams some lines ahead, and with more rows
than a tile holds, the group's tiles (balanced in size) prefetch the thread's next group into
L2 under their FMAs. The caller allocates the panels (pass ``out``) in
transparent huge pages (worker/cpu_memory.py), which a stream of weights wants as much as
the KV pool does.

Against oneDNN's pre-packed weights (kernels/cpu_linear.py), with the bench model's weights
streamed from memory on an AVX-512 Xeon, the panel GEMM is faster at decode batch sizes
(M up to 32) and about even beyond: at large M both are bound by the FMA units. (An
M-blocked loop order, x's rows kept in L2 across panel groups, was slower: more parallel
regions, less work in each.)
Summation over k is in order, one FMA per k, as in a plain dot product: fp32 results differ
from F.linear's in rounding only (~1e-6 relative).
With AVX2 and FMA only (AMD Zen 2, Intel before Skylake-SP) a panel is two 256-bit vectors
and a tile holds 2 rows of x by 3 panels (12 accumulators of the 16 registers), each weight
vector loaded once a k into a register and used by both rows (left to itself, GCC loads it
again for each row, and the tile waits on the load ports instead of the FMA units); 3 to 6 rows
(a step that verifies drafts) run one panel at a time in chunks of k, all rows in one pass
over the weights, prefetching each panel's stream; 7 to 10 rows run their 2-row tiles chunk by
chunk of k, so the panels are read from memory once and then from L1; 11 to 48 rows (drafts
verified for several sequences), and 9 or 10 where the weight has many panel groups a
thread, run a panel at a time in blocks of 4 to 6 rows read from L2, each block prefetching
its share of the next panel, so that the stream from memory overlaps the FMAs instead of
preceding them. Without
either the module builds but reports ``supported() == False``, and the load-time probe
(worker/layers/cpu_backend.py) never picks it. The C++ is kernels/cpu_gemm.cpp.
"""

from __future__ import annotations

import hashlib

import torch

from .cpu_build import LazyExtension, read_source

PANEL = 16  # output columns per panel: one 512-bit vector of fp32 (two 256-bit ones)

_SOURCE = read_source("cpu_gemm.cpp")

# The kernel's identity, for timings kept across runs (worker/layers/cpu_backend.py): a
# changed kernel is timed anew, not judged by its predecessor's figures.
SOURCE_ID = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]

_EXT = LazyExtension("pagedserve_cpu_gemm_v8", _SOURCE, ["-O3", "-march=native"],
                     "CPU panel-GEMM", "the linear layers use oneDNN or F.linear")


def available() -> bool:
    """The extension built and this CPU has AVX-512, or AVX2 with FMA."""
    mod = _EXT.get()
    return mod is not None and bool(mod.supported())


def panel_shape(weight: torch.Tensor) -> tuple[int, int, int]:
    n, k = weight.shape
    return (n + PANEL - 1) // PANEL, k, PANEL


def pack_panels(weight: torch.Tensor,  # [N, K] fp32
                out: torch.Tensor | None = None) -> torch.Tensor:  # [ceil(N/16), K, 16], filled
    """W into the panel layout; ``out`` (shape ``panel_shape(W)``, zeros or not) is the
    caller's allocation, e.g. in huge pages."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_panels needs a 2-D fp32 CPU weight, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}.")
    n, k = weight.shape
    shape = panel_shape(weight)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"pack_panels: out must be a contiguous fp32 {shape}, got {tuple(out.shape)}.")
    full = n // PANEL
    with torch.no_grad():
        out[:full].copy_(weight[: full * PANEL].view(full, PANEL, k).transpose(1, 2))
        if full < shape[0]:
            out[full].zero_()
            out[full, :, : n - full * PANEL].copy_(weight[full * PANEL:].t())
    return out


def gemm(x: torch.Tensor,  # [..., K] fp32, last dim contiguous
         panels: torch.Tensor,  # pack_panels(W), W [N, K]
         n: int,  # N: W's rows (the panels are padded to a multiple of 16)
         bias: torch.Tensor | None = None) -> torch.Tensor:  # [..., N]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=torch.float32)
    if x2.shape[0]:
        _EXT.get().gemm(out, x2, panels, bias)
    return out.view(*lead, n)
