"""Memory for a CPU worker: transparent huge pages for the KV cache, and malloc kept from
handing a step's large temporaries back to the kernel.

A decode step reads every running sequence's K/V blocks: 16-token blocks in random order
over a pool of hundreds of MB, each block spread over 4 KB pages, so the reads miss the
TLB at every block. Most distributions set THP to "madvise": a region gets 2 MB pages
only if it asks. The pool asks before its first touch (each first touch then faults in a
huge page, zeroed by the kernel), in a mapping of its own: from malloc's heap it could land
on pages that earlier buffers had touched (the load probe's weight copies, freed), which
stay 4 KB pages whatever it asks; that happened to the engine's pool once the probe grew.
The CPU panel GEMM's weights (kernels/cpu_gemm.py) are allocated the same way. In an
offline calibration run it raised throughput, and most of the time saved was in the GEMMs,
whose weight stream the KV pool's page walks had slowed, less in attention.

A no-op off Linux, on GPU tensors and where the kernel refuses (THP "never").

A step's activations are malloc'ed and freed every step (tens of MB at a 2048-token
prefill). glibc serves chunks above its mmap threshold with a fresh mmap and unmaps them on
free, so every step faulted its temporaries in again, page by page. :func:`tune_malloc`
raises the mmap and trim thresholds to 1 GB: freed chunks stay in the heap and the next
step reuses them, which raised offline throughput with either linear backend (oneDNN and
aten starts alike). Process-wide, so the worker calls it; the heap keeps up to that much
freed memory instead of returning it.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MALLOC_KEEP = 1 << 30

_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return _libc


def _madvise(addr: int, length: int, advice: int) -> bool:
    return _c().madvise(addr, length, advice) == 0


def tune_malloc() -> bool:
    """Keep large freed chunks in glibc's heap (see the module doc); True if applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = _c()
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MALLOC_KEEP)) and bool(libc.mallopt(M_TRIM_THRESHOLD, MALLOC_KEEP))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for 2 MB pages over the whole huge pages inside ``t``'s memory; True if asked."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    hi = end & ~(HUGE_PAGE - 1)
    if hi - lo < HUGE_PAGE:
        return False
    try:
        return _madvise(lo, hi - lo, MADV_HUGEPAGE)
    except OSError:
        return False


def _fresh_mapping(nbytes: int) -> torch.Tensor:
    """``nbytes`` (uint8, CPU) at a 2 MB boundary of an anonymous mapping of their own:
    pages nothing has touched, freed with the last tensor that views them."""
    # Private: Python's default for an anonymous mmap is MAP_SHARED, which is shmem, where
    # THP follows shmem_enabled ("never" on most systems), not the madvise below.
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # holds a reference to mm
    off = -raw.data_ptr() % HUGE_PAGE
    return raw[off: off + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros``; on CPU, from a size of one huge page up, in a fresh mapping that
    asks for huge pages before it is first touched. Such a mapping is not written here: the
    kernel hands out its pages zeroed, each at its first touch, so the cache costs memory
    as blocks are used, not all of it (seconds of page faults) before the engine starts."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= HUGE_PAGE and sys.platform.startswith("linux"):
        t = _fresh_mapping(nbytes).view(dtype).view(shape)
        advise_huge_pages(t)
        return t
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t.zero_()
