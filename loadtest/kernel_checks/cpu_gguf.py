"""Micro-benchmark of the GGUF GEMMs (kernels/cpu_gguf.cpp) on the default model's own tensors.

    python -m pagedserve.loadtest.kernel_checks.cpu_gguf [--gguf F] [--rows 1 4 42] [--threads 1] [--repeat 7]
    python -m pagedserve.loadtest.kernel_checks.cpu_gguf --random Q5_K [--rows 1 8 42]

One layer's seven projections (q, k, v, o, gate, up, down) of the file, packed as the worker
packs them, per call set (µs, best of --repeat, interleaved): fp32 activations, int8
activations on this build's int8 kernels (AVX-512 VNNI where the CPU has it), and, on a VNNI
build, the same int8 kernels built for AVX2 only (``-DPS_NO_VNNI``; their results are checked
bit-identical), with the ratios. The CPU is named on the first line. ``--random TYPE``: three
GEMMs of random weights quantized to TYPE here (RANDOM_SHAPES: rows whole super-blocks of 256,
as the default model's 576 are not) instead of the file's layer, for the K-quants.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pagedserve.kernels import cpu_gguf
from pagedserve.kernels.cpu_build import LazyExtension, read_source
from pagedserve.loadtest.peers.llama_cpp import cpu_model

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
RANDOM_SHAPES = ((1536, 768), (768, 1536), (2048, 512))  # (N, K) of --random's GEMMs


def layer_parts(path: str, layer: int) -> list[cpu_gguf.GGUFPart]:
    from gguf import GGUFReader

    parts = []
    for t in GGUFReader(path).tensors:
        wanted = t.name.rsplit(".", 1)[0] in {f"blk.{layer}.{p}" for p in PROJECTIONS}
        if wanted and t.tensor_type.name in cpu_gguf.QTYPES:
            k, n = int(t.shape[0]), int(t.shape[1])
            raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(n, -1))
            parts.append(cpu_gguf.pack(raw, t.tensor_type.name, k))
    return parts


def random_parts(qtype: str) -> list[cpu_gguf.GGUFPart]:
    from pagedserve.loadtest.gguf_writer import quantize

    parts = []
    for i, (n, k) in enumerate(RANDOM_SHAPES):
        w = np.random.default_rng(i).standard_normal((n, k)).astype(np.float32) * 0.05
        raw = torch.from_numpy(quantize(w, qtype).view(np.uint8).reshape(n, -1))
        parts.append(cpu_gguf.pack(raw, qtype, k))
    return parts


def avx2_module():
    """The extension built with its int8 kernels for AVX2 only (None where it cannot build)."""
    ext = LazyExtension("pagedserve_cpu_gguf_avx2_bench", read_source("cpu_gguf.cpp"),
                        ["-O3", "-march=native", "-ffp-contract=off", "-DPS_NO_VNNI"], "AVX2 GGUF GEMM", "skipped")
    return ext.get()


def time_set(mod, parts, xs, int8: bool, outs) -> float:
    t0 = time.perf_counter()
    for p, x, out in zip(parts, xs, outs):
        mod.gemm(out, x, p.packed, p.qid, None, int8)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="a .gguf file (default: the default model's)")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--random", default=None, choices=tuple(cpu_gguf.QTYPES),
                    help="random weights of this type in RANDOM_SHAPES instead of the file's layer")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 42])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    if args.gguf is None:
        from pagedserve.worker.loading.model_source import default_model_file
        args.gguf = default_model_file()
    torch.set_num_threads(args.threads)
    mod = cpu_gguf._EXT.get()
    isa = mod.isa()
    parts = random_parts(args.random) if args.random else layer_parts(args.gguf, args.layer)
    print(f"{cpu_model()}; {args.threads} thread(s); build {isa}; "
          + (f"random {args.random}" if args.random else f"layer {args.layer}") + ": "
          + ", ".join(f"{p.qtype} {p.n}x{p.k}" for p in parts))
    other = avx2_module() if isa == "avx512vnni" else None
    variants = [("fp32", mod, False), (f"int8 {isa}", mod, True)] + ([("int8 avx2", other, True)] if other else [])
    g = torch.Generator().manual_seed(0)
    for m in args.rows:
        xs = [torch.randn(m, p.k, generator=g) for p in parts]
        outs = {name: [torch.empty(m, p.n) for p in parts] for name, _, _ in variants}
        best = {name: float("inf") for name, _, _ in variants}
        for _ in range(args.repeat):
            for name, md, int8 in variants:
                best[name] = min(best[name], time_set(md, parts, xs, int8, outs[name]))
        line = [f"rows {m:3d}:"] + [f"{name} {best[name] * 1e6:8.1f} us" for name, _, _ in variants]
        line.append(f"fp32/int8 {best['fp32'] / best[f'int8 {isa}']:.2f}x")
        if other:
            same = all(torch.equal(a, b) for a, b in zip(outs[f"int8 {isa}"], outs["int8 avx2"]))
            strip = m > 4 and any(p.qtype in ("Q5_K", "Q6_K") for p in parts)  # AVX2: fp32 there (gemm_int8)
            note = "the AVX2 build runs fp32 here" if strip else "bit-identical" if same else "DIFFER"
            line.append(f"avx2/vnni {best['int8 avx2'] / best[f'int8 {isa}']:.2f}x ({note})")
        print("  ".join(line))


if __name__ == "__main__":
    main()
