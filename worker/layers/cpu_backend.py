"""Pick the CPU GEMM for a loaded model and apply it to every linear layer (and the LM head).

    --cpu-linear auto     (default) probe passes over the model's weights (up to 256 MB) at
                          batch sizes 1, 8, 32 and 128 with every backend that runs here, keep
                          the fastest (by the geometric mean of the per-batch-size time ratios)
    --cpu-linear panel    the panel GEMM of kernels/cpu_gemm.py (fp32; AVX-512 or AVX2), no probe
    --cpu-linear onednn   pre-packed oneDNN weights, no probe
    --cpu-linear aten     plain F.linear (MKL / OpenBLAS), no probe

(EngineConfig.cpu_linear.)
A mixture-of-experts layer's experts (worker/layers/fused_moe.py) are packed for
kernels/moe/cpu_experts.py (panels, one C++ call a layer) under auto and panel, whatever the
probe chose for the dense layers: each expert sees a few rows of a step, where the panels
beat the other GEMMs most (BENCHMARKS.md, the MoE rows); under aten and onednn, or off fp32 /
AVX2, they run the torch reference.
The probe is short and its result is logged with the timings, so a
figure in BENCHMARKS.md can be traced to the kernel that produced it. Its timings are kept in
$PAGEDSERVE_CACHE/cpu-linear-v1.json, keyed by everything that decides them (the CPU model and
its vector units, torch's version and thread count, the dtype and the probed weights' shapes):
the next start of the same model on the same kind of machine reads them instead of probing
again. Delete the file to probe anew. A packed backend
needs a 5% margin over aten to win (its mean time ratio <= 0.95): a probe on a busy
machine is noisy, and near-ties go to plain F.linear, the path transformers itself runs.
The panel weights are allocated in transparent huge pages (worker/cpu_memory.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile

import torch
from torch import nn

from pagedserve.kernels import cpu_gemm, cpu_gguf
from pagedserve.kernels.cpu_gguf import GGUFWeight
from pagedserve.kernels.cpu_linear import (BACKENDS, onednn_available, panel_available, probe_linear_backends,
                                           relative_time)
from pagedserve.kernels.moe import cpu_experts
from pagedserve.worker import cpu_memory
from pagedserve.worker.loading.model_cache import cache_root
from pagedserve.worker.layers.embedding import ParallelLMHead
from pagedserve.worker.layers.fused_moe import FusedMoE
from pagedserve.worker.layers.linear import PackableLinear

logger = logging.getLogger("pagedserve")

_PROBE_BYTES = 256 << 20  # keeps the load-time probe short (4 batch sizes x 2 backends x 4 passes)
_MARGIN = 0.95  # onednn must take <= 95% of aten's time (geometric mean over batch sizes)


def _packable(model: nn.Module) -> list[nn.Module]:
    """The GEMMs a backend packs: every linear layer and LM head not already in GGUF blocks."""
    return [m for m in model.modules() if isinstance(m, (PackableLinear, ParallelLMHead)) and m._packed is None]


def _num_quantized(model: nn.Module) -> int:
    return sum(isinstance(getattr(m, "_packed", None), GGUFWeight) for m in model.modules())


def _huge_page_alloc(shape: tuple[int, ...]) -> torch.Tensor:
    return cpu_memory.zeros(shape, torch.float32, torch.device("cpu"))


def choose_cpu_linear_backend(model: nn.Module, requested: str = "auto") -> tuple[str, dict]:
    """(one of BACKENDS, probe timings {backend: {batch size: seconds}} or {})."""
    requested = requested.lower()
    if requested not in BACKENDS + ("auto",):
        raise ValueError(f"cpu_linear must be 'auto' or one of {BACKENDS}, got {requested!r}.")
    dtype = next(model.parameters()).dtype
    if requested == "onednn" and not onednn_available(dtype):
        raise RuntimeError(f"--cpu-linear onednn, but this torch build has no oneDNN (mkldnn), or it "
                           f"cannot pack {dtype} weights on this CPU.")
    if requested == "panel" and not panel_available(dtype):
        raise RuntimeError(f"--cpu-linear panel needs fp32 weights ({dtype} here) and a CPU with "
                           "AVX-512 or AVX2 with FMA whose C++ extension builds.")
    if requested != "auto":
        return requested, {}
    if not (onednn_available(dtype) or panel_available(dtype)):
        return "aten", {}
    layers = [m for m in _packable(model) if isinstance(m, PackableLinear)]
    if not layers:  # none, or all in GGUF blocks (what remains is an LM head at most)
        return "aten", {}
    # The weights in the order a step reads them, up to _PROBE_BYTES: streamed from memory
    # as in a step (a few hot ones measured a cache, not the step; kernels/cpu_linear.py).
    weights, total = [], 0
    for m in layers:
        weights.append(m.weight.data)
        total += m.weight.numel() * m.weight.element_size()
        if total >= _PROBE_BYTES:
            break
    timings = _cached_probe(weights)
    ratios = {name: relative_time(timings, name) for name in timings if name != "aten"}
    best = min(ratios, key=ratios.__getitem__)
    return (best if ratios[best] <= _MARGIN else "aten"), timings


_PROBE_CACHE = "cpu-linear-v1.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _probe_key(weights: list[torch.Tensor]) -> str:
    """What the timings depend on; a different machine kind, torch, panel kernel or model
    shape probes anew."""
    parts = [_cpu_model(), torch.backends.cpu.get_cpu_capability(), torch.__version__, str(torch.get_num_threads()),
             str(weights[0].dtype), str(onednn_available(weights[0].dtype)), str(panel_available(weights[0].dtype)),
             cpu_gemm.SOURCE_ID,
             ";".join("x".join(map(str, w.shape)) for w in weights)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _cached_probe(weights: list[torch.Tensor]) -> dict[str, dict[int, float]]:
    path = os.path.join(cache_root(), _PROBE_CACHE)
    key = _probe_key(weights)
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        entries = {}
    if isinstance(entries, dict) and isinstance(entries.get(key), dict):
        logger.info("CPU linear probe read from %s", path)
        return {name: {int(m): float(t) for m, t in per_m.items()} for name, per_m in entries[key].items()}
    timings = probe_linear_backends(weights, alloc=_huge_page_alloc)
    entries = entries if isinstance(entries, dict) else {}
    entries[key] = timings
    try:  # atomic: replicas starting together each write a whole file
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".cpu-linear-")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("CPU linear probe not cached (%s)", e)
    return timings


def pack_cpu_experts(model: nn.Module, requested: str = "auto") -> int:
    """Pack every MoE layer's experts for cpu_experts (see the module doc); the number packed."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE) and m._cpu is None]
    if not layers or requested.lower() not in ("auto", "panel") or not cpu_experts.available(layers[0].w13_weight.dtype):
        return 0
    with torch.no_grad():
        for m in layers:
            m.pack_for_cpu(_huge_page_alloc)
    return len(layers)


def apply_cpu_linear_backend(model: nn.Module, requested: str = "auto") -> str:
    """Choose (see module doc) and, for "onednn" or "panel", pack every linear weight in place;
    pack the experts of MoE layers."""
    if next(model.parameters()).device.type != "cpu":
        return "device"
    quantized = _num_quantized(model)  # GEMMs that run on GGUF blocks whatever is chosen here
    backend, timings = choose_cpu_linear_backend(model, requested)
    if backend != "aten":
        with torch.no_grad():
            for m in _packable(model):
                m.pack_for_cpu(backend, _huge_page_alloc)
    moe = pack_cpu_experts(model, requested)
    if moe:
        logger.info("CPU MoE: the experts of %d layers in panels (kernels/moe/cpu_experts.py)", moe)
    shown = "; ".join(f"{k} " + " ".join(f"M={m} {t * 1e3:.2f}" for m, t in per_m.items()) + " ms"
                      for k, per_m in timings.items()) or "not probed"
    for name in timings:
        if name != "aten":
            shown += f"; {name}/aten time {relative_time(timings, name):.2f}"
    if quantized and backend == "aten" and not _packable(model):
        logger.info("CPU linear backend: gguf (all %d GEMMs on GGUF blocks, %s kernel; %d threads)", quantized,
                    cpu_gguf.isa(), torch.get_num_threads())
        return "gguf"
    logger.info("CPU linear backend: %s (probe: %s; %s, %d threads)%s", backend, shown,
                torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(),
                f"; {quantized} GEMMs on GGUF blocks" if quantized else "")
    return backend


def set_int8_activations(model: nn.Module, on: bool) -> int:
    """GGUF weights whose type has the int8 path multiply int8-quantized activations (``on``)
    or fp32 ones (EngineConfig.cpu_int8_activations); the number of GEMMs that take it. Not
    the LM head: its logits would carry x's rounding straight into the next token, and at a
    few rows a step it reads its bytes at the memory's speed either way."""
    n = 0
    for m in model.modules():
        packed = getattr(m, "_packed", None)
        if isinstance(packed, GGUFWeight):
            packed.int8 = on and not isinstance(m, ParallelLMHead) and \
                all(q in cpu_gguf.INT8_QTYPES for q in packed.qtypes())
            n += packed.int8
    if n:
        logger.info("CPU GGUF: %d GEMMs multiply int8 activations (--cpu-int8-activations)", n)
    return n
